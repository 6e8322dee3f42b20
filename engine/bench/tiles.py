"""Which tiles stream a decode step's weights fastest: the expert kernels and the skinny projections, on
weights read from HBM (a part of the engine, not the engine: `bench model` times the whole step), and whether the
DeltaNet rule's tiles and where its gated norm runs, on states read from HBM.

    python -m engine.bench.tiles [--copies 8] [--batch 1,8] [--only experts|projections|rule] [--json out.json]

Every candidate runs inside a CUDA graph over `--copies` distinct weight sets (different layers' experts,
different projection matrices), so each replay reads its bytes from HBM, not from the 50 MB L2 that a
repeated launch on one tensor would hit (Triton's autotuner times that way, and its picks ran slower in
the real step: docs/PERF.md, issue 20). Rates are bytes of weights read per second; beside them the
device-to-device copy rate measured in the same process. Shapes are Qwen3.6-35B-A3B's (hidden 2048, 256
experts top-8 + shared of width 512; out / o 4096 -> 2048; DeltaNet in 2048 -> 12352; attention q|k|v
2048 -> 9216; router 2048 -> 257; lm_head 2048 -> 248,320).
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

H, I, E, TOP_K = 2048, 512, 256, 8
PROJECTIONS = (("out/o", 2048, 4096), ("deltanet in", 12352, 2048), ("attn q|k|v", 9216, 2048),
               ("router", 257, 2048), ("lm_head", 248320, 2048))
# skinny calls of each projection a decode step of the 40-layer model makes (30 DeltaNet layers, 10 attention, one
# head; the router runs in the add + norm launch before it): how a width class's candidates are weighed
STEP_CALLS = {"out/o": 40, "deltanet in": 30, "attn q|k|v": 10, "lm_head": 1}
# (BN, BK, warps, stages)
UP_TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4),
            (16, 128, 4, 4), (16, 256, 4, 4), (16, 256, 4, 5), (16, 512, 4, 3), (32, 128, 8, 5), (64, 256, 8, 3)]
DOWN_TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 2), (32, 512, 4, 1),
              (16, 128, 4, 4), (16, 256, 4, 2), (16, 512, 4, 1), (64, 256, 4, 2), (128, 128, 4, 3)]
SKINNY_TILES = [(16, 256, 4, 4), (16, 128, 4, 6), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3),
                (64, 128, 4, 4), (32, 256, 8, 4), (32, 64, 4, 6), (32, 128, 4, 6), (64, 64, 4, 6), (64, 128, 8, 3),
                (16, 128, 2, 6), (16, 256, 2, 4)]


def graph_us(fn, reps: int = 25) -> float:
    """Median microseconds of one replay of a graph that calls fn once (after two direct warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def _routes(batch: int, copies: int, gen: torch.Generator, device) -> list[torch.Tensor]:
    """Per copy: ids [batch, K+1] (K distinct routed experts, then the shared one, E)."""
    out = []
    for _ in range(copies):
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(batch)])
        out.append(torch.cat([ids, torch.full((batch, 1), E)], 1).int().to(device))
    return out


def sweep_experts(batches: list[int], copies: int, device) -> list[dict]:
    from engine.kernels.moe_pairs_triton import blocks_for, pair_blocks
    from engine.kernels.moe_triton import _tiles, run_experts, run_experts_routed

    gen = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(E + 1, 2 * I, H, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    down = [torch.randn(E + 1, H, I, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    rows = []
    for batch in batches:
        x = torch.randn(batch, H, device=device, dtype=torch.bfloat16)
        ids = _routes(batch, copies, gen, device)
        w = [torch.rand(batch, TOP_K + 1, device=device) for _ in range(copies)]
        blocks = [blocks_for(t, E + 1) for t in ids]  # as the decode step maps them (each expert read once)
        outs = [(torch.empty(t.numel(), I, device=device, dtype=torch.bfloat16),
                 torch.empty(batch, TOP_K + 1, H, device=device, dtype=torch.bfloat16)) for t in ids]
        distinct = sum(t.unique().numel() for t in ids) / copies
        nbytes = distinct * 3 * I * H * 2

        def layer_us(tiles, mapping=blocks):
            def run():
                for c in range(copies):
                    run_experts(x, gate_up[c], down[c], ids[c], w[c], mapping[c], out=outs[c], tiles=tiles)
            return graph_us(run) / copies

        base = (_tiles(16, I, H, up=True), _tiles(16, H, I, up=False))
        best_up, best_us = base[0], layer_us(base)
        rows.append(dict(kind="experts", batch=batch, up=base[0], down=base[1], us=best_us, what="current"))
        if any(b.group for b in blocks):  # the same tiles with every pair reading its expert on its own
            rows.append(dict(kind="experts", batch=batch, up=base[0], down=base[1], what="a block a pair",
                             us=layer_us(base, [pair_blocks(t) for t in ids])))
        # the decode step's MoE as it runs, routing included (inside the gate/up kernel for one token, its own
        # launch before for more), on router logits of the same law (uniform): what the routing costs
        logits = [torch.randn(batch, E + 1, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        valid = torch.ones(batch, dtype=torch.int8, device=device)
        routes = [(torch.empty_like(t), torch.empty(t.shape, device=device)) for t in ids]

        def routed():
            for c in range(copies):
                run_experts_routed(x, gate_up[c], down[c], logits[c], TOP_K, True, True, valid, *routes[c],
                                   out=outs[c])
        rows.append(dict(kind="experts", batch=batch, up=base[0], down=base[1], what="routing too",
                         us=graph_us(routed) / copies))
        for up in UP_TILES:
            us = layer_us((up, base[1]))
            rows.append(dict(kind="experts", batch=batch, up=up, down=base[1], us=us, what="up sweep"))
            if us < best_us:
                best_up, best_us = up, us
        for dn in DOWN_TILES:
            us = layer_us((best_up, dn))
            rows.append(dict(kind="experts", batch=batch, up=best_up, down=dn, us=us, what="down sweep"))
        for r in rows:
            if r["kind"] == "experts" and r["batch"] == batch:
                r["tbs"] = nbytes / r["us"] / 1e6
                r["distinct_experts"] = distinct
    return rows


# DeltaNet decode widths (Qwen3.6-35B-A3B): key / value heads, head dim; the fused projection's width
HK, HV, DH = 16, 32, 128
DELTANET_C, DELTANET_P = 2 * HK * DH + HV * DH, 2 * HK * DH + 2 * HV * DH + 2 * HV


def rule_candidates(dv: int) -> list:
    """RuleTiles to time for heads dv wide: fused in 4, 8 or 16 warps; split in 16-, 32- and 64-column slices
    (narrower than the head) in 2 to 8 warps, the norm in its own launch or in each head's last program."""
    from engine.kernels.deltanet_triton import RuleTiles

    fused = [RuleTiles("fused", dv, w) for w in (4, 8, 16)]
    return fused + [RuleTiles(norm, bv, w) for norm in ("launch", "last") for bv in (16, 32, 64) if bv < dv
                    for w in (2, 4, 8)]


def sweep_rule(batches: list[int], copies: int, device) -> list[dict]:
    """The decode step's DeltaNet rule in each of rule_candidates: fused (rule and gated norm in one program a
    sequence and head) or split (a program a block_v-column slice of each head's state, then gated_norm's launch, or
    the norm in each head's last program), over `copies` layers' states (fp32 [B, Hv, dk, dv] each, read and
    written once a step); the default's row is marked. Rate: state bytes read + written a second."""
    from engine.kernels.deltanet_triton import RuleConsts, rule_step, rule_tiles

    gen = torch.Generator().manual_seed(1)
    consts = [RuleConsts(HK, HV, DH, DH, neg_A=-torch.rand(HV, generator=gen).to(device),
                         dt_bias=torch.randn(HV, generator=gen).to(device),
                         norm_w=(1 + 0.1 * torch.randn(DH, generator=gen)).to(device), eps=1e-6)
              for _ in range(copies)]
    default = rule_tiles(DH)
    rows = []
    for batch in batches:
        states = [torch.randn(batch, HV, DH, DH, device=device) * 0.01 for _ in range(copies)]
        qkv = torch.randn(batch, DELTANET_C, device=device, dtype=torch.bfloat16)
        proj = torch.randn(batch, DELTANET_P, device=device, dtype=torch.bfloat16)
        slots = torch.arange(batch, dtype=torch.int32, device=device)
        outs = [torch.empty(batch, HV * DH, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = 2 * batch * HV * DH * DH * 4
        for tiles in rule_candidates(DH):
            def run(tiles=tiles):
                for c in range(copies):
                    rule_step(qkv, proj, states[c], slots, consts[c], out=outs[c], tiles=tiles)
            us = graph_us(run) / copies
            what = f"{tiles.norm} v{tiles.block_v} w{tiles.warps}"
            rows.append(dict(kind="rule", batch=batch, what=what + (" (default)" if tiles == default else ""),
                             tiles=list(tiles), us=us, tbs=nbytes / us / 1e6))
    return rows


def sweep_projections(batches: list[int], device) -> list[dict]:
    from engine.kernels.linear_triton import skinny_linear

    rows = []
    for name, n, k in PROJECTIONS:
        nbytes = n * k * 2
        copies = max(1, math.ceil(200e6 / nbytes))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for batch in batches:
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            ys = [torch.empty(batch, n, device=device, dtype=torch.bfloat16) for _ in ws]

            def cublas():
                for wc, y in zip(ws, ys):
                    torch.matmul(x, wc.t(), out=y)

            us = graph_us(cublas) / copies
            rows.append(dict(kind="projection", name=name, n=n, k=k, batch=batch, tiles="cublas", us=us,
                             tbs=nbytes / us / 1e6))
            ref = F.linear(x.float(), ws[0].float())
            for tiles in SKINNY_TILES:
                y0 = skinny_linear(x, ws[0], tiles=tiles).float()
                err = float((y0 - ref).norm() / ref.norm())

                def skinny(tiles=tiles):
                    for wc, y in zip(ws, ys):
                        skinny_linear(x, wc, out=y, tiles=tiles)

                us = graph_us(skinny) / copies
                rows.append(dict(kind="projection", name=name, n=n, k=k, batch=batch, tiles=tiles, us=us,
                                 tbs=nbytes / us / 1e6, rel_err=err))
        ws.clear()  # this projection's weights freed before the next one's are made
    return rows


def best_by_class(rows: list[dict], batch: int) -> dict[str, tuple[tuple, float, float]]:
    """Width class (linear_triton.width_class) -> (the skinny tiles with the least microseconds a decode step over
    the class's projections, weighed by STEP_CALLS; those microseconds; the engine's own tiles' microseconds), from
    sweep_projections' rows of one batch size. Torch-free."""
    from engine.kernels.linear_triton import skinny_tiles, width_class

    per: dict[str, dict[tuple, float]] = {}
    for r in rows:
        if r["kind"] != "projection" or r["batch"] != batch or r["tiles"] == "cublas" or not STEP_CALLS.get(r["name"]):
            continue
        cls = per.setdefault(width_class(r["n"]), {})
        cls[tuple(r["tiles"])] = cls.get(tuple(r["tiles"]), 0.0) + STEP_CALLS[r["name"]] * r["us"]
    out = {}
    for cls, by_tiles in per.items():
        best = min(by_tiles, key=by_tiles.get)
        own = next(skinny_tiles(r["n"]) for r in rows if r["kind"] == "projection" and width_class(r["n"]) == cls)
        out[cls] = (best, by_tiles[best], by_tiles.get(tuple(own), float("nan")))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=8, help="distinct expert weight sets (layers) a replay reads")
    p.add_argument("--batch", default="1,8", help="decode batch sizes (rows of x)")
    p.add_argument("--only", choices=("experts", "projections", "rule"), help="sweep one kind of kernel")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench tiles needs a CUDA device")
    from engine.bench.model import hbm_rate

    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    rate = hbm_rate(device)
    kinds = {"projections": lambda: sweep_projections(batches, device),
             "experts": lambda: sweep_experts(batches, args.copies, device),
             "rule": lambda: sweep_rule(batches, args.copies, device)}
    rows = [r for kind, sweep in kinds.items() if args.only in (None, kind) for r in sweep()]
    print(f"HBM copy rate {rate / 1e12:.2f} TB/s (read + write)")
    print(f"{'kind':<11}{'what':<24}{'batch':>6}  {'tiles (BN, BK, warps, stages)':<44}{'us':>8}{'TB/s':>7}")
    for r in rows:
        tiles = f"up {r['up']} down {r['down']}" if r["kind"] == "experts" else str(r.get("tiles", ""))
        what = r.get("what") or r["name"]
        print(f"{r['kind']:<11}{what:<24}{r['batch']:>6}  {tiles:<44}{r['us']:>8.2f}{r['tbs']:>7.2f}")
    for batch in batches:
        for name, *_ in PROJECTIONS if args.only in (None, "projections") else ():
            cand = [r for r in rows if r["kind"] == "projection" and r["name"] == name and r["batch"] == batch]
            best = min(cand, key=lambda r: r["us"])
            cub = next(r for r in cand if r["tiles"] == "cublas")
            print(f"best {name:<12} b{batch}: {best['tiles']} {best['us']:.2f} us vs cublas {cub['us']:.2f}")
        classes = best_by_class(rows, batch)
        if classes:
            print(f"best by width class b{batch} (us a 40-layer step: best / the engine's): " + ", ".join(
                f"{c} {t[1]:.1f} / {t[2]:.1f}" for c, t in classes.items()))
            print("  --skinny-tiles " + "/".join(f"{c}={','.join(map(str, t[0]))}" for c, t in classes.items()))
        rule = [r for r in rows if r["kind"] == "rule" and r["batch"] == batch]
        if rule:
            best = min(rule, key=lambda r: r["us"])
            now = next(r for r in rule if r["what"].endswith("(default)"))
            print(f"best rule b{batch}: {best['what']} {best['us']:.2f} us ({best['tbs']:.2f} TB/s) vs default "
                  f"{now['us']:.2f}")
        exp = [r for r in rows if r["kind"] == "experts" and r["batch"] == batch
               and r["what"] not in ("a block a pair", "routing too")]
        if not exp:
            continue
        best = min(exp, key=lambda r: r["us"])
        print(f"best experts b{batch}: up {best['up']} down {best['down']} {best['us']:.2f} us "
              f"({best['tbs']:.2f} TB/s) vs current {exp[0]['us']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            best = {b: {c: list(t[0]) for c, t in best_by_class(rows, b).items()} for b in batches}
            json.dump({"hbm_copy_tbs": rate / 1e12, "rows": rows, "skinny_best": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
