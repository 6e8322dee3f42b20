"""How fast the engine thread's Python runs while the CPU's expert workers stream host DRAM, against idle.

A hybrid extend is held up wherever the engine thread's Python sits between the device and the CPU's next job
(the routing to the job's start, an extend's first layers and last ones queued; docs/PERF.md issue 17): the same
planning took ~0.3 ms on the dev box and ~1 ms on the GPU box with the CPU's job running. This times fixed pieces
of host work on this thread alone, then while the native runner's read pass (the STREAM read `bench bw` takes)
runs on `--threads` workers in a background thread, then the same with this thread pinned to a core no worker
holds (another such core left to the reader's thread; without one, no pinned run): whether the workers' DRAM
traffic (or a shared core) slows the host's Python, and whether a core of its own gives it back. A part of the
engine, not the engine.

    python -m engine.bench.host_python [--threads N] [--seconds 0.5] [--pool-mb 2048] [--json out.json]

Pieces: `python` (dicts, lists and attribute reads, as the planner's bookkeeping), `numpy` (lexsort, bincount,
flatnonzero and fancy indexing over one layer's 256 experts and 2,048 slots, as the split and the copies ahead),
and on CUDA `launch` (a small Triton kernel and a torch op queued, no sync: a layer's launches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import torch

from engine.bench.args import print_and_save


def _python_piece(state: dict) -> int:
    """Bookkeeping like the planner's: a dict of counters, a list built and sorted, attribute reads."""
    counts = state.setdefault("counts", {})
    out = 0
    for i in range(200):
        key = (i % 8, i % 13)
        counts[key] = counts.get(key, 0) + 1
        out += len(state["items"][i % len(state["items"])])
    pairs = sorted(((v, k) for k, v in counts.items()), reverse=True)[:16]
    return out + len(pairs)


def _numpy_piece(state: dict) -> int:
    """One layer's split and copies-ahead arithmetic: 256 experts, 2,048 slots, 256 tokens x 8 routed."""
    rng, heat, resident, owner = state["rng"], state["heat"], state["resident"], state["owner"]
    counts = np.bincount(state["ids"], minlength=256)
    experts = np.flatnonzero(counts)
    miss = experts[resident[experts] < 0]
    order = miss[np.lexsort((-heat[miss], -counts[miss]))]
    free = np.flatnonzero(owner < 0)
    picked = free[: len(order)]
    heat[experts] += counts[experts] * 0.01
    return int(picked.sum()) + int(rng.integers(0, 2))


def _make_state() -> dict:
    rng = np.random.default_rng(0)
    resident = np.full(256, -1, dtype=np.int64)  # the layer's expert -> slot
    resident[rng.choice(256, 96, replace=False)] = rng.choice(2048, 96, replace=False)
    owner = np.full(2048, -1, dtype=np.int64)  # slot -> expert (of any layer): 768 of 2,048 held
    owner[rng.choice(2048, 768, replace=False)] = rng.integers(0, 256, 768)
    return {"items": [list(range(i % 7)) for i in range(64)], "rng": rng, "heat": rng.random(256),
            "resident": resident, "owner": owner, "ids": rng.integers(0, 256, 256 * 8)}


def _launch_piece(state: dict) -> int:
    """A small Triton kernel and a torch op queued on the current stream, not waited for."""
    from engine.kernels.norm_triton import add_rms_norm

    x, w = state["x"], state["w"]
    add_rms_norm(x, None, w, 1e-6, False)
    torch.add(x, 1.0)
    return 0


def _time_piece(piece, state: dict, seconds: float) -> float:
    """Median microseconds of one call of `piece` over about `seconds` (bounded)."""
    piece(state)  # warm: compiles, allocates
    times = []
    deadline = time.perf_counter() + seconds
    for _ in range(200_000):
        t0 = time.perf_counter()
        piece(state)
        times.append(time.perf_counter() - t0)
        if t0 > deadline:
            break
    return statistics.median(times) * 1e6


class _Reader:
    """The native read pass over a pool far above the last-level cache, back to back on a background thread
    (the pass lets the GIL go), until stopped."""

    def __init__(self, threads: int, pool_bytes: int):
        from engine.experts.cpu_runner import native_runner

        self.runner = native_runner(threads)
        if self.runner is None:
            raise SystemExit("host_python: the native CPU kernels are not built (make native); nothing reads DRAM")
        self.buf = torch.ones(pool_bytes // 2, dtype=torch.bfloat16)
        self._stop = threading.Event()
        self.passes = 0
        self.seconds = 0.0
        taken = set(self.runner.cpus)
        # the cores no worker holds: the reader's own thread (which waits out each pass spinning) takes the first,
        # the timed thread's pinned run the last, so the two never share one
        self.free = [c for c in sorted(os.sched_getaffinity(0)) if c not in taken]
        self._thread = threading.Thread(target=self._loop, name="host-python-reader", daemon=True)

    def _loop(self) -> None:
        if len(self.free) >= 2:
            os.sched_setaffinity(0, {self.free[0]})  # this thread alone (Linux: pid 0 is the calling thread)
        t0 = time.perf_counter()
        for _ in range(1_000_000):  # bounded; each pass reads the whole pool
            if self._stop.is_set():
                break
            self.runner.read_bandwidth_pass(self.buf)
            self.passes += 1
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def gbps(self) -> float:
        return self.passes * self.buf.numel() * 2 / self.seconds / 1e9 if self.seconds else 0.0

    def free_core(self) -> int | None:
        """The core the timed thread's pinned run takes: the last no worker holds, None unless another such is
        left for the reader's thread."""
        return self.free[-1] if len(self.free) >= 2 else None


def run(threads: int, seconds: float, pool_bytes: int) -> dict:
    state = _make_state()
    pieces = {"python": _python_piece, "numpy": _numpy_piece}
    if torch.cuda.is_available():
        state["x"] = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
        state["w"] = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        pieces["launch"] = _launch_piece
    mask = os.sched_getaffinity(0)
    out = {"threads": threads, "pool_bytes": pool_bytes, "idle": {}, "reading": {}, "reading_pinned": {}}
    for name, piece in pieces.items():
        out["idle"][name] = _time_piece(piece, state, seconds)
    reader = _Reader(threads, pool_bytes)
    with reader:
        for name, piece in pieces.items():
            out["reading"][name] = _time_piece(piece, state, seconds)
        core = reader.free_core()
        out["pinned_to"] = core
        if core is not None:
            os.sched_setaffinity(0, {core})
            try:
                for name, piece in pieces.items():
                    out["reading_pinned"][name] = _time_piece(piece, state, seconds)
            finally:
                os.sched_setaffinity(0, mask)
    out["read_gbps"] = reader.gbps
    out["worker_cpus"] = reader.runner.cpus
    return out


def report(res: dict) -> str:
    lines = [f"host Python beside the CPU's read pass: {res['threads']} workers reading "
             f"{res['pool_bytes'] / 2**20:.0f} MiB at {res['read_gbps']:.1f} GB/s (workers on CPUs "
             f"{res['worker_cpus']}; pinned run on CPU {res['pinned_to']})",
             f"{'piece':<10}{'idle us':>10}{'reading us':>12}{'ratio':>8}{'pinned us':>11}{'ratio':>8}"]
    for name in res["idle"]:
        idle, busy = res["idle"][name], res["reading"][name]
        pinned = res["reading_pinned"].get(name)
        tail = f"{pinned:>11.1f}{pinned / idle:>8.2f}" if pinned is not None else f"{'-':>11}{'-':>8}"
        lines.append(f"{name:<10}{idle:>10.1f}{busy:>12.1f}{busy / idle:>8.2f}{tail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.host_python", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None,
                    help="workers of the read pass (default: a prompt's CPU job's, as serve sets them on CUDA)")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing window per piece and condition")
    ap.add_argument("--pool-mb", type=int, default=2048, help="the pool the workers read (far above the LLC)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads is None:
        from engine.build import EngineOptions, prompt_expert_threads

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.threads = prompt_expert_threads(EngineOptions(), device)
    if args.threads < 1 or args.seconds <= 0 or args.pool_mb < 64:
        ap.error("--threads must be >= 1, --seconds > 0 and --pool-mb >= 64")
    res = run(args.threads, args.seconds, args.pool_mb << 20)
    print_and_save(res, lambda r: print(report(r)), args.json)
    return res


if __name__ == "__main__":
    main()
