"""A bounded soak of `killick serve`: four replayed agent sessions at once, plus clients that disconnect,
with the prefix cache at a fixed budget. RSS, open files and engine counters must stay flat, with 0 errors.

    python -m engine.bench.soak [--minutes 3] [--every 30] [--cache-device-mb 32] [--cache-host-mb 64]
                                [--recordings NAME,...] [--json OUT]

Starts a demo-model `killick serve --allow-forced-responses` on loopback. Each of four tasks replays one bundled
recording (mini-swe-agent, opencode, codex, openclaw by default) turn after turn, forcing the recorded answers, and
starts it over with its first message tagged by the cycle, so the cache keeps seeing new turns on the shared system
prompts. A fifth task sends a fresh long streamed or whole request every second and hangs up 50 ms to 1 s in. Every
--every seconds one row: the server's RSS and open files, the engine's active / queued requests, live states,
prefix-cache bytes and nodes per tier, the tokenizer's piece cache, and the requests, errors and disconnects so far.
At the end (in-flight requests finish, bounded) the verdict: RSS change from the first row where the prefix cache
and the piece cache hold 90% of their budgets (the first quarter's last row if that never happens) to the end, open
files, nothing left active, errors (non-200 answers, failed clients, ERROR lines in the server log). The budgets are
small by default so that the cache is full early and what follows shows whether anything else grows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from engine.bench.server_process import REPO, ServerProcess

SESSIONS = REPO / "fixtures" / "sessions"
DEFAULT_RECORDINGS = ("mini-swe-agent", "opencode", "codex", "openclaw")
WORDS = "cache eviction keeps the host tier within its budget while agents edit files and run tests".split()


def tag(body: dict, label: str) -> dict:
    """A copy of a request body whose first message text starts with `label` (the system text stays shared)."""
    out = json.loads(json.dumps(body))
    for key in ("messages", "input", "system", "instructions"):
        if key in out and _prepend(out, key, label):
            break
    return out


def _prepend(node, key, label: str) -> bool:
    value = node[key]
    if isinstance(value, str):
        node[key] = label + value
        return True
    if isinstance(value, list):
        return any(_prepend(value, i, label) for i in range(len(value)))
    if isinstance(value, dict):
        return any(_prepend(value, k, label) for k in ("text", "content") if k in value)
    return False


class Soak:
    def __init__(self, url: str, deadline: float):
        self.url, self.deadline = url, deadline
        self.requests = self.errors = self.disconnects = 0
        self.error_samples: list[str] = []

    def failed(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(what[:300])

    async def session(self, http: aiohttp.ClientSession, entries: list, name: str) -> None:
        from proxy.replay.client import send

        cycle = 0
        while time.monotonic() < self.deadline:
            cycle += 1
            for turn, entry in enumerate(entries, 1):
                if time.monotonic() >= self.deadline:
                    return
                tagged = replace(entry, body=tag(entry.body, f"[soak {name} cycle {cycle}] "))
                try:
                    result = await send(http, self.url, tagged, turn, unforced_max_tokens=16, timeout_s=600)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self.failed(f"{name} turn {turn}: {exc!r}")
                    continue
                self.requests += 1
                if result.status != 200:
                    self.failed(f"{name} turn {turn}: {result.status} {result.error}")

    async def hang_ups(self, port: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            words = " ".join(rng.choice(WORDS) + str(rng.randrange(10**6)) for _ in range(3000))
            body = json.dumps({"model": "m", "max_tokens": 64, "stream": rng.random() < 0.5,
                               "messages": [{"role": "user", "content": words}]}).encode()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                writer.close()
                await writer.wait_closed()
                self.disconnects += 1
            except (ConnectionError, OSError) as exc:
                self.failed(f"hang-up client: {exc!r}")
            await asyncio.sleep(1.0)


async def sample(http: aiohttp.ClientSession, server: ServerProcess, soak: Soak, started: float) -> dict:
    async with http.get(server.url + "/v1/killick/stats") as r:
        data = await r.json()
    stats, tok = data["engine"], data.get("tokenizer") or {}
    return {"t_s": round(time.monotonic() - started), "rss_mb": round(server.rss_mb(), 1),
            "open_files": server.open_files(), "active": stats.get("active"), "queued": stats.get("queued"),
            "live_states": stats.get("live_states"),
            "dev_mb": round((stats.get("cache_device_bytes") or 0) / 2**20, 1),
            "host_mb": round((stats.get("cache_host_bytes") or 0) / 2**20, 1),
            "dev_nodes": stats.get("cache_device_nodes"), "host_nodes": stats.get("cache_host_nodes"),
            "tok_mb": round((tok.get("piece_cache_bytes") or 0) / 2**20, 1),
            "tok_full": (tok.get("piece_cache_bytes") or 0) >= 0.9 * (tok.get("piece_cache_budget") or 1),
            "requests": soak.requests, "errors": soak.errors + server.error_lines, "hang_ups": soak.disconnects}


async def run(args) -> tuple[list[dict], Soak, dict]:
    from proxy.cli.replay import context_needed
    from proxy.replay import log as replay_log

    recordings = [SESSIONS / f"{name}.jsonl.gz" for name in args.recordings.split(",")]
    entries = {p.name.split(".")[0]: replay_log.load([p]) for p in recordings}
    context = context_needed([e for es in entries.values() for e in es])
    flags = ["--allow-forced-responses", "--max-running", "4", "--context-length", str(context),
             "--cache-device-mb", str(args.cache_device_mb), "--cache-host-mb", str(args.cache_host_mb)]
    samples = []
    with ServerProcess(flags) as server:
        started = time.monotonic()
        soak = Soak(server.url, started + args.minutes * 60)
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.ensure_future(soak.session(http, es, name)) for name, es in entries.items()]
            tasks.append(asyncio.ensure_future(soak.hang_ups(server.port)))
            samples.append(await sample(http, server, soak, started))
            print(_row(samples[-1], header=True), flush=True)
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=args.every)
                samples.append(await sample(http, server, soak, started))
                print(_row(samples[-1]), flush=True)
            for t in tasks:
                t.result()  # a task that raised is a bug of the soak itself: say so
            await asyncio.sleep(2.0)  # aborted requests leave the engine
            final = await sample(http, server, soak, started)
        soak.error_samples += [f"server log: {line}" for line in server.errors]
    return samples, soak, final


COLUMNS = ("t_s", "rss_mb", "open_files", "active", "queued", "live_states", "dev_mb", "host_mb", "dev_nodes",
           "host_nodes", "tok_mb", "requests", "errors", "hang_ups")


def _row(s: dict, header: bool = False) -> str:
    line = " ".join(f"{str(s.get(c)):>10}" for c in COLUMNS)
    return (" ".join(f"{c:>10}" for c in COLUMNS) + "\n" + line) if header else line


def verdict(samples: list[dict], final: dict, budget_mb: float) -> dict:
    full = [s for s in samples if s["dev_mb"] + s["host_mb"] >= 0.9 * budget_mb and s["tok_full"]]
    base = full[0] if full else samples[min(len(samples) - 1, max(1, len(samples) // 4))]
    return {"baseline_t_s": base["t_s"], "rss_baseline_mb": base["rss_mb"], "rss_end_mb": final["rss_mb"],
            "rss_change_mb": round(final["rss_mb"] - base["rss_mb"], 1),
            "open_files_start": samples[0]["open_files"], "open_files_end": final["open_files"],
            "active_end": final["active"], "live_states_end": final["live_states"],
            "cache_within_budget": all(s["dev_mb"] + s["host_mb"] <= budget_mb for s in samples + [final]),
            "requests": final["requests"], "hang_ups": final["hang_ups"], "errors": final["errors"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long new requests are sent (default 3)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between rows (default 30)")
    ap.add_argument("--cache-device-mb", type=int, default=32, help="prefix cache, device tier (default 32)")
    ap.add_argument("--cache-host-mb", type=int, default=64, help="prefix cache, host tier (default 64)")
    ap.add_argument("--recordings", default=",".join(DEFAULT_RECORDINGS),
                    help="bundled recordings (fixtures/sessions/NAME.jsonl.gz), one task each")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    samples, soak, final = asyncio.run(run(args))
    result = verdict(samples, final, args.cache_device_mb + args.cache_host_mb)
    print("\nverdict: " + ", ".join(f"{k} {v}" for k, v in result.items()))
    for line in soak.error_samples:
        print("error:", line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "final": final,
                                               "verdict": result, "errors": soak.error_samples}, indent=1))
    return 0 if result["errors"] == 0 and result["active_end"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
