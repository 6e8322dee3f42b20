"""`killick bench upstream`: the bundled recordings as concurrent agent sessions through the proxy in front of
replicas, each routing policy on fresh replicas: how much of each prompt the upstreams reused and how fast
later turns start.

    killick bench upstream [FILE ...] [--replicas 3] [--modes single,session,round-robin] [--model DIR]
                           [--limit N] [--json OUT]

Modes: `single` = one replica (the reference: every session finds its prefix), `session` = session-affine
routing over --replicas, `round-robin` = every request to the next replica. Each mode starts its own
`killick serve --allow-forced-responses` processes (each its own engine and prefix cache, the demo model unless
--model), the proxy in-process on loopback, and replays every recording as one client (its requests in order,
all recordings at once, streaming) with the recorded answers forced. Prints one row per mode: requests,
failures, prompt and cached tokens, cached fraction (and its ratio to single), median TTFT of first and later
turns.

`Servers` (N `killick serve` processes on free loopback ports: replicas, or a proxy with --upstream; stop, kill
or restart one) is what the upstream tests use too.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "sessions"
MODES = ("single", "session", "round-robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """N `killick serve ARGS` processes on loopback (--allow-forced-responses), started together. Output goes to
    log files (a full pipe would stall a server), removed at the end unless KILLICK_KEEP_LOGS is set;
    `with Servers(3) as reps: reps.urls ...`."""

    def __init__(self, n: int, args: tuple[str, ...] = (), start_timeout_s: float = 180.0):
        self.n, self.args, self.start_timeout_s = n, tuple(args), start_timeout_s
        self.logs = Path(tempfile.mkdtemp(prefix="killick-serve-"))
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def __enter__(self) -> "Servers":
        try:
            for i in range(self.n):
                self.start(i)
            for i in range(self.n):
                self.wait_ready(i)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, i: int) -> None:
        """Start replica i (again, on the same port, after kill(i))."""
        port = int(self.urls[i].rsplit(":", 1)[1]) if i < len(self.urls) else free_port()
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--allow-forced-responses",
               *self.args]
        log = open(self.logs / f"serve-{i}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        log = self.logs / f"serve-{i}.log"
        while "serving on" not in log.read_text(errors="replace"):
            if self.procs[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"killick serve #{i} did not start:\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def kill(self, i: int) -> None:
        """SIGKILL: the replica vanishes mid-answer, as a crashed server does."""
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if not os.environ.get("KILLICK_KEEP_LOGS"):
            shutil.rmtree(self.logs, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recordings", nargs="*", metavar="FILE", help=f"recordings (default: every one in {FIXTURES})")
    p.add_argument("--replicas", type=int, default=3, help="replicas behind the proxy for session and round-robin")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default: all)")
    p.add_argument("--model", metavar="DIR", help="checkpoint the replicas serve (default: the demo model)")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N requests of the merged recordings")
    p.add_argument("--json", metavar="OUT", help="write the summary and every request's figures here")


def run_args(args: argparse.Namespace) -> int:
    import json

    from proxy.replay import log as replay_log
    from proxy.replay.report import write_json

    from proxy.cli.replay import pick_modes

    modes = pick_modes(args.modes, MODES)
    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    entries = replay_log.load(args.recordings or [FIXTURES])
    entries = entries[:args.limit] if args.limit is not None else entries
    by_mode, pools = {}, {}
    for mode in modes:
        started = time.monotonic()
        by_mode[mode], pools[mode] = run_mode(mode, entries, args.replicas, args.model)
        print(f"[{mode}] {len(entries)} requests in {time.monotonic() - started:.0f} s", flush=True)
    rows = summarize(by_mode, pools)
    print(table(rows))
    if args.json:
        meta = {"recordings": [str(p) for p in args.recordings or [FIXTURES]], "replicas": args.replicas,
                "model": args.model, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "modes": rows}
        write_json(args.json, by_mode, meta)
        print(f"json: {args.json}")
    print(json.dumps({m: {k: r[k] for k in ("cached_fraction", "median_ttft_s_later")} for m, r in rows.items()}))
    return 0 if all(r["failed"] == 0 for r in rows.values()) else 1


def run_mode(mode: str, entries, replicas: int, model: str | None):
    """Fresh replicas (fresh caches) for each mode; the proxy in this process."""
    from proxy.cli.replay import context_needed

    n = 1 if mode == "single" else replicas
    extra = ("--context-length", str(context_needed(entries)), "--keepalive", "5")
    extra += ("--model", model) if model else ()
    with Servers(n, extra) as reps:
        return asyncio.run(_through_proxy(reps.urls, "round-robin" if mode == "round-robin" else "session", entries))


async def _through_proxy(urls: list[str], routing: str, entries):
    from proxy.cli.replay import replay_app
    from proxy.context import CTX
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER
    from proxy.upstream.app import create_upstream_app
    from proxy.upstream.config import UpstreamConfig

    tok = load_tokenizer(None)
    config = UpstreamConfig(tuple(urls), routing=routing, forward_headers=(FORCE_RESPONSE_HEADER,))
    app = create_upstream_app(config, tok, ChatRenderer(tok), model_name="bench", context_length=1 << 20,
                              keepalive_s=5.0, planner=PolicyPlanner())
    results = await replay_app(app, entries, stream=True, concurrent=True)
    return results, app[CTX].core.stats()


def summarize(by_mode: dict, pools: dict) -> dict:
    from proxy.replay.report import summary

    rows = summary(by_mode)
    single = rows.get("single", {})
    for mode, row in rows.items():
        row["cached_fraction"] = round(row["cached_tokens"] / row["prompt_tokens"], 4) if row["prompt_tokens"] else 0.0
        row["of_single"] = round(row["cached_fraction"] / single["cached_fraction"], 4) \
            if single.get("cached_fraction") else None
        row["replica_requests"] = [r["requests"] for r in pools[mode]["replicas"]]
    return rows


def table(rows: dict) -> str:
    from proxy.replay.report import ms, text_table

    head = ("mode", "requests", "failed", "prompt", "cached", "cached_frac", "of_single", "ttft_turn1_ms",
            "ttft_later_ms", "per_replica")
    return text_table([(m, r["requests"], r["failed"], r["prompt_tokens"], r["cached_tokens"],
                        f"{r['cached_fraction']:.3f}", "-" if r["of_single"] is None else f"{r['of_single']:.3f}",
                        ms(r["median_ttft_s_turn1"]), ms(r["median_ttft_s_later"]),
                        "/".join(map(str, r["replica_requests"]))) for m, r in rows.items()], head)
