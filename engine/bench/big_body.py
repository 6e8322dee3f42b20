"""Huge text bodies against `killick serve`: how fast each is refused, what it costs the server's memory, and
whether /health keeps answering meanwhile.

    python -m engine.bench.big_body [--mb 50,20,2] [--repeat 3] [--json OUT]

Starts a demo-model `killick serve` on loopback (default context, 32,768 tokens). For each size, --repeat
distinct /v1/chat/completions requests whose user message is that many MB of text go out one after another
on their own connection, while another task asks /health every 20 ms. Per request: the status, the time from
the first byte sent to the status line, the server's RSS before, at its peak (read every 10 ms) and 2 s
after the answer, and the slowest /health answer while the body was in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from engine.bench.args import print_and_save
from engine.bench.server_process import ServerProcess

HEALTH_EVERY_S = 0.02


async def _health_latencies(port: int, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await reader.read()
        writer.close()
        await writer.wait_closed()
        out.append(time.perf_counter() - start)
        await asyncio.sleep(HEALTH_EVERY_S)


async def _rss_peak(server: ServerProcess, stop: asyncio.Event) -> float:
    peak = 0.0
    while not stop.is_set():
        peak = max(peak, server.rss_mb())
        await asyncio.sleep(0.01)
    return peak


async def _post(port: int, body: bytes) -> tuple[int, float]:
    """Status and seconds from the first byte sent to the status line; the body goes on being written
    meanwhile, as a client does (the server reads and drops what it refused)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()

    async def write() -> None:
        try:
            writer.write(head)
            for i in range(0, len(body), 1 << 20):
                writer.write(body[i:i + (1 << 20)])
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # refused and closed before the rest was read

    sending = asyncio.ensure_future(write())
    status_line = await reader.readline()
    took = time.perf_counter() - start
    await reader.read()
    await sending
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
    return int(status_line.split()[1]), took


async def one(server: ServerProcess, mb: int, n: int) -> dict:
    text = f"{n} " + "the agent pasted a very long log line again " * (mb * 2**20 // 44)
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}).encode()
    del text
    before = server.rss_mb()
    stop, latencies = asyncio.Event(), []
    health = asyncio.ensure_future(_health_latencies(server.port, stop, latencies))
    peak = asyncio.ensure_future(_rss_peak(server, stop))
    status, took = await _post(server.port, body)
    stop.set()
    await health
    peak_mb = await peak
    await asyncio.sleep(2.0)
    return {"mb": mb, "status": status, "answer_s": round(took, 3), "rss_before_mb": round(before, 1),
            "rss_peak_mb": round(peak_mb, 1), "rss_after_mb": round(server.rss_mb(), 1),
            "health_max_ms": round(1e3 * max(latencies, default=0.0), 1), "health_probes": len(latencies)}


async def run(sizes: list[int], repeat: int) -> list[dict]:
    with ServerProcess() as server:
        await _post(server.port, json.dumps({"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "warm up"}]}).encode())
        return [await one(server, mb, n) for mb in sizes for n in range(repeat)]


def table(rows: list[dict]) -> str:
    out = [f"{'MB':>4} {'status':>6} {'answer s':>9} {'RSS before':>10} {'peak':>7} {'after':>7} {'growth':>7} "
           f"{'/health max ms':>14}"]
    for r in rows:
        out.append(f"{r['mb']:>4} {r['status']:>6} {r['answer_s']:>9.3f} {r['rss_before_mb']:>10.1f} "
                   f"{r['rss_peak_mb']:>7.1f} {r['rss_after_mb']:>7.1f} {r['rss_after_mb'] - r['rss_before_mb']:>7.1f} "
                   f"{r['health_max_ms']:>14.1f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.big_body", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="50,20,2", help="comma-separated body sizes in MB")
    ap.add_argument("--repeat", type=int, default=3, help="distinct bodies of each size")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    return print_and_save(asyncio.run(run([int(x) for x in args.mb.split(",")], args.repeat)), print_rows, args.json)


def print_rows(rows: list[dict]) -> None:
    print(table(rows))
    by_mb = {mb: [r for r in rows if r["mb"] == mb] for mb in sorted({r["mb"] for r in rows})}
    for mb, rs in by_mb.items():
        print(f"{mb} MB: median answer {statistics.median(r['answer_s'] for r in rs):.3f} s, "
              f"worst /health {max(r['health_max_ms'] for r in rs):.0f} ms, "
              f"RSS growth after {max(r['rss_after_mb'] - r['rss_before_mb'] for r in rs):.1f} MB")


if __name__ == "__main__":
    raise SystemExit(main())
