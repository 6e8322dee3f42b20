"""The host's planning in a routed prompt's MoE layer call (an extend's), on this machine's CPU: from the routing
on the host to the start of the CPU's share (OffloadBackend.forward's hits, misses, copies ahead, split and the
job's pairs), the time the CPU waits in each such call besides the device's, in two parts: to the split made, and
from there to the job's start (its pairs, buffers and rows handed to the job's thread until it runs). A hybrid
backend on a CPU device over a synthetic pool of the real expert counts (Qwen3.6-35B-A3B: 256 experts, top-8) at
small widths, so the experts themselves take little; 37.5% of the pool in slots. A part of the engine, not the
engine: on the GPU box the same code runs between the routing's read-back and the job (profile_decode --extend's
'routed', 'planned' and 'cpu at' columns).

Also the copies: experts copied and copy calls issued per extend (one a run of consecutive experts into
consecutive slots), and the engine thread's time queueing the next layer's copies ahead in each such call. --tier
and --noise-z set aligned.TIER and aligned.NOISE_Z (1.0 and 0: rank alone, ties only, as before bulk placements
chose among interchangeable candidates).

    python -m engine.bench.plan [--tokens 256] [--extends 40] [--tier 1.25] [--noise-z 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.experts import aligned
from engine.experts.host_pool import pool_from_source
from engine.experts.hybrid import HybridBackend
from engine.experts.policy import BandwidthEstimate
from engine.experts.source import ExpertWeights

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 8, 256, 8, 64, 32


def _backend(seed: int) -> HybridBackend:
    g = torch.Generator().manual_seed(seed)
    gate_up = {i: (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.3).to(torch.bfloat16)
               for i in range(LAYERS)}
    down = {i: (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.3).to(torch.bfloat16) for i in range(LAYERS)}
    est = BandwidthEstimate(bp=53e9, bh=80e9, frozen=True)  # the box's rates: the split gives the CPU a share
    return HybridBackend(pool_from_source(ExpertWeights(gate_up, down)), int(0.375 * LAYERS * EXPERTS), "cpu",
                         estimate=est, stream_prefill="off", slot_policy="lfu", lookahead="on")


def _extend(backend: HybridBackend, tokens: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    backend.begin_forward(tokens, TOP_K, hold=True, span=tokens)
    for layer in range(LAYERS):
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1).to(torch.bfloat16)
        backend.forward(layer, x, ids, w)
    backend.end_forward()


def run(tokens: int, extends: int, warmup: int = 6, tier: float | None = None,
        noise_z: float | None = None) -> dict:
    kept = aligned.TIER, aligned.NOISE_Z
    aligned.TIER = kept[0] if tier is None else tier
    aligned.NOISE_Z = kept[1] if noise_z is None else noise_z
    backend = _backend(0)
    try:
        for s in range(warmup):
            _extend(backend, tokens, s)
        plans, parts, calls, ahead_ms, copies = [], {"split": [], "start": []}, 0, [], 0
        copied = backend.stats()["total"]["fills"]
        t0 = time.perf_counter()
        for s in range(warmup, warmup + extends):
            backend.call_log = []
            _extend(backend, tokens, s)
            calls += len(backend.call_log)
            timed = [c for c in backend.call_log if c.cpu_start_ms >= 0]
            plans += [c.cpu_start_ms - c.routed_ms for c in timed]
            parts["split"] += [c.planned_ms - c.routed_ms for c in timed]
            parts["start"] += [c.cpu_start_ms - c.planned_ms for c in timed]
            ahead_ms += [c.queued_ms - c.ran_ms for c in backend.call_log if c.ahead > 0 and c.ran_ms >= 0]
            copies += sum(c.copies for c in backend.call_log)
        wall = time.perf_counter() - t0
        copied = backend.stats()["total"]["fills"] - copied
    finally:
        backend.close()
        aligned.TIER, aligned.NOISE_Z = kept
    if not plans:
        raise RuntimeError("no layer call ran experts on the CPU: nothing to time")
    return {"what": "part of the engine: OffloadBackend.forward's planning (hybrid, CPU device, synthetic pool)",
            "tokens": tokens, "extends": extends, "layer_calls": calls, "timed_calls": len(plans),
            "plan_ms_median": statistics.median(plans), "plan_ms_mean": statistics.fmean(plans),
            "plan_ms_max": max(plans), "extend_ms_mean": wall / extends * 1e3,
            **{f"{part}_ms_median": statistics.median(v) for part, v in parts.items()},
            "tier": kept[0] if tier is None else tier, "noise_z": kept[1] if noise_z is None else noise_z,
            "copied_per_extend": copied / extends,
            "copy_calls_per_extend": copies / extends,
            "ahead_ms_median": statistics.median(ahead_ms) if ahead_ms else float("nan"),
            "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens of each extend (default 256)")
    ap.add_argument("--extends", type=int, default=40, help="timed extends (default 40)")
    ap.add_argument("--tier", type=float, default=aligned.TIER,
                    help=f"interchangeable candidates' heat factor, aligned.TIER (default {aligned.TIER})")
    ap.add_argument("--noise-z", type=float, default=aligned.NOISE_Z,
                    help=f"... or standard deviations of their uses, aligned.NOISE_Z (default {aligned.NOISE_Z}; "
                         "--tier 1 --noise-z 0: rank alone)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.extends < 1:
        ap.error("--tokens and --extends must be at least 1")
    if args.tier < 1.0 or args.noise_z < 0:
        ap.error(f"--tier is a factor of at least 1.0 and --noise-z at least 0, got {args.tier} and {args.noise_z}")
    res = run(args.tokens, args.extends, tier=args.tier, noise_z=args.noise_z)
    print(f"{res['what']}\n{res['timed_calls']} layer calls with a CPU share, of {res['layer_calls']}, "
          f"{args.tokens}-token extends")
    print(f"{'routing -> CPU job start':28s} median {res['plan_ms_median']:.3f} ms   mean {res['plan_ms_mean']:.3f}"
          f"   max {res['plan_ms_max']:.3f}")
    print(f"{'  routing -> split made':28s} median {res['split_ms_median']:.3f} ms")
    print(f"{'  split made -> job start':28s} median {res['start_ms_median']:.3f} ms")
    print(f"{'copies ahead queued':28s} median {res['ahead_ms_median']:.3f} ms a call with copies ahead")
    print(f"{'copies per extend':28s} {res['copy_calls_per_extend']:.1f} calls for {res['copied_per_extend']:.1f} "
          f"experts (tier {res['tier']}, noise z {res['noise_z']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
