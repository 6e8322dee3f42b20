"""CPU expert bandwidth: native kernel GB/s vs a STREAM-style read GB/s vs torch, at several thread counts.

    python -m engine.experts.bench_cpu [--threads 1,6,16] [--pool-gb 2] [--json out.json]

Kernel GB/s = expert weight bytes read / wall time of submit+wait, experts drawn without repetition from a
pool far larger than the last-level cache (Qwen3.6-35B-A3B shape by default: H=2048, I=512, bf16, 6 MiB
an expert). The read figure runs the native read kernel over the same pool on the same worker pool.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from engine.experts.cpu_kernels import (CpuExpertRunner, physical_cores, split_expert_block, supported_isas,
                                        torch_experts)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_pool(n_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, 3*I*H] expert blocks; one random block replicated (normal_ over GBs of fresh memory is slow)."""
    pool = torch.empty(n_experts, 3 * inter * hidden, dtype=dtype)
    seed = (torch.randn(3 * inter * hidden) * 0.02).to(dtype)
    for e in range(n_experts):
        pool[e].copy_(seed)
    return pool


def call_plan(n_experts: int, per_call: int, tokens: int, gen: torch.Generator) -> list[list[tuple[int, int]]]:
    """Calls of (token, expert) pairs; each call has per_call distinct experts, shared among its tokens."""
    order = torch.randperm(n_experts, generator=gen).tolist()
    calls = []
    for c in range(0, n_experts - per_call + 1, per_call):
        experts = order[c:c + per_call]
        calls.append([(i % tokens, e) for i, e in enumerate(experts)] + [((i + 1) % tokens, e)
                     for i, e in enumerate(experts) if tokens > 1])
    return calls


def time_calls(run, experts, calls, x, y, limit_s: float) -> tuple[float, int]:
    """Runs calls until limit_s; returns (seconds, weight bytes read)."""
    nbytes = experts[0][0].nbytes + experts[0][1].nbytes
    done_bytes, t0 = 0, time.perf_counter()
    for call in calls:
        tasks = [(experts[e][0], experts[e][1], tok, 0.5) for tok, e in call]
        run(tasks, x, y)
        done_bytes += nbytes * len({e for _, e in call})
        if time.perf_counter() - t0 > limit_s:
            break
    return time.perf_counter() - t0, done_bytes


def bench_threads(n: int, pool, experts, args, gen) -> dict:
    x = torch.randn(args.tokens, args.hidden)
    y = torch.zeros(args.tokens, args.hidden)
    runner = CpuExpertRunner(threads=n, isa=args.isa, prefetch_bytes=args.prefetch)
    reads = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        runner.read_bandwidth_pass(pool)
        reads.append(pool.numel() * pool.element_size() / (time.perf_counter() - t0) / 1e9)
    kernel = []
    for _ in range(args.repeats):
        calls = call_plan(len(experts), args.experts_per_call, args.tokens, gen)
        s, b = time_calls(runner.run, experts, calls, x, y, args.seconds)
        kernel.append(b / s / 1e9)
    torch.set_num_threads(n)
    calls = call_plan(len(experts), args.experts_per_call, args.tokens, gen)
    s, b = time_calls(torch_experts, experts, calls, x, y, args.seconds)
    row = {"threads": n, "isa": runner.isa, "kernel_gbs": max(kernel), "read_gbs": max(reads),
           "torch_gbs": b / s / 1e9, "kernel_runs": kernel, "read_runs": reads,
           "call_us": 1e6 * args.experts_per_call * (experts[0][0].nbytes + experts[0][1].nbytes) / 1e9 / max(kernel)}
    row["ratio"] = row["kernel_gbs"] / row["read_gbs"]
    return row


def parse_args(argv=None) -> argparse.Namespace:
    cores = physical_cores()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default=",".join(str(t) for t in sorted({1, min(6, cores), cores})))
    p.add_argument("--pool-gb", type=float, default=2.0, help="expert pool size (far above the LLC)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--experts-per-call", type=int, default=8, help="distinct experts per MoE-layer call")
    p.add_argument("--tokens", type=int, default=1, choices=[1, 2, 3, 4])
    p.add_argument("--isa", default=None, help=f"force a kernel path, one of {supported_isas()}")
    p.add_argument("--prefetch", type=int, default=512, help="software prefetch distance in bytes (0: off)")
    p.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    expert_bytes = 3 * args.inter * args.hidden * dtype.itemsize
    n_experts = max(args.experts_per_call, int(args.pool_gb * 1e9 // expert_bytes))
    pool = make_pool(n_experts, args.hidden, args.inter, dtype)
    experts = [split_expert_block(pool[e], args.hidden, args.inter) for e in range(n_experts)]
    gen = torch.Generator().manual_seed(0)
    rows = [bench_threads(int(n), pool, experts, args, gen) for n in args.threads.split(",")]
    print(f"pool {pool.nbytes / 1e9:.2f} GB, {n_experts} experts of {expert_bytes / 2**20:.1f} MiB "
          f"({args.dtype}), {args.experts_per_call} experts x {args.tokens} token(s) per call")
    print(f"{'threads':>7} {'isa':>10} {'kernel GB/s':>12} {'read GB/s':>10} {'ratio':>6} {'torch GB/s':>11}")
    for r in rows:
        print(f"{r['threads']:>7} {r['isa']:>10} {r['kernel_gbs']:>12.1f} {r['read_gbs']:>10.1f} "
              f"{r['ratio']:>6.2f} {r['torch_gbs']:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args),
                       "isas": supported_isas(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
