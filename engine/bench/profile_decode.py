"""Where a decode step's time goes: the fast path's step under torch.profiler, kernel time by kind.

    python -m engine.bench.profile_decode --layers 8 --batch 1 [--json out.json]

Builds the synthetic Qwen3.6-35B-A3B shape on the device, fills a prompt per sequence, then profiles
`--steps` decode steps launched directly (the same kernels a graph replays) and prints, per kernel name,
calls and microseconds per step, next to the step's wall time replayed as a graph (kernels chained with
programmatic dependent launch, and without it) and launched directly.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.profile_decode")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from engine.synth import synth_model

    model, _ = synth_model("qwen3.6-35b-a3b", args.layers, device="cuda", dtype=torch.bfloat16)
    model.enable_fast(slots=args.batch, capacity=args.context + args.steps * 4 + 64, graphs=True)
    states = [model.new_state() for _ in range(args.batch)]
    g = torch.Generator().manual_seed(0)
    for st in states:
        model.forward([(torch.randint(0, model.config.vocab_size, (args.context,), generator=g), st)])
    step = lambda: model.forward([(torch.tensor([5]), st) for st in states])  # noqa: E731
    from engine.kernels.launch import set_pdl

    walls = {}
    for mode in ("graph, no PDL", "graph", "direct"):  # last: direct launches, which the profile names
        set_pdl(mode != "graph, no PDL")
        model.decode_steps.capture = mode != "direct"
        model.decode_steps._buckets.clear()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        walls[mode] = (time.perf_counter() - t) / args.steps * 1e6
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = sorted(((n, c / args.steps, t / args.steps) for n, (c, t) in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"decode step, {args.layers} layers, batch {args.batch}: wall {walls['graph']:.0f} us replayed "
          f"({walls['graph, no PDL']:.0f} without PDL), {walls['direct']:.0f} us launched directly; kernels "
          f"{total:.0f} us, "
          f"{sum(r[1] for r in rows):.0f} launches")
    print(f"{'kernel':<72}{'calls':>7}{'us/step':>10}{'share':>8}")
    for name, calls, us in rows[:30]:
        print(f"{name[:71]:<72}{calls:>7.0f}{us:>10.1f}{us / total:>8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"walls_us": walls, "kernels": rows, "layers": args.layers, "batch": args.batch}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
