"""`killick bench bw`: the bandwidths the expert hierarchy plans with, measured once per machine and format.

B_P: pinned host -> device copies at expert granularity, a batch of experts per timing (CUDA only).
B_H: the engine's CPU expert path (cpu_runner.run_on_cpu, what the backends call and their split plans with)
on one token, 8 distinct experts a call like a decode step's MoE layer, drawn in a fresh random order from a
pool far above the last-level cache, at 1..N threads: bytes of weights read / s.
STREAM: the native read pass over the same pool on the same workers, the ceiling both of the above share,
measured at every thread count in windows alternated with B_H's; B_H / STREAM is printed (best windows, and
the median of each round's ratio: "paired").
The profile is saved where model loading reads it (engine/experts/profile.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.args import add_bw_arguments
from engine.experts.block_layout import ExpertLayout
from engine.experts import cpu_runner
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


def make_blocks(layout: ExpertLayout, dtype: torch.dtype, n: int) -> torch.Tensor:
    """[n, numel] expert blocks: one random block replicated (values don't matter for speed; torch's normal_ over
    GBs of fresh memory is slow)."""
    blocks = torch.empty(n, layout.numel, dtype=dtype)
    seed = (torch.randn(layout.numel) * 0.02).to(dtype)
    for e in range(n):
        blocks[e].copy_(seed)
    return blocks


def bh_window(blocks: torch.Tensor, layout: ExpertLayout, table, seconds: float, gen: torch.Generator,
              per_call: int = 8) -> float:
    """Expert bytes / s of run_on_cpu in one-token decode steps for about `seconds`: calls of `per_call` distinct
    experts (one MoE layer's top-k), a fresh seeded order over the whole pool each pass, so every byte comes
    from DRAM as in decode; only the calls are timed, back to back like a step's layers."""
    n = blocks.shape[0]
    x = torch.randn(1, layout.hidden).to(blocks.dtype)  # [T=1, H]
    zero = torch.zeros(1, dtype=torch.long)
    done, timed = 0, 0.0
    for _ in range(10_000):  # bounded: a pass over a pool above the LLC takes milliseconds
        order = torch.randperm(n, generator=gen).tolist()
        calls = [[(zero, e) for e in order[c:c + per_call]] for c in range(0, n - per_call + 1, per_call)]
        t0 = time.perf_counter()
        for jobs in calls:
            run_on_cpu(x, blocks, jobs, layout, 1, table)
        timed += time.perf_counter() - t0
        done += len(calls) * per_call * layout.nbytes
        if timed > seconds:
            break
    return done / timed


def stream_window(blocks: torch.Tensor, threads: int, seconds: float) -> float:
    """STREAM-style read bytes / s over the same pool for about `seconds`: the native read pass on the runner
    run_on_cpu uses (each worker its own part, front to back), else a torch sum."""
    runner = native_runner(threads)
    read = (lambda: runner.read_bandwidth_pass(blocks)) if runner else blocks.sum
    done, timed = 0, 0.0
    for _ in range(10_000):
        t0 = time.perf_counter()
        read()
        timed += time.perf_counter() - t0
        done += blocks.numel() * blocks.element_size()
        if timed > seconds:
            break
    return done / timed


def measure_pair(blocks: torch.Tensor, layout: ExpertLayout, threads: int, *, seconds: float = 0.5,
                 rounds: int = 3) -> dict:
    """B_H and the STREAM read at `threads`, in alternated windows over one pool (a shared box's noise hits
    both alike): the best window of each, their ratio, and the median of each round's ratio (paired)."""
    prev = cpu_runner.expert_threads()
    cpu_runner.set_threads(threads)
    table = layer_table(blocks, layout)  # once per layer, as the backends keep it
    gen = torch.Generator().manual_seed(threads)
    bh, st = [], []
    try:
        for _ in range(rounds):
            st.append(stream_window(blocks, threads, seconds))
            bh.append(bh_window(blocks, layout, table, seconds, gen))
    finally:
        cpu_runner.set_threads(prev)
    return {"bh": max(bh), "stream": max(st), "ratio": max(bh) / max(st),
            "ratio_paired": statistics.median(b / s for b, s in zip(bh, st)), "bh_runs": bh, "stream_runs": st}


def measure_bh(layout: ExpertLayout, dtype: torch.dtype, threads: int, experts: int, seconds: float = 0.3,
               rounds: int = 3) -> float:
    """B_H alone (bench decode's bound): the best of `rounds` windows over a pool of `experts` blocks."""
    blocks = make_blocks(layout, dtype, experts)
    prev = cpu_runner.expert_threads()
    cpu_runner.set_threads(threads)
    try:
        table, gen = layer_table(blocks, layout), torch.Generator().manual_seed(threads)
        return max(bh_window(blocks, layout, table, seconds, gen) for _ in range(rounds))
    finally:
        cpu_runner.set_threads(prev)


def run(layout: ExpertLayout, dtype: torch.dtype, threads: list[int], *, experts: int, stream_bytes: int,
        seconds: float = 0.5, rounds: int = 3, log=print) -> dict:
    """Measure everything and return the profile (B_H at the largest thread count is `bh`)."""
    n = max(experts, -(-stream_bytes // layout.nbytes), 8)
    blocks = make_blocks(layout, dtype, n)
    log(f"bench bw: expert block {layout.nbytes / 2**20:.2f} MiB, pool {n} blocks ({blocks.nbytes / 2**30:.2f} "
        f"GiB), threads {threads}; B_H = run_on_cpu ({run_on_cpu.__name__}), 8 distinct experts x 1 token a call")
    bp = measure_bp(layout, dtype)
    log(f"  B_P pinned H2D: {bp / 1e9:.1f} GB/s" if bp else "  B_P: skipped (no CUDA)")
    by_threads = {}
    for t in threads:
        r = by_threads[t] = measure_pair(blocks, layout, t, seconds=seconds, rounds=rounds)
        log(f"  {t:>2} threads: B_H {r['bh'] / 1e9:6.2f} GB/s   STREAM read {r['stream'] / 1e9:6.2f} GB/s   "
            f"B_H / STREAM {r['ratio']:.2f} (paired {r['ratio_paired']:.2f}; B_H windows "
            f"{' '.join(f'{v / 1e9:.1f}' for v in r['bh_runs'])}, "
            f"read {' '.join(f'{v / 1e9:.1f}' for v in r['stream_runs'])})")
    top = by_threads[max(threads)]
    key = machine_key(layout, dtype, max(threads))
    return {"key": key, "bp": bp, "bh": top["bh"],
            "bh_by_threads": {str(k): v["bh"] for k, v in by_threads.items()}, "stream_read": top["stream"],
            "stream_by_threads": {str(k): v["stream"] for k, v in by_threads.items()},
            "ratio_by_threads": {str(k): v["ratio"] for k, v in by_threads.items()},
            "ratio_paired_by_threads": {str(k): v["ratio_paired"] for k, v in by_threads.items()},
            "pool_bytes": blocks.nbytes, "expert_bytes": layout.nbytes, "cpu_runner": run_on_cpu.__name__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="killick bench bw", description=__doc__.splitlines()[0])
    add_bw_arguments(ap)
    return run_args(ap.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    shape = get_shape(args.synthetic, scale_down=args.small)
    cores = os.cpu_count() or 1
    threads = args.threads or sorted({1, *range(2, cores + 1, 2), cores})
    prof = run(shape.layout, shape.torch_dtype, threads, experts=args.experts, stream_bytes=args.stream_mib << 20,
               seconds=args.seconds, rounds=args.rounds, log=lambda s: print(s, file=sys.stderr, flush=True))
    path = save_profile(prof)
    if args.json:
        Path(args.json).write_text(json.dumps(prof, indent=1))
    print(json.dumps(prof, indent=1))
    print(f"profile written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
