"""Expert-hierarchy benchmark on a synthetic model shape: builds the host pool once, then runs every
configuration in this process (decode tok/s at batch 1 per backend, hit rate, 8k prefill with and without
layer streaming), each next to its bandwidth bound (bytes moved / measured bandwidth). Prints a table and
writes JSON.

Only the routed experts are timed (attention, shared expert and norms are not modelled), so the figures are the MoE
part of a step; the routing of every timed step is drawn and put on the device before the clock starts (the whole
engine, router included: `killick bench model`). Routing is uniform random top-k by default (no locality: the hit
rate is about the cache fraction); `--routing uniform,zipf` adds decode runs with skewed expert popularity.

    python -m engine.bench.decode --synthetic qwen3.6-35b-a3b --slots 37% --threads 6
    python -m engine.bench.decode --small        # CPU smoke test, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import torch

from engine.bench import bw as bench_bw
from engine.bench import route as bench_route
from engine.bench.args import add_decode_arguments, split_decode_lists
from engine.experts import cpu_runner
from engine.experts.cpu_runner import run_on_cpu
from engine.experts.policy import BandwidthEstimate, slots_from_spec
from engine.experts.registry import create_slot_backend
from engine.experts.synthetic import get_shape, synthetic_pool
from engine.flags import default_device


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Router:
    """Seeded top-k routing per (layer, step): uniform, or zipf-skewed expert popularity per layer."""

    def __init__(self, shape, device, kind: str, seed: int = 0) -> None:
        self.shape, self.device, self.g = shape, device, torch.Generator().manual_seed(seed)
        e = shape.experts
        if kind == "zipf":
            ranks = torch.stack([torch.randperm(e, generator=self.g) for _ in range(shape.layers)]) + 1
            self.p = 1.0 / ranks.double()  # [L, E] popularity, a different order per layer
        else:
            self.p = torch.ones(shape.layers, e, dtype=torch.double)

    def __call__(self, layer: int, tokens: int):
        ids = torch.multinomial(self.p[layer].expand(tokens, -1), self.shape.top_k, generator=self.g)
        w = torch.softmax(torch.randn(tokens, self.shape.top_k, generator=self.g), -1)
        return ids.to(self.device), w.to(self.device, self.shape.torch_dtype)  # [T, K] each


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def draw_routes(shape, router, tokens: int, steps: int) -> list[list[tuple]]:
    """Routing of `steps` forwards of `tokens` tokens, every layer's (ids, w) already on the device."""
    return [[router(layer, tokens) for layer in range(shape.layers)] for _ in range(steps)]


def run_forward(b, shape, routes: list[tuple], x) -> None:
    """One forward of the MoE stack on x with one step of draw_routes' routing."""
    b.begin_forward(x.shape[0], shape.top_k)
    for layer in range(shape.layers):
        b.forward(layer, x, *routes[layer])


def bound_seconds(delta: dict, expert_bytes: int, bp: float, bh: float) -> float:
    """Best possible miss-service time: fills at B_P and CPU runs at B_H, concurrently."""
    return max(delta["fills"] * expert_bytes / bp, delta["cpu_runs"] * expert_bytes / bh)


def _diff(after: dict, before: dict) -> dict:
    """Expert counters moved between two stats(); for hybrid also its split choices and explorations."""
    d = {k: after["total"][k] - before["total"][k] for k in ("hits", "misses", "fills", "cpu_runs", "bytes_moved")}
    if "split" in after:
        arms, was = after["split"]["arms"], before["split"]["arms"]
        d["arms"] = {a: arms[a] - was[a] for a in arms}
        d["arms"]["explored"] = after["split"]["explored"] - before["split"]["explored"]
    return d


def _timed(b, shape, router, device, x, repeats: int, bw) -> tuple[float, dict, float]:
    """Run the MoE stack `repeats` times on x: (seconds, expert counters moved, bound seconds)."""
    routes = draw_routes(shape, router, x.shape[0], repeats)  # outside the clock
    sync(device)
    before = b.stats()
    t0 = time.perf_counter()
    for step in routes:
        run_forward(b, shape, step, x)
    sync(device)
    secs = time.perf_counter() - t0
    d = _diff(b.stats(), before)
    return secs, d, bound_seconds(d, shape.layout.nbytes, *bw)


def bench_decode(b, shape, router, device, steps: int, warmup: int, bw, prompt: int = 0) -> dict:
    """Batch-1 decode after a `prompt`-token prefill (as in serving: it leaves streamed layers resident)."""
    if prompt:
        run_forward(b, shape, draw_routes(shape, router, prompt, 1)[0],
                    torch.randn(prompt, shape.hidden, device=device).to(shape.torch_dtype))
    x = torch.randn(1, shape.hidden, device=device).to(shape.torch_dtype) * 0.1  # [T=1, H]
    for step in draw_routes(shape, router, 1, warmup):
        run_forward(b, shape, step, x)
    secs, d, bound = _timed(b, shape, router, device, x, steps, bw)
    return {"tok_s": steps / secs, "bound_tok_s": steps / bound if bound > 0 else None,
            "hit_rate": d["hits"] / max(1, d["hits"] + d["misses"]), "fills_per_tok": d["fills"] / steps,
            "cpu_per_tok": d["cpu_runs"] / steps, "gb_moved": d["bytes_moved"] / 1e9, "arms": d.get("arms")}


def bench_prefill(b, shape, router, device, tokens: int, bw) -> dict:
    x = torch.randn(tokens, shape.hidden, device=device).to(shape.torch_dtype) * 0.1  # [T, H]
    secs, d, bound = _timed(b, shape, router, device, x, 1, bw)
    return {"tok_s": tokens / secs, "bound_tok_s": tokens / bound if bound > 0 else None,
            "streamed": bool(b.streamer and b.streamer.active), "gb_moved": d["bytes_moved"] / 1e9,
            "cpu_runs": d["cpu_runs"], "seconds": secs}


def configs(args, total: int, slots: int):
    """(label, backend, slots, stream_prefill mode, kind, threads, routing): every configuration of one run."""
    t0, r0 = args.threads[0], args.routing[0]
    out = [(f"decode {n} t{t0}", n, slots, "auto", "decode", t0, r0) for n in args.backends]
    out.append(("decode fused (all resident)", "offload", total, "auto", "fused", t0, r0))
    # the two ways to serve a prompt, each forced: whether `auto` would stream depends on measured bandwidths
    out.append((f"prefill {args.prefill_tokens} stream", "offload", slots, "on", "prefill", t0, r0))
    out.append((f"prefill {args.prefill_tokens} on-demand", "offload", slots, "off", "prefill", t0, r0))
    out += [(f"decode {n} t{t}", n, slots, "auto", "decode", t, r0) for t in args.threads[1:]
            for n in args.backends if n != "offload"]
    out += [(f"decode {n} t{t0} {r}", n, slots, "auto", "decode", t0, r) for r in args.routing[1:]
            for n in args.backends]
    return out  # most important first: a session cut short still has them


def run_config(pool, shape, args, device, bw, cfg) -> dict:
    label, name, slots, stream, kind, threads, routing = cfg
    torch.set_num_threads(threads)
    cpu_runner.set_threads(threads)
    bw = (bw[0], bw[1][threads])
    est = BandwidthEstimate(bp=bw[0], bh=bw[1], frozen=args.freeze)
    b = create_slot_backend(name, pool, slots, device, estimate=est, stream_prefill=stream,
                            slot_policy=args.slot_policy)
    router = Router(shape, device, routing, seed=1)
    try:
        if kind == "fused":
            for layer in range(shape.layers):
                b.cache.admit(layer, list(range(shape.experts)))
            b.cache.table.unlock_all()
        if kind == "prefill":
            res = bench_prefill(b, shape, router, device, args.prefill_tokens, bw)
        else:
            warm = 0 if kind == "fused" else min(args.warmup, 2 * slots // (shape.top_k * shape.layers) + 2)
            prompt = 0 if kind == "fused" else args.warm_prefill
            res = bench_decode(b, shape, router, device, args.steps, warm, bw, prompt)
        res.update(config=label, backend=name, slots=slots, threads=threads, routing=routing, q_bp=b.estimate.bp,
                   q_bh=b.estimate.bh)
        return res
    finally:
        b.close()
        del b
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    """One line a configuration; hybrid's: the layer calls of the timed steps that split / filled every miss /
    ran every miss on the CPU, and how many of them were explorations."""
    print("expert path alone (routed experts of every MoE layer; routing drawn on the device before timing)")
    print(f"{'config':40} {'tok/s':>10} {'bound tok/s':>12} {'hit rate':>9} {'GB moved':>9} "
          f"{'split/fill/cpu (explored)':>26}")
    for r in rows:
        bound = f"{r['bound_tok_s']:.1f}" if r.get("bound_tok_s") else "-"
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        a = r.get("arms")
        arms = f"{a['split']}/{a['fill']}/{a['cpu']} ({a['explored']})" if a else "-"
        print(f"{r['config']:40} {r['tok_s']:10.1f} {bound:>12} {hit:>9} {r['gb_moved']:9.2f} {arms:>26}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="killick bench decode", description=__doc__.splitlines()[0])
    add_decode_arguments(ap)
    return run_args(ap.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    args = split_decode_lists(args)
    device = torch.device(args.device or default_device())
    shape = get_shape(args.synthetic, scale_down=args.small)
    from engine.cache.tiers import default_host_budget

    free = default_host_budget(1.0)
    if shape.pool_bytes > 0.9 * free:
        raise ValueError(f"the {shape.name} expert pool takes {shape.pool_bytes / 1e9:.1f} GB of host RAM and "
                         f"{free / 1e9:.1f} GB is available: pass --small (a scaled-down shape), or run on a "
                         "larger machine")
    log(f"building {shape.name} pool: {shape.pool_bytes / 1e9:.1f} GB")
    t0 = time.perf_counter()
    pool = synthetic_pool(shape, device=device, progress=lambda p: log("  " + p.line()))
    log(f"pool ready in {time.perf_counter() - t0:.1f}s, pinned={pool.pinned}")
    layout = shape.layout
    host = pool.wait_layer(0)[:64]  # B_P of the pool's own memory (registered after filling)
    bp = (bench_bw.measure_bp(layout, shape.torch_dtype, host=host) if device.type == "cuda"
          else bench_bw.measure_copy(layout, shape.torch_dtype))
    bh = {t: bench_bw.measure_bh(layout, shape.torch_dtype, t, experts=min(64, shape.experts))
          for t in args.threads}
    log(f"B_P {bp / 1e9:.1f} GB/s, B_H " + ", ".join(f"{v / 1e9:.2f} GB/s ({t} thr)" for t, v in bh.items()))
    total = shape.layers * shape.experts
    slots = slots_from_spec(args.slots, total_experts=total, expert_bytes=layout.nbytes, free_bytes=0)
    result = {"shape": shape.__dict__, "device": str(device), "threads": args.threads, "bp": bp,
              "bh": {str(t): v for t, v in bh.items()}, "slots": slots, "pinned": pool.pinned,
              "cpu_runner": run_on_cpu.__name__, "routing": args.routing, "rows": [], "failed": [],
              "what": "expert path alone: routed experts of every MoE layer, routing drawn before timing",
              "slot_policy": args.slot_policy,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    for cfg in configs(args, total, slots):
        log(f"running {cfg[0]} ({cfg[2]} slots)")
        try:
            result["rows"].append(run_config(pool, shape, args, device, (bp, bh), cfg))
            log(f"  {result['rows'][-1]['tok_s']:.1f} tok/s")
        except Exception as exc:  # one broken configuration must not cost the others' numbers
            log(f"  FAILED: {exc!r}\n{traceback.format_exc()}")
            result["failed"].append({"config": cfg[0], "error": repr(exc)})
        if args.json:  # after every configuration, so a session cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
    result["routing_us_per_layer"] = routing_costs(shape, slots, device, pool)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print_table(result["rows"])
    print("routing bookkeeping, us per MoE layer step:", result["routing_us_per_layer"])
    return 1 if result["failed"] else 0


def routing_costs(shape, slots: int, device, pool) -> dict:
    """Host bookkeeping vs the Triton routing kernel (CUDA only) per MoE layer step, and the backend's whole
    host side (`backend`)."""
    out = {}
    for name, fn in (("host", bench_route.host_us), ("triton", bench_route.kernel_us),
                     ("backend", lambda *a: bench_route.backend_us(*a, pool))):
        if name == "triton" and device.type != "cuda":
            continue
        try:
            out[name] = fn(shape, slots, device)
        except Exception as exc:  # e.g. the kernel fails to compile: report, keep the other figure
            out[name] = repr(exc)
    return out


if __name__ == "__main__":
    sys.exit(main())
