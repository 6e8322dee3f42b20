"""CPU expert bandwidth: native kernel GB/s vs a STREAM-style read GB/s vs torch, at several thread counts.

    python -m engine.bench.cpu [--threads 1,6,16] [--pool-gb 2] [--sweep] [--json out.json]

Kernel GB/s = expert weight bytes read / wall time of the calls (CpuExpertRunner.run_io on buffers checked
once, as a decode loop would call it; Python wrapper included), experts drawn
without repetition from a pool far larger than the last-level cache (Qwen3.6-35B-A3B shape by default:
H=2048, I=512, bf16, 6 MiB an expert), `--experts-per-call` distinct experts per call like one MoE layer's
misses. Read GB/s = the native read kernel in passes over the whole pool on the same worker pool, each worker
reading its part front to back (STREAM-style), for as long as a kernel measurement (--seconds), interleaved
with them; all figures are the best of --repeats. Read x4 GB/s = the same with each worker reading four
pieces of its part side by side, which keeps more lines in flight on some CPUs; read dyn GB/s = the workers
claiming 2 MiB pieces in turn instead of a fixed part each, so one slow core (a busy neighbour on a VM) does
not hold up the pass. "best" = the kernel against the fastest of the three reads (the strictest ceiling).
"paired" = the median over rounds of each round's kernel window against the read window(s) measured just
before it (a lent VM's read rate jumps between windows, and the best of each side can come from different
rounds).
Torch GB/s = the fallback (torch matmuls in the weight dtype) on the same calls with torch.set_num_threads(n).
GFLOP/s = the kernel's compute rate (6 H I flops per token and expert): with `--tokens` past 4 (a prompt's
experts) the kernels walk an expert's weights once per 4 tokens and run compute-bound (docs/PERF.md, issue 17,
eighteenth session), so its weight GB/s falls below the read while this column says how far from the core's
arithmetic peak they run.

A second table says where the best kernel window's time went (the pool's profile, CpuExpertRunner.profile):
per call and worker, the share of the window spent in the Python wrapper (outside submit..wait), waiting to
be dispatched, running the kernels, at the barrier between the gate/up and down phases, idle at the end
waiting for the last worker, and from the last worker's end until wait() returned; "GB/s running" = weight
bytes / (kernel running time per worker), the rate of the loops themselves, to hold against the read.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import torch

from engine.experts.cpu_kernels import (PREFETCH_HINTS, CpuExpertRunner, ExpertTable, RoutedIO, default_walk,
                                        physical_cores, supported_isas, torch_experts)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CALLER_JOINS = {"auto": None, "yes": True, "no": False}
TOKENS = (1, 2, 3, 4, 8, 16, 32, 64)  # --tokens: per expert and call
DYN_CHUNK = 2 << 20  # read dyn: pieces the workers claim in turn
WALKS = ("four rows side by side", "one row at a time", "two row streams", "four row streams")
# --sweep: (label, overrides) measured after the default configuration, same pool, same process.
SWEEP = [("short spin (50 us)", {"spin_us": 50}), ("no software prefetch", {"prefetch": 0}),
         ("prefetch 1024 B", {"prefetch": 1024}), ("prefetch 2048 B", {"prefetch": 2048}),
         ("4 tokens per call", {"tokens": 4}), ("32 experts per call", {"experts_per_call": 32}),
         ("four rows side by side", {"row_block": 0}), ("one row at a time", {"row_block": 1}),
         ("one row at a time, prefetch 1024 B", {"row_block": 1, "prefetch": 1024}),
         ("one row at a time, prefetch 2048 B", {"row_block": 1, "prefetch": 2048}),
         ("one row at a time, 4 tokens", {"row_block": 1, "tokens": 4}),
         ("claims of 64 rows", {"claim_rows": 64}), ("claims of 32 rows", {"claim_rows": 32}),
         ("claims of 16 rows", {"claim_rows": 16}), ("fixed-size claims (not guided)", {"guided": False}),
         ("claims shrink to 4 rows", {"least_rows": 4}),
         ("two row streams", {"row_block": 2}), ("two row streams, prefetch 512 B", {"row_block": 2, "prefetch": 512}),
         ("two row streams, 2 tokens", {"row_block": 2, "tokens": 2}), ("four row streams", {"row_block": 3}),
         ("four row streams, 2 tokens", {"row_block": 3, "tokens": 2}),
         ("caller never joins", {"caller_joins": "no"})]


def make_pool(n_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, 3*I*H] expert blocks; one random block replicated (normal_ over GBs of fresh memory is slow)."""
    pool = torch.empty(n_experts, 3 * inter * hidden, dtype=dtype)
    seed = (torch.randn(3 * inter * hidden) * 0.02).to(dtype)
    for e in range(n_experts):
        pool[e].copy_(seed)
    return pool


def call_plan(n_experts: int, per_call: int, tokens: int, gen: torch.Generator) -> list[tuple[list, list]]:
    """Calls of (expert ids, token ids): per_call distinct experts each, each expert routed from every token."""
    order = torch.randperm(n_experts, generator=gen).tolist()
    calls = []
    for c in range(0, n_experts - per_call + 1, per_call):
        experts = order[c:c + per_call]
        calls.append(([e for e in experts for _ in range(tokens)], [t for _ in experts for t in range(tokens)]))
    return calls


def time_calls(run, table: ExpertTable, plan, limit_s: float) -> tuple[float, float, float]:
    """Runs passes of plan() (each a fresh order over the whole pool) as run(table, experts, tokens, weights)
    until limit_s; returns (weight GB/s, weight bytes, seconds). Only the calls are timed, back to back as a
    decode step's layers would issue them."""
    nbytes = 3 * table.hidden * table.inter * table.dtype.itemsize
    done_bytes, timed = 0, 0.0
    for _ in range(1000):  # bounded: a pass takes at least milliseconds
        calls = [(e, t, [0.5] * len(e), len(set(e))) for e, t in plan()]
        t0 = time.perf_counter()
        for experts, tokens, weights, unique in calls:
            run(table, experts, tokens, weights)
            done_bytes += nbytes * unique
        timed += time.perf_counter() - t0
        if timed > limit_s:
            break
    return done_bytes / timed / 1e9, done_bytes, timed


def time_reads(runner, pool: torch.Tensor, limit_s: float, streams: int = 1, chunk: int = 0) -> tuple[float, float]:
    """Read passes over the whole pool until limit_s (at least one), each worker reading its part as `streams`
    streams (chunk > 0: claiming chunk-byte pieces in turn); returns (GB/s over them all, GB/s of the fastest
    pass). The first is the reference: as long a window as a kernel measurement, so the best of a few is not a
    luckier, shorter window than the kernel's."""
    done_bytes, timed, best = 0, 0.0, 0.0
    for _ in range(100_000):  # bounded: a pass over a pool far above the LLC takes milliseconds
        t0 = time.perf_counter()
        runner.read_bandwidth_pass(pool, streams, chunk)
        dt = time.perf_counter() - t0
        timed, done_bytes, best = timed + dt, done_bytes + pool.nbytes, max(best, pool.nbytes / dt)
        if timed > limit_s:
            break
    return done_bytes / timed / 1e9, best / 1e9


def torch_routed(table, experts, tokens, weights, x, y) -> None:
    torch_experts(table.tasks(experts, tokens, weights), x, y)


def breakdown(prof: dict, threads: int, nbytes: float, seconds: float) -> dict:
    """Shares of a kernel window's core-time (threads x seconds) from the pool's profile of it."""
    core_s = threads * seconds
    out = {"calls": prof["jobs"], "ms_per_call": 1e3 * seconds / max(1, prof["jobs"]),
           "wrapper": 1 - prof["wall_s"] / core_s}
    for key in ("dispatch", "run", "barrier", "tail", "wake"):
        out[key] = prof[key + "_s"] / core_s
    phases = prof["run_phase_s"]
    tiles = len(phases) > 2 and phases[2] > 0  # the tile path: pack, gate/up, down
    out["pack_run"] = phases[0] / core_s if tiles else 0.0
    out["gate_up_run"], out["down_run"] = (v / core_s for v in (phases[1:3] if tiles else phases[:2]))
    out["running_gbs"] = nbytes / (prof["run_s"] / threads) / 1e9 if prof["run_s"] else 0.0
    return out


def bench_threads(n: int, pool, table, cfg: dict, gen, with_torch: bool) -> dict:
    x = torch.randn(cfg["tokens"], table.hidden)
    y = torch.zeros(cfg["tokens"], table.hidden)
    runner = CpuExpertRunner(threads=n, isa=cfg["isa"], prefetch_bytes=cfg["prefetch"], spin_us=cfg["spin_us"],
                             row_block=cfg["row_block"], claim_rows=cfg["claim_rows"], guided=cfg["guided"],
                             prefetch_hint=cfg["prefetch_hint"], caller_joins=CALLER_JOINS[cfg["caller_joins"]],
                             least_rows=cfg["least_rows"], tile_tokens=cfg["tile_tokens"])
    io = RoutedIO(x, y)
    reads, passes, reads4, reads_dyn, kernel = [], [], [], [], []
    plan = lambda: call_plan(table.num_experts, cfg["experts_per_call"], cfg["tokens"], gen)  # noqa: E731
    for _ in range(cfg["repeats"]):  # interleaved, so a noisy neighbour hits all figures alike
        window, fastest = time_reads(runner, pool, cfg["seconds"])
        reads.append(window)
        passes.append(fastest)
        if cfg["read4"]:
            reads4.append(time_reads(runner, pool, cfg["seconds"], streams=4)[0])
        if cfg["read_dyn"]:
            reads_dyn.append(time_reads(runner, pool, cfg["seconds"], chunk=DYN_CHUNK)[0])
        runner.set_profile(True)
        gbs, nbytes, seconds = time_calls(functools.partial(runner.run_io, io=io), table, plan, cfg["seconds"])
        if not kernel or gbs > max(kernel):
            where = breakdown(runner.profile(), n, nbytes, seconds)
        kernel.append(gbs)
    runner.set_profile(False)
    runner_isa, tiles = runner.isa, runner.last_call_tiles
    del runner  # parks and joins its workers before torch's threads start
    row = {"threads": n, "isa": runner_isa, "tiles": tiles, "kernel_gbs": max(kernel),
           "read_gbs": max(reads), "kernel_runs": kernel, "read_runs": reads,
           "read_fastest_pass_gbs": max(passes), "where": where}
    row["ratio"] = row["kernel_gbs"] / row["read_gbs"]
    # each token does 6 H I flops on the expert's 3 H I weights: GFLOP/s = weight GB/s x tokens x 2 / itemsize
    row["kernel_gflops"] = row["kernel_gbs"] * cfg["tokens"] * 2 / pool.element_size()
    if reads4:
        row.update(read4_gbs=max(reads4), read4_runs=reads4, ratio4=row["kernel_gbs"] / max(reads4))
    if reads_dyn:
        row.update(read_dyn_gbs=max(reads_dyn), read_dyn_runs=reads_dyn)
    row["best_read_gbs"] = max(reads + reads4 + reads_dyn)
    row["ratio_best"] = row["kernel_gbs"] / row["best_read_gbs"]
    # Paired: each round's kernel window against the read windows measured just before it, median over rounds
    # (a VM's read rate can jump between windows; the best of each side may come from different rounds).
    best_of_round = [max(rs) for rs in zip(reads, reads4 or reads, reads_dyn or reads)]
    row["ratio_rounds"] = statistics.median(k / r for k, r in zip(kernel, reads))
    row["ratio_best_rounds"] = statistics.median(k / r for k, r in zip(kernel, best_of_round))
    if with_torch:
        torch.set_num_threads(n)
        row["torch_gbs"] = time_calls(functools.partial(torch_routed, x=x, y=y), table, plan, cfg["seconds"])[0]
    return row


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print(f"{'threads':>7} {'isa':>10} {'kernel GB/s':>12} {'read GB/s':>10} {'ratio':>6} {'paired':>7} {'read x4':>8} "
          f"{'read dyn':>9} {'best':>5} {'paired':>7} {'torch GB/s':>11} {'GFLOP/s':>8}")
    for r in rows:
        cols = [f"{r[k]:.1f}" if k in r else "-" for k in ("read4_gbs", "read_dyn_gbs", "torch_gbs")]
        isa = r["isa"] + ("+tiles" if r.get("tiles") else "")
        print(f"{r['threads']:>7} {isa:>10} {r['kernel_gbs']:>12.1f} {r['read_gbs']:>10.1f} "
              f"{r['ratio']:>6.2f} {r['ratio_rounds']:>7.2f} {cols[0]:>8} {cols[1]:>9} {r['ratio_best']:>5.2f} "
              f"{r['ratio_best_rounds']:>7.2f} {cols[2]:>11} {r['kernel_gflops']:>8.0f}")
    print("where the best kernel window's time went (% of threads x window):")
    print(f"{'threads':>7} {'ms/call':>8} {'wrapper':>8} {'dispatch':>9} {'gate/up':>8} {'down':>6} {'barrier':>8} "
          f"{'tail':>6} {'wake':>6} {'GB/s running':>13}")
    for r in rows:
        w = r["where"]
        print(f"{r['threads']:>7} {w['ms_per_call']:>8.3f} {100 * w['wrapper']:>8.1f} {100 * w['dispatch']:>9.1f} "
              f"{100 * w['gate_up_run']:>8.1f} {100 * w['down_run']:>6.1f} {100 * w['barrier']:>8.1f} "
              f"{100 * w['tail']:>6.1f} {100 * w['wake']:>6.1f} {w['running_gbs']:>13.1f}")


def parse_args(argv=None) -> argparse.Namespace:
    cores = physical_cores()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default=",".join(str(t) for t in sorted({1, min(6, cores), cores})))
    p.add_argument("--pool-gb", type=float, default=2.0, help="expert pool size (far above the LLC)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--experts-per-call", type=int, default=8, help="distinct experts per MoE-layer call")
    p.add_argument("--tokens", type=int, default=1, choices=TOKENS,
                   help="tokens routed to each expert (1-4: decode, one pass over its weights; more: a prompt's, "
                        "passes of up to 4, where the kernels run compute-bound: see GFLOP/s)")
    p.add_argument("--isa", default=None, help=f"force a kernel path, one of {supported_isas()}")
    p.add_argument("--tile-tokens", type=int, default=None,
                   help="calls averaging this many tokens an expert take the ISA's tile path (AMX: 16 tokens a "
                        "pass; 0: never; default: 5 on amx)")
    p.add_argument("--prefetch", type=int, default=None,
                   help="software prefetch distance in bytes (0: off; default: this CPU's, see default_walk)")
    p.add_argument("--prefetch-hint", default=None, choices=sorted(PREFETCH_HINTS),
                   help="software prefetch instruction: t0 (into L1), t1, t2, nta (default: this CPU's, see "
                        "default_walk)")
    p.add_argument("--spin-us", type=int, default=2000, help="how long idle workers spin before parking")
    p.add_argument("--claim-rows", type=int, default=None,
                   help="rows a worker claims at a time, 1-64 (default: this CPU's, see default_walk)")
    p.add_argument("--no-guided", dest="guided", action="store_false",
                   help="every claim --claim-rows long (default: claims shrink as each phase runs out)")
    p.add_argument("--least-rows", type=int, default=8, help="rows the guided claims shrink to, 1-64")
    p.add_argument("--row-block", type=int, default=None, choices=[0, 1, 2, 3],
                   help="kernel walk order, 0: four rows side by side, 1: one row at a time, 2: two row streams "
                        "(gate with up, expert with expert), 3: four streams (default: this CPU's)")
    p.add_argument("--caller-joins", default="auto", choices=sorted(CALLER_JOINS),
                   help="the calling thread is worker 0 (auto: when the pool takes every core)")
    p.add_argument("--no-read4", dest="read4", action="store_false",
                   help="skip the read reference with each worker reading four streams side by side")
    p.add_argument("--no-read-dyn", dest="read_dyn", action="store_false",
                   help="skip the read reference with 2 MiB pieces claimed in turn")
    p.add_argument("--seconds", type=float, default=1.5, help="time per kernel measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also measure the variants in SWEEP (no torch)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not supported_isas():
        raise SystemExit("the native extension is not built: pip install needs a C++17 compiler")
    dtype = DTYPES[args.dtype]
    expert_bytes = 3 * args.inter * args.hidden * dtype.itemsize
    n_experts = max(32, int(args.pool_gb * 1e9 // expert_bytes))
    pool = make_pool(n_experts, args.hidden, args.inter, dtype)
    table = ExpertTable.from_blocks(pool, args.hidden, args.inter)
    gen = torch.Generator().manual_seed(0)
    walk = default_walk()
    args.row_block = walk[0] if args.row_block is None else args.row_block
    args.prefetch = walk[1] if args.prefetch is None else args.prefetch
    args.claim_rows = walk[2] if args.claim_rows is None else args.claim_rows
    args.prefetch_hint = walk[3] if args.prefetch_hint is None else args.prefetch_hint
    base = vars(args)
    configs = [("default", {})] + (SWEEP if args.sweep else [])
    results = {"machine": platform.processor() or platform.machine(), "args": base, "isas": supported_isas(),
               "pool_gb": pool.nbytes / 1e9, "configs": {}}
    for label, overrides in configs:
        cfg = {**base, **overrides}
        rows = [bench_threads(int(n), pool, table, cfg, gen, with_torch=not overrides)
                for n in args.threads.split(",")]
        results["configs"][label] = rows
        shrink = f" shrinking to {cfg['least_rows']}" if cfg["guided"] else ""
        print_table(f"[{label}] pool {pool.nbytes / 1e9:.2f} GB, {n_experts} experts of "
                    f"{expert_bytes / 2**20:.1f} MiB ({args.dtype}), {cfg['experts_per_call']} experts x "
                    f"{cfg['tokens']} token(s) per call, {WALKS[cfg['row_block']]}, "
                    f"prefetch {cfg['prefetch']} B ({cfg['prefetch_hint']}), claims of {cfg['claim_rows']} rows"
                    f"{shrink}, spin {cfg['spin_us']} us, caller joins: {cfg['caller_joins']}",
                    rows)
        if args.json:  # after every configuration, so a run cut short still leaves numbers
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
