"""Where a decode step's time goes: the fast path's step under torch.profiler, kernel time by kind.

    python -m engine.bench.profile_decode --layers 8 --batch 1 [--json out.json]
    python -m engine.bench.profile_decode --moe-backend offload --moe-slots 37.5%     (an expert cache)
    ... --decode-trace steps.json     (the profiled steps on one time line, every stream: chrome://tracing)
    ... --moe-backend hybrid --prefill 8192 --extend 256 [--extend-trace ext.json]   (an agent turn's extend)

Builds the synthetic Qwen3.6-35B-A3B shape on the device, fills a prompt per sequence, then profiles
`--steps` decode steps launched directly (the same kernels a graph replays) and prints, per kernel name,
calls and microseconds per step, next to the step's wall time replayed as a graph (kernels chained with
programmatic dependent launch, and without it) and launched directly; with an expert cache, the step
launched directly and as graphs between the cache's layers (what serving runs, and what is profiled).
Each step feeds fresh random tokens, so an expert cache sees a step's routing change as in serving. With an
expert cache it also prints the host side: torch ops by self CPU time, and the Python functions by their own time
(cProfile over the same steps), with the expert counters of the profiled steps.

With --extend N (after --prefill P), a short prompt of N tokens on a state holding a P-token prompt, as an agent's
tool result extends its cached context: its wall time; with an expert cache, each MoE layer call of the last timed
extend (its misses filled, run on the CPU or copied ahead for the next layer, and when its routing came back and its
CPU job ran: OffloadBackend.call_log; how far into the forward its first layer call and CPU job began, and how long
before its end its last CPU job ended) with where the engine thread sat still in it and the garbage collector's
pauses (stalls.Stalls: the timed extends run under its sampler); under the profiler where the compute stream waited
(its idle gaps over the extend, and the engine thread's torch ops inside them: what the host was doing while the
device had nothing queued; when the copy stream began and stopped copying and its idle gaps between; and its
device work by kernel, copies and the wait for a joined CPU job among them), then
the Python functions by their own and cumulative time (cProfile, another run), and on CUDA the host syncs of one
more extend by the engine line that made each (syncs.SyncSites).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections import defaultdict

import torch

from engine.bench.args import set_expert_threads_from
from engine.bench.prof_events import GAP_US, compute_gaps, copy_timeline, device_work_by_kernel, host_ops, union_us
from engine.bench.report import print_buckets, print_split
from engine.bench.stalls import Stalls
from engine.bench.syncs import SyncSites
from engine.bench.traffic import ExpertTraffic
from engine.flags import SYNTH_SIZES, add_cpu_expert_arguments, device_arg, moe_slots_arg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.profile_decode")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--synthetic", default="qwen3.6-35b-a3b", choices=SYNTH_SIZES,
                   help="synthetic size (default %(default)s)")
    p.add_argument("--router-zipf", type=float, default=None,
                   help="routers skewed so expert popularity follows a Zipf law of this exponent (as bench model's)")
    p.add_argument("--device", type=device_arg, default="cuda", help="cuda (a CPU run only checks the script)")
    p.add_argument("--moe-backend", choices=("fused", "offload", "cpu", "hybrid"), default="fused")
    p.add_argument("--moe-slots", type=moe_slots_arg, default="37.5%",
                   help="device expert slots with an expert cache (N or P%%)")
    p.add_argument("--prefill", type=int, default=0,
                   help="also profile one prompt of this many tokens, layer-major in --piece-tokens pieces")
    p.add_argument("--piece-tokens", type=int, default=2048)
    p.add_argument("--moe-decode", choices=("auto", "mapped", "host"), default="auto",
                   help="how decode goes through the expert cache (as serve)")
    p.add_argument("--moe-prefetch", choices=("auto", "on", "off"), default="auto",
                   help="a mapped decode copies each layer's likely expert in while its mixer runs (as serve)")
    add_cpu_expert_arguments(p)
    p.add_argument("--trace", help="with --prefill: write the profiled prompt's Chrome trace here (copy and "
                                  "compute streams on one time line: does the stream hide under the compute?)")
    p.add_argument("--decode-trace", help="write the profiled decode steps' Chrome trace here (every stream's "
                                         "kernels and copies on one time line: what the PCIe link waits for)")
    p.add_argument("--extend", type=int, default=0,
                   help="with --prefill: also time and profile an extend of this many tokens after the prompt")
    p.add_argument("--extend-runs", type=int, default=3, help="timed extends, each after a prompt of its own")
    p.add_argument("--extend-trace", help="with --extend: write the profiled extend's Chrome trace here")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.extend and not args.prefill:
        p.error("--extend needs --prefill (the cached prompt it extends)")
    from engine.synth import synth_model

    cached = args.moe_backend != "fused"
    where = {}
    if cached:
        from engine.experts.registry import experts_factory

        set_expert_threads_from(args)

        where = dict(experts=experts_factory(args.moe_backend, device=args.device, slots=args.moe_slots,
                                             decode=args.moe_decode, prefetch=args.moe_prefetch),
                     expert_device="cpu")
    model, _ = synth_model(args.synthetic, args.layers, device=args.device, dtype=torch.bfloat16,
                           router_zipf=args.router_zipf, **where)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    if model.device.type == "cuda":
        model.enable_fast(slots=args.batch + (1 if args.prefill else 0), graphs=True,
                          capacity=max(args.context + args.steps * 8 + 64, args.prefill + args.extend + 64))
    if cached:  # as the engine's warm-up does: the CPU share's buffers sized before any timed call
        model.experts.reserve(max(args.piece_tokens, args.extend), model.config.top_k, model.dtype)
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
        cpu_ops = [(name, calls / args.steps, us / args.steps) for name, calls, us in host_ops(prof)]
        print(f"\n{'torch op (host)':<72}{'calls':>7}{'self us/step':>14}")
        for name, calls, us in cpu_ops[:25]:
            print(f"{name[:71]:<72}{calls:>7.0f}{us:>14.1f}")
        print(f"\nexpert counters over {args.steps} steps: {host['experts']}")
        print(f"{'python function (own time)':<72}{'calls':>7}{'us/step':>10}")
        for name, calls, us in host["functions"][:30]:
            print(f"{name[:71]:<72}{calls:>7.0f}{us:>10.1f}")
    prefill = _prefill(model, args, sync, g) if args.prefill else {}
    extend = _extend(model, args, sync, g) if args.extend else {}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"walls_us": walls, "kernels": rows, "layers": args.layers, "batch": args.batch,
                       "moe_backend": args.moe_backend, "cpu_ops": cpu_ops, **host, "prefill": prefill,
                       "extend": extend}, f, indent=1)
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
    busy = {k: union_us(v) for k, v in spans.items()}
    both = union_us(spans["copy"] + spans["kernels"]) if spans else 0.0
    overlap_s = (busy.get("copy", 0.0) + busy.get("kernels", 0.0) - both) / 1e6
    out = {"tokens": args.prefill, "fast_path": fast, "piece_tokens": model.piece_tokens, "wall_s": walls[-1],
           "profiled": {k: v / 1e6 for k, v in kinds.items()}, "overlap_s": overlap_s,
           "busy_s": {k: v / 1e6 for k, v in busy.items()}}
    moved = traffic.since(before)
    if moved:
        out["pools_moved"] = moved["pool_passes"]
    prof_rows = host_ops(prof)
    out["host_ops"] = prof_rows[:15]
    print(f"\nprefill {args.prefill} tokens ({'fast' if fast else 'eager'} path), pieces of {model.piece_tokens}: "
          f"wall {walls[-1] * 1e3:.1f} ms (first {walls[0] * 1e3:.1f}); under the profiler, copies "
          f"{kinds['copy'] / 1e3:.1f} ms, kernels {kinds['kernels'] / 1e3:.1f} ms"
          + (f", {moved['pool_passes']:.2f} pools moved" if moved else "")
          + f"; copies and kernels ran at once for {overlap_s * 1e3:.1f} ms")
    for name, count, us in prof_rows[:15]:
        print(f"  host {name[:60]:<60}{count:>7}{us / 1e3:>10.1f} ms")
    return out


# the timed extends' engine thread sampled this often, and a stack still this long reported (Stalls)
STALL_EVERY_S = 0.0005
STALL_MIN_S = 0.0015


def _extend(model, args, sync, g) -> dict:
    """args.extend tokens after a cached prompt of args.prefill, each run on a prompt of its own (as bench model's
    extend rows): wall times, then one extend under torch.profiler (the compute stream's idle gaps and the engine
    thread's ops inside them) and one under cProfile."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    model.piece_tokens = args.piece_tokens if args.prefill > args.piece_tokens else None
    vocab = model.config.vocab_size

    experts = model.experts if hasattr(model.experts, "call_log") else None  # an expert cache's layer calls
    layer_calls: list = []  # each timed extend's (OffloadBackend.call_log)
    starts: list = []  # ... and when its forward began (perf_counter)

    def once(wrap=None, log: bool = False) -> float:
        st = model.new_state(args.prefill + args.extend + 8)
        model.forward([(torch.randint(0, vocab, (args.prefill,), generator=g), st)], logits="last")
        ext = torch.randint(0, vocab, (args.extend,), generator=g)
        sync()
        if log and experts is not None:
            experts.call_log = []
        t = time.perf_counter()
        if wrap is None:
            model.forward([(ext, st)], logits="last")
        else:
            with wrap:
                model.forward([(ext, st)], logits="last")
                sync()
        sync()
        wall = time.perf_counter() - t
        if log and experts is not None:
            layer_calls.append(experts.call_log)
            starts.append(t)
            experts.call_log = None
        _release(st)
        return wall

    once()  # compiles this size's kernels
    # hybrid: the split's choices and rates as the timed extends begin, which their plans go by (learned in this
    # process, under the profiled decode steps and prompt too; bench model's may differ)
    policy = ExpertTraffic(model, measure_bp=False).split()
    stalls = [Stalls(threading.get_ident(), STALL_EVERY_S) for _ in range(max(1, args.extend_runs))]
    walls = [once(watch, log=True) for watch in stalls]  # each timed extend under its stall sampler
    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
    profiled_wall = once(prof)
    if args.extend_trace:
        prof.export_chrome_trace(args.extend_trace)
    gaps = compute_gaps(prof)
    copies = copy_timeline(prof)
    kernels = device_work_by_kernel(prof)
    cp = cProfile.Profile()  # a context manager: enabled inside once()'s `with`
    cprofile_wall = once(cp)
    syncs = SyncSites()
    once(syncs)
    st = pstats.Stats(cp)
    funcs = [("/".join(fn[0].split("/")[-2:]) + f":{fn[1]} {fn[2]}", v[1], v[2] * 1e3, v[3] * 1e3, "/engine/" in fn[0])
             for fn, v in st.stats.items()]
    own = [r[:4] for r in sorted(funcs, key=lambda r: -r[2])[:25]]
    cumulative = [r[:4] for r in sorted((r for r in funcs if r[4]), key=lambda r: -r[3])[:25]]
    walls_ms = [w * 1e3 for w in walls]  # in run order: a slow first one shows what it learnt from the untimed one
    median = sorted(walls_ms)[len(walls_ms) // 2]
    print(f"\nextend {args.extend} tokens after a cached {args.prefill}: wall {median:.1f} ms "
          f"(median of {', '.join(f'{w:.1f}' for w in walls_ms)}, in run order, under the stall sampler); under the "
          f"profiler {profiled_wall * 1e3:.1f} ms, under cProfile {cprofile_wall * 1e3:.1f}")
    print(f"compute stream: busy {gaps['busy_ms']:.1f} ms of {gaps['span_ms']:.1f} from its first kernel to its last; "
          f"idle {gaps['idle_ms']:.1f} ms in {len(gaps['gaps'])} gaps of {GAP_US} us or more; every stream busy "
          + ", ".join(f"{s} {ms:.1f} ms" for s, ms in gaps["streams"].items()) + " (compute: "
          + str(gaps.get("stream")) + ")")
    if copies is not None:
        print(_copy_line(copies))
    print(f"{'kernel (the profiled extend, every stream)':<72}{'calls':>7}{'ms':>9}")
    for name, calls, ms in kernels:
        print(f"{name[:71]:<72}{calls:>7}{ms:>9.2f}")
    buckets = model.fast.bucket_modes() if model.fast is not None else {}
    print_buckets({"prompt_buckets": buckets})  # whether the short runs replayed graphs (token_graphs.py)
    if policy:
        print("\nas the timed extends began:")
        print_split(policy)
    copy_calls = [sum(c.copies for c in calls) for calls in layer_calls]  # each timed extend's (LayerCall.copies)
    for k, calls in enumerate(layer_calls, 1):
        _print_calls(calls, f"timed extend {k} of {len(layer_calls)} ({walls_ms[k - 1]:.1f} ms)")
        if calls:
            print(_ends(calls, starts[k - 1], walls_ms[k - 1]))
        print(f"copies issued to the slots: {copy_calls[k - 1]} (one a run of consecutive experts into consecutive "
              "slots)")
        if calls:
            _print_stalls(stalls[k - 1], calls[0].at)
    print(f"{'gap start (ms)':>14}{'length':>8}  the engine thread's ops inside it (ms)")
    for gap in gaps["gaps"][:60]:
        ops = ", ".join(f"{n} {ms:.2f}" for n, ms in gap["ops"][:5])
        print(f"{gap['start_ms']:>14.2f}{gap['ms']:>8.2f}  {ops}")
    print(f"\n{'python function (cProfile, one extend)':<72}{'calls':>7}{'own ms':>9}{'cum ms':>9}")
    for name, calls, own_ms, cum_ms in own:
        print(f"{name[:71]:<72}{calls:>7}{own_ms:>9.2f}{cum_ms:>9.2f}")
    print(f"\n{'engine function by cumulative time':<72}{'calls':>7}{'own ms':>9}{'cum ms':>9}")
    for name, calls, own_ms, cum_ms in cumulative:
        print(f"{name[:71]:<72}{calls:>7}{own_ms:>9.2f}{cum_ms:>9.2f}")
    if syncs.counts:  # CUDA
        print(f"\n{'host syncs in one more extend, by engine line (sync debug mode)':<72}{'syncs':>7}")
        for site, n in syncs.sites():
            print(f"{site[:71]:<72}{n:>7}")
    return {"tokens": args.extend, "after": args.prefill, "walls_ms": walls_ms, "profiled_ms": profiled_wall * 1e3,
            "cprofile_ms": cprofile_wall * 1e3,
            "layer_calls": [c._asdict() for c in layer_calls[-1]] if layer_calls else [],
            "layer_calls_runs": [[c._asdict() for c in calls] for calls in layer_calls], "copy_calls_runs": copy_calls,
            "forward_at_runs": starts,
            "stalls_runs": [_stalls_json(w, calls[0].at if calls else 0.0) for w, calls in zip(stalls, layer_calls)],
            "prompt_buckets": buckets, "policy_at_start": policy,
            "compute_stream": gaps, "copy_stream": copies, "kernels": kernels, "functions_own": own,
            "functions_cumulative": cumulative, "syncs": syncs.sites()}


def _print_stalls(watch: Stalls, t0: float) -> None:
    """A timed extend's engine-thread stalls of STALL_MIN_S or more (where its stack sat still, sampled every
    STALL_EVERY_S) and its garbage collections, ms from the first MoE layer call's start."""
    found = watch.stalls(STALL_MIN_S)
    print(f"engine thread still for {STALL_MIN_S * 1e3:.1f} ms or more (sampled every {STALL_EVERY_S * 1e3:.1f} ms; "
          f"{len(watch.samples)} samples): {len(found)}" + ("" if found else " none"))
    for s in found[:8]:
        print(f"  at {(s.start - t0) * 1e3:7.2f} for {s.seconds * 1e3:6.2f} ms: " + " < ".join(s.where))
    gcs = ", ".join(f"gen {c.generation} at {(c.start - t0) * 1e3:.2f} for {c.seconds * 1e3:.2f} ms"
                    for c in watch.collections)
    print(f"garbage collections: {len(watch.collections)}" + (f" ({gcs})" if gcs else ""))


def _stalls_json(watch: Stalls, t0: float) -> dict:
    return {"stalls": [{"at_ms": (s.start - t0) * 1e3, "ms": s.seconds * 1e3, "where": list(s.where)}
                       for s in watch.stalls(STALL_MIN_S)],
            "collections": [{"generation": c.generation, "at_ms": (c.start - t0) * 1e3, "ms": c.seconds * 1e3}
                            for c in watch.collections], "samples": len(watch.samples)}


def _print_calls(calls, which: str) -> None:
    """An extend's MoE layer calls (OffloadBackend.call_log): what each planned, and when (ms from the call's start,
    which is ms from the first call's start) its routing came back, its split was made (an unread call's 'planned':
    its begin and slot table done), its CPU job ran, its hits and fills (or an unread call's experts) were queued on
    the device ('ran'), then the next layer's copies ahead ('queued'), the engine thread had the job's result and the
    call returned; then how long the CPU sat idle between its jobs (a copy engine behind on
    copies ahead, or a device behind on the layers between, keeps it waiting). 'copies': the copy calls the layer
    call issued (its fills and the next layer's copies ahead, one a run of consecutive experts)."""
    print(f"\n{which}: its MoE layer calls (ms; 'unread': every expert in a slot, routing not read back; "
          "'joined': the CPU job joined on the device, its 'woke' when the engine thread collected it)")
    head = ("layer", "kind", "start", "hits", "misses", "fills", "cpu", "ahead", "copies", "behind", "handoff",
            "routed", "planned", "cpu at", "cpu run", "waited", "ran", "queued", "woke", "end")
    print("".join(f"{h:>8}" for h in head))
    t0 = calls[0].at
    at = lambda ms: f"{ms:>8.2f}" if ms >= 0 else f"{'-':>8}"  # noqa: E731
    for c in calls:
        cpu = (f"{c.cpu_start_ms:>8.2f}{c.cpu_ms:>8.2f}{c.cpu_wait_ms:>8.2f}" if c.cpu_start_ms >= 0
               else f"{'-':>8}" * 3)
        print(f"{c.layer:>8}{c.kind:>8}{(c.at - t0) * 1e3:>8.2f}{c.hits:>8}{c.misses:>8}{c.fills:>8}{c.cpu:>8}"
              f"{c.ahead:>8}{c.copies if c.copies >= 0 else '-':>8}{c.behind:>8}{c.handoff_ms:>8.2f}"
              f"{at(c.routed_ms)}{at(c.planned_ms)}{cpu}"
              f"{at(c.ran_ms)}{at(c.queued_ms)}{at(c.woke_ms)}{c.end_ms:>8.2f}")
    jobs = [((c.at - t0) * 1e3 + c.cpu_start_ms, c.cpu_ms) for c in calls if c.cpu_start_ms >= 0]
    if jobs:
        span = jobs[-1][0] + jobs[-1][1] - jobs[0][0]
        run = sum(ms for _, ms in jobs)
        print(f"the CPU's {len(jobs)} jobs ran {run:.2f} ms of the {span:.2f} from the first's start to the last's "
              f"end (idle between them {span - run:.2f} ms); {sum(c.ahead for c in calls)} experts copied ahead, "
              f"{sum(c.fills for c in calls)} filled, {sum(c.cpu for c in calls)} run on the CPU")
    for c in calls:
        if c.tail_ms == c.tail_ms:  # (not nan)
            print(f"the last routed layer ({c.layer}): its fills landed {c.tail_ms:+.2f} ms after its CPU job's end "
                  "(negative: the device waited for the job; hybrid.TailClock)")


def _copy_line(c: dict) -> str:
    """prof_events.copy_timeline's copy stream as one line: where in the profiled extend's device work it copied."""
    longest = ", ".join(f"{ms:.2f} at {at:.2f}" for at, ms in c["gaps"][:4])
    return (f"copy stream {c['stream']}: its first copy began {c['first_ms']:.2f} ms into the device's work and its "
            f"last ended {c['ends_before_ms']:.2f} ms before that work's end ({c['span_ms']:.1f} ms); busy "
            f"{c['busy_ms']:.1f} ms, idle {c['idle_ms']:.1f} ms between in {len(c['gaps'])} gaps of {GAP_US} us or "
            f"more" + (f" (the longest: {longest})" if longest else ""))


def _ends(calls, start: float, wall_ms: float) -> str:
    """Where an extend's time before its CPU's first job and after its last one goes: when (ms from the forward's
    start) its first MoE layer call began and its first CPU job started, and how long before the extend's end (its
    result on the host) its last CPU job and its last MoE layer call ended. The CPU waits out the first; the
    device's last layers, the head and its read-back are the second."""
    at = lambda c: (c.at - start) * 1e3  # noqa: E731
    jobs = [(at(c) + c.cpu_start_ms, at(c) + c.cpu_start_ms + c.cpu_ms) for c in calls if c.cpu_start_ms >= 0]
    first = f"its first MoE layer call began {at(calls[0]):.2f} ms into the forward"
    last = f"its last returned {wall_ms - at(calls[-1]) - calls[-1].end_ms:.2f} ms before the extend's end"
    if not jobs:
        return f"{first}, {last}; no CPU job"
    return (f"{first}, its first CPU job {jobs[0][0]:.2f} ms; its last CPU job ended {wall_ms - jobs[-1][1]:.2f} ms "
            f"and {last}")


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


if __name__ == "__main__":
    raise SystemExit(main())
