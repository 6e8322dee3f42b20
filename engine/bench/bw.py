"""`killick bench bw`: the bandwidths the expert hierarchy plans with, measured once per machine and format.

B_P: pinned host -> device copies at expert granularity, a batch of experts per timing (CUDA only).
B_H: the CPU expert path (cpu_runner.run_on_cpu) on one token, 8 experts a call like a decode step's MoE
layers, at 1..N threads: bytes of weights read / s.
STREAM: a plain multi-threaded read of a large host buffer, the ceiling both of the above share.
The profile is saved where model loading reads it (engine/experts/profile.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from engine.bench.args import add_bw_arguments
from engine.experts.block_layout import ExpertLayout
from engine.experts.cpu_runner import layer_table, native_runner, run_on_cpu
from engine.experts.profile import machine_key, save_profile
from engine.experts.synthetic import get_shape


def _timed(fn, reps: int) -> float:
    """Fastest of `reps` runs after a warm-up: bandwidth figures are ceilings, noise only slows."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bp(layout: ExpertLayout, dtype: torch.dtype, batch: int = 64, reps: int = 5,
               host: torch.Tensor | None = None) -> float | None:
    """Pinned H2D bytes/s for `batch` expert blocks copied one block per copy; None without CUDA.
    host: copy from these blocks [batch, numel] (e.g. the real pool, pinned after filling) instead."""
    if not torch.cuda.is_available():
        return None
    if host is None:
        host = torch.empty(batch, layout.numel, dtype=dtype, pin_memory=True).fill_(1)  # [batch, numel]
    batch = host.shape[0]
    dev = torch.empty_like(host, device="cuda")

    def copy():
        for i in range(batch):
            dev[i].copy_(host[i], non_blocking=True)
        torch.cuda.synchronize()

    return batch * layout.nbytes / _timed(copy, reps)


def measure_copy(layout: ExpertLayout, dtype: torch.dtype, batch: int = 64, reps: int = 3) -> float:
    """Host -> host block copies: what a "fill" costs when the device is the CPU (CI, smoke runs)."""
    src = torch.ones(batch, layout.numel, dtype=dtype)
    dst = torch.empty_like(src)

    def copy():
        for i in range(batch):
            dst[i].copy_(src[i])

    return batch * layout.nbytes / _timed(copy, reps)


def measure_bh(layout: ExpertLayout, dtype: torch.dtype, threads: int, experts: int, reps: int = 3,
               per_call: int = 8) -> float:
    """Bytes of expert weights the CPU path (run_on_cpu) streams per second in one-token decode steps: calls
    of `per_call` experts (one MoE layer's top-k), `experts` blocks in all per timing."""
    blocks = torch.full((experts, layout.numel), 0.02, dtype=dtype)  # [n, numel]; values don't matter
    x = torch.randn(1, layout.hidden).to(dtype)  # [T=1, H]
    calls = [[(torch.zeros(1, dtype=torch.long), e) for e in range(c, min(c + per_call, experts))]
             for c in range(0, experts, per_call)]
    table = layer_table(blocks, layout)  # once per layer, as the backends keep it

    def sweep():
        for jobs in calls:
            run_on_cpu(x, blocks, jobs, layout, 1, table)

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return experts * layout.nbytes / _timed(sweep, reps)
    finally:
        torch.set_num_threads(prev)


def measure_stream(nbytes: int, threads: int, reps: int = 3) -> float:
    """Read ceiling: the native kernels' streaming read pass when built, else a torch sum."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    runner = native_runner(threads)
    read = (lambda: runner.read_bandwidth_pass(buf)) if runner else buf.sum
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return buf.numel() * 4 / _timed(read, reps)
    finally:
        torch.set_num_threads(prev)


def run(layout: ExpertLayout, dtype: torch.dtype, threads: list[int], *, experts: int, stream_bytes: int,
        log=print) -> dict:
    """Measure everything and return the profile (B_H at the largest thread count is `bh`)."""
    log(f"bench bw: expert block {layout.nbytes / 2**20:.2f} MiB, threads {threads}")
    bp = measure_bp(layout, dtype)
    log(f"  B_P pinned H2D: {bp / 1e9:.1f} GB/s" if bp else "  B_P: skipped (no CUDA)")
    bh_by_threads = {}
    for t in threads:
        bh_by_threads[t] = measure_bh(layout, dtype, t, experts)
        log(f"  B_H CPU experts, {t} threads: {bh_by_threads[t] / 1e9:.2f} GB/s")
    stream = measure_stream(stream_bytes, max(threads))
    log(f"  STREAM read, {max(threads)} threads: {stream / 1e9:.1f} GB/s")
    key = machine_key(layout, dtype, max(threads))
    return {"key": key, "bp": bp, "bh": bh_by_threads[max(threads)],
            "bh_by_threads": {str(k): v for k, v in bh_by_threads.items()}, "stream_read": stream,
            "expert_bytes": layout.nbytes, "cpu_runner": run_on_cpu.__name__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="killick bench bw", description=__doc__.splitlines()[0])
    add_bw_arguments(ap)
    return run_args(ap.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    shape = get_shape(args.synthetic, scale_down=args.small)
    cores = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1, *range(2, cores + 1, 2), cores}))
    prof = run(shape.layout, shape.torch_dtype, threads, experts=args.experts,
               stream_bytes=args.stream_mib << 20, log=lambda s: print(s, file=sys.stderr, flush=True))
    path = save_profile(prof)
    if args.json:
        Path(args.json).write_text(json.dumps(prof, indent=1))
    print(json.dumps(prof, indent=1))
    print(f"profile written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
