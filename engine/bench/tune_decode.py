"""Tile sweep for the decode step's memory-bound kernels at the Qwen3.6-35B-A3B widths (CUDA).

    python -m engine.bench.tune_decode [--json out.json]

Projections: cuBLAS (F.linear) against linear_skinny's tiles; experts: run_experts' up and down tiles for
decode (pair blocks, batch 1 and 8) and prefill (expert blocks, 2048 tokens). Weights rotate through
copies larger than L2 so every timing streams from HBM. Prints GB/s per variant and the best of each.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

H, E, K, I = 2048, 257, 9, 512
PROJ = {"deltanet_in": (12352, 2048), "attn_qkv": (9216, 2048), "out_proj": (2048, 4096), "router": (257, 2048)}


def timed(fn, nbytes: int) -> float:
    from triton.testing import do_bench

    return nbytes / (do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3) / 1e9


def sweep_projections(results: dict) -> None:
    from engine.kernels.gemv_triton import linear_skinny

    for (name, (n, k)), m in itertools.product(PROJ.items(), (1, 8)):
        copies = max(2, (256 << 20) // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        it = itertools.cycle(ws)
        row = {"cublas": timed(lambda: F.linear(x, next(it)), n * k * 2)}
        for bn, bk, warps in itertools.product((8, 16, 32, 64), (256, 512), (4,)):
            try:
                row[f"skinny bn{bn} bk{bk} w{warps}"] = timed(lambda: linear_skinny(x, next(it), bn, bk, warps), n * k * 2)
            except Exception as e:  # a tile that does not compile for this shape
                row[f"skinny bn{bn} bk{bk} w{warps}"] = f"error: {type(e).__name__}"
        results[f"{name} M={m}"] = row
        del ws


def sweep_experts(results: dict) -> None:
    from engine.kernels.moe_triton import expert_blocks, pair_blocks, route_topk, run_experts

    gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    ups = [(bn, bk, w, 3) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)]
    downs = [(bn, bk, w, 3) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)]
    for tokens in (1, 8, 2048):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, E, device="cuda")
        ids, w = route_topk(logits, K - 1, True, True)
        blocks = pair_blocks(ids) if tokens < 16 else expert_blocks(ids, E, 64)
        distinct = int(torch.unique(ids).numel())
        up_bytes, down_bytes = distinct * 2 * I * H * 2, distinct * H * I * 2
        base = (ups[0], downs[0])
        row = {}
        for up in ups:
            row[f"up {up}"] = timed(lambda: run_experts(x, gu, dn, ids, w, blocks, tiles=(up, base[1])),
                                    up_bytes + down_bytes)
        best_up = max((k for k in row if k.startswith("up")), key=lambda k: row[k])
        up_cfg = eval(best_up[3:])  # noqa: S307 - our own key text
        for down in downs:
            row[f"down {down}"] = timed(lambda: run_experts(x, gu, dn, ids, w, blocks, tiles=(up_cfg, down)),
                                        up_bytes + down_bytes)
        row["default"] = timed(lambda: run_experts(x, gu, dn, ids, w, blocks), up_bytes + down_bytes)
        results[f"experts tokens={tokens}"] = row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.tune_decode")
    p.add_argument("--json")
    p.add_argument("--only", choices=["projections", "experts"])
    args = p.parse_args(argv)
    results: dict = {}
    if args.only != "experts":
        sweep_projections(results)
    if args.only != "projections":
        sweep_experts(results)
    for name, row in results.items():
        nums = {k: v for k, v in row.items() if isinstance(v, float)}
        best = sorted(nums, key=lambda k: -nums[k])[:3]
        ref = row.get("cublas", row.get("default"))
        print(f"{name:<24} reference {ref:7.0f} GB/s; best " + "; ".join(f"{k} {nums[k]:.0f}" for k in best))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
