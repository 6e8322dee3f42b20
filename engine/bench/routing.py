"""`killick bench routing`: the expert hit rate a skewed router buys, killick's slot cache (lru and lfu eviction)
against llama.cpp's static `--n-cpu-moe` placement at equal GPU memory, on the routing a synthetic model really
makes.

For each --router-zipf exponent a (0: today's checkpoint) it draws the seeded synthetic model (engine.synth,
the same weights `llama_cpp.sh --router-zipf a` converts), runs a seeded stream of random tokens through it
(prefill chunks: a causal model routes each token as decoding the stream would) and records every MoE layer's
top-k. Then, for each GPU expert fraction f, llama.cpp keeps N = L - round(f L) layers' experts on the CPU and
the slot cache gets the same GPU memory, (L - N) * E slots; both are simulated on the trace (engine/experts/
placement.py: the slot table's own policies at batch 1, every miss filled, counted after --warmup tokens; lfu
forgets with a half-life of --half-life tokens). "mapped" is the mapped decode's hit rate (misses read in place,
only clearly hotter experts moved into slots, engine/experts/admission.py) and "PCIe" its traffic per routed
expert (in-place reads plus fills; llama.cpp moves none, its misses run on the CPU).
"top" is an oracle: the trace's own most used experts pinned, the best any static per-expert placement could do.
"fit a" is the Zipf exponent fitted to the measured popularity by intended rank (past the capped head).

    killick bench routing --synthetic demo --router-zipf 0,0.8,1.2 --gpu-fraction 0.25,0.5
    killick bench routing --synthetic qwen3.6-35b-a3b --layers 8 --device cuda --router-zipf 0,1
    killick bench routing --synthetic qwen3.6-35b-a3b --layers 8 --iid --router-zipf 0,1   (no model: seconds)

--iid draws each token's routes independently from the law the Zipf router is calibrated to, at the size's
expert count and top-k, instead of recording a model (the real shape on any machine; a model's routes also
correlate between tokens and layers, which iid draws leave out).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from engine.experts import placement, zipf
from engine.experts.lru import HALF_LIFE


class RoutingRecorder:
    """An expert backend that notes every layer's top-k ids, then lets the real backend run."""

    def __init__(self, backend) -> None:
        self.backend, self.steps = backend, {}  # layer -> [topk_ids [T, K] per forward]

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        self.steps.setdefault(layer, []).append(topk_ids.to("cpu"))
        return self.backend.forward(layer, x, topk_ids, topk_w)

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def trace(self) -> np.ndarray:
        """[T, L, K] expert ids, MoE layers in order."""
        return np.stack([torch.cat(self.steps[k]).numpy() for k in sorted(self.steps)], axis=1)


def record(model, tokens: int, seed: int, chunk: int = 512) -> np.ndarray:
    """Routing trace [T, L, K] of a seeded random token stream through `model`."""
    rec = RoutingRecorder(model.experts)
    for layer in model.layers:
        if hasattr(layer.mlp, "backend"):
            layer.mlp.backend = rec
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state(tokens)
    with torch.inference_mode():
        for i in range(0, tokens, chunk):
            model.forward([(ids[i:i + chunk], state)])
    return rec.trace()


def iid_trace(num_experts: int, top_k: int, layers: int, tokens: int, a: float, seed: int) -> np.ndarray:
    """[T, L, K] routes drawn independently per token from the law the Zipf router is calibrated to (each
    layer's experts in its seeded popularity order, K distinct a token): the real shape's routing statistics
    without running the model (a model's routes also correlate between tokens and layers)."""
    rng = np.random.default_rng([0x51D, seed])
    p = zipf.zipf_popularity(num_experts, top_k, a) if a else np.full(num_experts, top_k / num_experts)
    p = p / p.sum()
    by_rank = [np.argsort(zipf.layer_ranks(num_experts, seed, layer)) for layer in range(layers)]  # rank -> expert
    return np.stack([[by_rank[layer][rng.choice(num_experts, top_k, replace=False, p=p)] for layer in range(layers)]
                     for _ in range(tokens)])


def skew_summary(trace: np.ndarray, num_experts: int, top_k: int, a: float, seed: int) -> dict:
    """How the measured popularity follows the law asked for: fitted exponent past the capped head (mean over
    layers) and the mean relative error of each expert's popularity against its rank's target."""
    pop = placement.popularity(trace, num_experts)  # [L, E]
    target = zipf.zipf_popularity(num_experts, top_k, a) if a else np.full(num_experts, top_k / num_experts)
    head = int((target >= zipf.CAP).sum())
    fits, errs = [], []
    for layer in range(pop.shape[0]):
        by_rank = np.empty(num_experts)
        by_rank[zipf.layer_ranks(num_experts, seed, layer)] = pop[layer]
        if a:
            fits.append(placement.zipf_fit(by_rank, first=head))
        errs.append(float(np.mean(np.abs(by_rank - target) / target)))
    return {"fit_a": float(np.mean(fits)) if fits else 0.0, "rel_err": float(np.mean(errs)), "capped_head": head,
            "top1_share": float(np.sort(pop, axis=1)[:, -1].mean())}


def rates(trace: np.ndarray, num_experts: int, fractions: list[float], warmup: int,
          half_life: float = HALF_LIFE) -> list[dict]:
    L = trace.shape[1]
    rows = []
    for f in fractions:
        n_cpu = placement.equal_memory(L, f)
        slots = (L - n_cpu) * num_experts
        row = {"gpu_fraction": (L - n_cpu) / L, "n_cpu_moe": n_cpu, "slots": slots}
        for name, (hits, routed) in {
            "static": placement.static_hits(trace, n_cpu, warmup),
            "lru": placement.slot_hits(trace, num_experts, slots, warmup) if slots else (0, 1),
            "lfu": placement.slot_hits(trace, num_experts, slots, warmup, "lfu", half_life) if slots else (0, 1),
            "top": placement.top_experts_hits(trace, num_experts, slots, warmup),
        }.items():
            row[name] = hits / routed
        if slots:
            hits, routed, fills = placement.mapped_hits(trace, num_experts, slots, warmup, "lfu", half_life)
            # a mapped decode's PCIe traffic per routed expert: its in-place reads and its fills
            row.update(mapped=hits / routed, mapped_pcie=(routed - hits + fills) / routed)
        else:
            row.update(mapped=0.0, mapped_pcie=1.0)
        rows.append(row)
    return rows


def run(args) -> dict:
    from engine.models import parse_dtype
    from engine.synth import synth_config, synth_model

    torch.manual_seed(args.seed)
    dtype = parse_dtype(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    out = {"what": "expert hit rate: the slot cache (lru, lfu, mapped decode) vs llama.cpp --n-cpu-moe at equal GPU "
                   "memory",
           "synthetic": args.synthetic, "layers": args.layers, "tokens": args.tokens, "warmup": args.warmup,
           "lfu_half_life": args.half_life,
           "seed": args.seed, "date": time.strftime("%Y-%m-%d"), "runs": []}
    out["iid"] = args.iid
    for a in args.router_zipf:
        t0 = time.perf_counter()
        if args.iid:
            raw = synth_config(size=args.synthetic, layers=args.layers)
            E, K = raw["text_config"]["num_experts"], raw["text_config"]["num_experts_per_tok"]
            trace = iid_trace(E, K, raw["text_config"]["num_hidden_layers"], args.tokens, a, args.seed)
        else:
            model, _ = synth_model(args.synthetic, args.layers, device=args.device, dtype=dtype, seed=args.seed,
                                   router_zipf=a)
            E, K = model.config.num_experts, model.config.top_k
            trace = record(model, args.tokens, args.seed + 1)
            del model
        run_ = {"router_zipf": a, "experts": E, "top_k": K, "moe_layers": trace.shape[1],
                **skew_summary(trace, E, K, a, args.seed),
                "rows": rates(trace, E, args.gpu_fraction, args.warmup, args.half_life),
                "seconds": time.perf_counter() - t0}
        out["runs"].append(run_)
        print(f"  router zipf {a}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def print_table(res: dict) -> None:
    print(f"bench routing — {res['what']}; synthetic {res['synthetic']}{' (iid routes)' if res.get('iid') else ''}"
          f"{'' if res['layers'] is None else ', ' + str(res['layers']) + ' layers'}, {res['tokens']} random tokens "
          f"(hit rates after {res['warmup']})")
    print(f"{'zipf a':>7}{'fit a':>7}{'rel err':>8}{'top-1':>7}{'GPU frac':>9}{'-ncmoe':>7}{'slots':>7}"
          f"{'llama.cpp':>10}{'LRU':>7}{'LFU':>7}{'mapped':>8}{'PCIe':>6}{'top':>7}")
    for run_ in res["runs"]:
        for r in run_["rows"]:
            print(f"{run_['router_zipf']:>7.2f}{run_['fit_a']:>7.2f}{run_['rel_err']:>8.2f}{run_['top1_share']:>7.2f}"
                  f"{r['gpu_fraction']:>9.2f}{r['n_cpu_moe']:>7d}{r['slots']:>7d}{r['static']:>10.3f}{r['lru']:>7.3f}"
                  f"{r['lfu']:>7.3f}{r['mapped']:>8.3f}{r['mapped_pcie']:>6.2f}{r['top']:>7.3f}")


def run_args(args) -> int:
    from engine.bench.args import print_and_save

    return print_and_save(run(args), print_table, args.json)


def main(argv=None) -> int:
    from engine.bench.args import add_routing_arguments

    p = argparse.ArgumentParser(prog="killick bench routing", description=__doc__.split("\n\n")[0])
    add_routing_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
