"""Where a decode step's time goes: the fast path's step under torch.profiler, kernel time by kind.

    python -m engine.bench.profile_decode --layers 8 --batch 1 [--json out.json]
    python -m engine.bench.profile_decode --moe-backend offload --moe-slots 37.5%     (an expert cache)
    ... --decode-trace steps.json     (the profiled steps on one time line, every stream: chrome://tracing)

Builds the synthetic Qwen3.6-35B-A3B shape on the device, fills a prompt per sequence, then profiles
`--steps` decode steps launched directly (the same kernels a graph replays) and prints, per kernel name,
calls and microseconds per step, next to the step's wall time replayed as a graph (kernels chained with
programmatic dependent launch, and without it) and launched directly; with an expert cache, the step
launched directly and as graphs between the cache's layers (what serving runs, and what is profiled).
Each step feeds fresh random tokens, so an expert cache sees a step's routing change as in serving. With an
expert cache it also prints the host side: torch ops by self CPU time, and the Python functions by their own time
(cProfile over the same steps), with the expert counters of the profiled steps.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from engine.bench.model import ExpertTraffic


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.profile_decode")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--synthetic", default="qwen3.6-35b-a3b", help="synthetic size (default %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda (a CPU run only checks the script)")
    p.add_argument("--moe-backend", choices=("fused", "offload", "cpu", "hybrid"), default="fused")
    p.add_argument("--moe-slots", default="37.5%", help="device expert slots with an expert cache (N or P%%)")
    p.add_argument("--prefill", type=int, default=0,
                   help="also profile one prompt of this many tokens, layer-major in --piece-tokens pieces")
    p.add_argument("--piece-tokens", type=int, default=2048)
    p.add_argument("--moe-decode", choices=("auto", "mapped", "host"), default="auto",
                   help="how decode goes through the expert cache (as serve)")
    p.add_argument("--moe-prefetch", choices=("auto", "on", "off"), default="auto",
                   help="a mapped decode copies each layer's likely expert in while its mixer runs (as serve)")
    p.add_argument("--trace", help="with --prefill: write the profiled prompt's Chrome trace here (copy and "
                                  "compute streams on one time line: does the stream hide under the compute?)")
    p.add_argument("--decode-trace", help="write the profiled decode steps' Chrome trace here (every stream's "
                                         "kernels and copies on one time line: what the PCIe link waits for)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from engine.synth import synth_model

    cached = args.moe_backend != "fused"
    where = {}
    if cached:
        from engine.experts.registry import experts_factory

        where = dict(experts=experts_factory(args.moe_backend, device=args.device, slots=args.moe_slots,
                                             decode=args.moe_decode, prefetch=args.moe_prefetch),
                     expert_device="cpu")
    model, _ = synth_model(args.synthetic, args.layers, device=args.device, dtype=torch.bfloat16, **where)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    if model.device.type == "cuda":
        model.enable_fast(slots=args.batch + (1 if args.prefill else 0), graphs=True,
                          capacity=max(args.context + args.steps * 8 + 64, args.prefill + 64))
    states = [model.new_state() for _ in range(args.batch)]
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for st in states:
        model.forward([(torch.randint(0, vocab, (args.context,), generator=g), st)])
    step = lambda: model.forward([(torch.randint(0, vocab, (1,), generator=g), st) for st in states])  # noqa: E731
    from engine.kernels.launch import set_pdl

    walls = {}
    # last: what the profile names (with an expert cache, the graphed segments serving replays)
    for mode in ("direct", "graph") if cached else ("graph, no PDL", "graph", "direct"):
        set_pdl(mode != "graph, no PDL")
        if model.fast is not None:
            model.decode_steps.capture = mode != "direct"
            model.decode_steps._buckets.clear()
        for _ in range(3):
            step()
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        walls[mode] = (time.perf_counter() - t) / args.steps * 1e6
    from torch.profiler import ProfilerActivity, profile

    host = {}
    if cached:
        host = _host_side(model, step, args.steps, sync)
    on_cpu = model.device.type != "cuda"  # a CPU run checks the script: its ops are what there is to profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU] if cached or on_cpu
                 else [ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        sync()
    if args.decode_trace:
        prof.export_chrome_trace(args.decode_trace)
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = sorted(((n, c / args.steps, t / args.steps) for n, (c, t) in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    mapped = model.fast is not None and model.fast.mapped is not None
    if cached:
        print(f"decode step, {args.layers} layers, batch {args.batch}, experts {args.moe_backend} "
              f"{args.moe_slots} slots, decode {'mapped' if mapped else 'host'}: {walls['graph']:.0f} us "
              f"as graphs ({'one a step' if mapped else 'between the cache layers'}), "
              f"{walls['direct']:.0f} us launched directly; kernels {total:.0f} us, "
              f"{sum(r[1] for r in rows):.0f} launches")
    else:
        print(f"decode step, {args.layers} layers, batch {args.batch}: wall {walls['graph']:.0f} us replayed "
              f"({walls['graph, no PDL']:.0f} without PDL), {walls['direct']:.0f} us launched directly; kernels "
              f"{total:.0f} us, {sum(r[1] for r in rows):.0f} launches")
    print(f"{'kernel':<72}{'calls':>7}{'us/step':>10}{'share':>8}")
    for name, calls, us in rows[:30]:
        print(f"{name[:71]:<72}{calls:>7.0f}{us:>10.1f}{us / total:>8.1%}")
    cpu_ops = []
    if cached:
        cpu_ops = [(name, calls / args.steps, us / args.steps) for name, calls, us in _host_ops(prof)]
        print(f"\n{'torch op (host)':<72}{'calls':>7}{'self us/step':>14}")
        for name, calls, us in cpu_ops[:25]:
            print(f"{name[:71]:<72}{calls:>7.0f}{us:>14.1f}")
        print(f"\nexpert counters over {args.steps} steps: {host['experts']}")
        print(f"{'python function (own time)':<72}{'calls':>7}{'us/step':>10}")
        for name, calls, us in host["functions"][:30]:
            print(f"{name[:71]:<72}{calls:>7.0f}{us:>10.1f}")
    prefill = _prefill(model, args, sync, g) if args.prefill else {}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"walls_us": walls, "kernels": rows, "layers": args.layers, "batch": args.batch,
                       "moe_backend": args.moe_backend, "cpu_ops": cpu_ops, **host, "prefill": prefill}, f, indent=1)
    return 0


def _release(state) -> None:
    if hasattr(state, "release"):
        state.release()  # a fast-path slot back to its pool


def _prefill(model, args, sync, g) -> dict:
    """One prompt of args.prefill tokens on a fresh state, layer-major: its wall time, then the same again
    under the profiler, kernel and copy time summed per kind; with an expert cache, the pool's bytes moved.
    Wall near copies + compute says the stream does not overlap the compute; near the larger of them, it does."""
    from torch.profiler import ProfilerActivity, profile

    model.piece_tokens = args.piece_tokens if args.prefill > args.piece_tokens else None
    vocab = model.config.vocab_size
    walls = []
    for _ in range(2):  # the first compiles this size's kernels
        st = model.new_state(args.prefill + 8)
        prompt = torch.randint(0, vocab, (args.prefill,), generator=g)
        sync()
        t = time.perf_counter()
        model.forward([(prompt, st)], logits="last")
        sync()
        walls.append(time.perf_counter() - t)
        _release(st)
    traffic = ExpertTraffic(model, measure_bp=False)
    before = traffic.mark()
    st = model.new_state(args.prefill + 8)
    prompt = torch.randint(0, vocab, (args.prefill,), generator=g)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        model.forward([(prompt, st)], logits="last")
        sync()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kinds = defaultdict(float)
    spans = defaultdict(list)  # kind -> (start, end) us of each device event
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            kind = "copy" if "memcpy" in ev.name.lower() else "kernels"
            kinds[kind] += us
            if ev.time_range is not None:
                spans[kind].append((ev.time_range.start, ev.time_range.end))
    fast = getattr(st, "slot", None) is not None
    _release(st)
    busy = {k: _union_us(v) for k, v in spans.items()}
    both = _union_us(spans["copy"] + spans["kernels"]) if spans else 0.0
    overlap_s = (busy.get("copy", 0.0) + busy.get("kernels", 0.0) - both) / 1e6
    out = {"tokens": args.prefill, "fast_path": fast, "piece_tokens": model.piece_tokens, "wall_s": walls[-1],
           "profiled": {k: v / 1e6 for k, v in kinds.items()}, "overlap_s": overlap_s,
           "busy_s": {k: v / 1e6 for k, v in busy.items()}}
    moved = traffic.since(before)
    if moved:
        out["pools_moved"] = moved["pool_passes"]
    prof_rows = _host_ops(prof)
    out["host_ops"] = prof_rows[:15]
    print(f"\nprefill {args.prefill} tokens ({'fast' if fast else 'eager'} path), pieces of {model.piece_tokens}: "
          f"wall {walls[-1] * 1e3:.1f} ms (first {walls[0] * 1e3:.1f}); under the profiler, copies "
          f"{kinds['copy'] / 1e3:.1f} ms, kernels {kinds['kernels'] / 1e3:.1f} ms"
          + (f", {moved['pool_passes']:.2f} pools moved" if moved else "")
          + f"; copies and kernels ran at once for {overlap_s * 1e3:.1f} ms")
    for name, count, us in prof_rows[:15]:
        print(f"  host {name[:60]:<60}{count:>7}{us / 1e3:>10.1f} ms")
    return out


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (microseconds): the time a stream kind was busy at all."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _host_side(model, step, steps: int, sync) -> dict:
    """cProfile over `steps` decode steps: each Python function's own time per step, and the expert
    counters those steps moved."""
    import cProfile
    import pstats

    traffic = ExpertTraffic(model, measure_bp=False)
    before = traffic.mark()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    funcs = sorted(((f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]} {fn[2]}", v[1] / steps, v[2] / steps * 1e6)
                    for fn, v in st.stats.items()), key=lambda r: -r[2])
    return {"experts": traffic.since(before)["experts"], "functions": funcs}


def _host_ops(prof) -> list[tuple[str, int, float]]:
    """(torch op, calls, self CPU microseconds) of a profile's host side, the costliest first."""
    return sorted(((e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CPU), key=lambda r: -r[2])


if __name__ == "__main__":
    raise SystemExit(main())
