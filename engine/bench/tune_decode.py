"""Speed of the decode step's memory-bound kernels at the Qwen3.6-35B-A3B widths (CUDA), in GB/s against
the device-to-device copy rate: cuBLAS and linear_skinny on each projection shape, the fused gated-norm
out projection, and the (autotuned) grouped expert kernels at batch 1 and 8 and a 2048-token prefill.

    python -m engine.bench.tune_decode [--json out.json]

Weights rotate through copies larger than L2, so every timing streams from HBM.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

H, E, K, I, HV, DV = 2048, 257, 9, 512, 32, 128
PROJ = {"deltanet_in": (12352, 2048), "attn_qkv": (9216, 2048), "out_proj": (2048, 4096), "router": (257, 2048)}


def timed(fn, nbytes: int) -> float:
    from triton.testing import do_bench

    return nbytes / (do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3) / 1e9


def rotating(shape, nbytes_each: int) -> itertools.cycle:
    copies = max(2, (256 << 20) // nbytes_each)
    return itertools.cycle([torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)])


def projections(results: dict) -> None:
    from engine.kernels.gemv_triton import gated_out_proj, linear_skinny

    for (name, (n, k)), m in itertools.product(PROJ.items(), (1, 8)):
        ws = rotating((n, k), n * k * 2)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"cublas": timed(lambda: F.linear(x, next(ws)), n * k * 2)}
        for bn, bk in itertools.product((8, 16, 32, 64), (256, 512)):
            row[f"skinny bn{bn} bk{bk}"] = timed(lambda: linear_skinny(x, next(ws), bn, bk), n * k * 2)
        results[f"{name} M={m}"] = row
    for m in (1, 8):
        ws = rotating((H, HV * DV), H * HV * DV * 2)
        o = torch.randn(m, HV * DV, device="cuda")
        proj = torch.randn(m, 12352, device="cuda", dtype=torch.bfloat16)
        nw = torch.ones(DV, device="cuda", dtype=torch.bfloat16)
        results[f"gated_out_proj M={m}"] = {"fused": timed(lambda: gated_out_proj(o, proj, 8192, nw, 1e-6, next(ws)),
                                                           H * HV * DV * 2)}


def experts(results: dict) -> None:
    from engine.kernels.moe_triton import expert_blocks, pair_blocks, route_topk, run_experts

    gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    for tokens in (1, 8, 2048):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids, w = route_topk(torch.randn(tokens, E, device="cuda"), K - 1, True, True)
        blocks = pair_blocks(ids) if tokens * K < 128 else expert_blocks(ids, E, 64)
        nbytes = int(torch.unique(ids).numel()) * 3 * I * H * 2
        results[f"experts tokens={tokens}"] = {"autotuned": timed(lambda: run_experts(x, gu, dn, ids, w, blocks), nbytes)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.tune_decode")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from engine.bench.model import hbm_rate

    copy = hbm_rate(torch.device("cuda")) / 1e9
    results: dict = {"copy_gbs": copy}
    projections(results)
    experts(results)
    print(f"device-to-device copy {copy:.0f} GB/s")
    for name, row in results.items():
        if not isinstance(row, dict):
            continue
        best = sorted(row, key=lambda k: -row[k])[:3]
        print(f"{name:<26}" + "; ".join(f"{k} {row[k]:.0f} GB/s ({row[k] / copy:.2f})" for k in best)
              + (f"; cublas {row['cublas']:.0f}" if "cublas" in row and "cublas" not in best else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
