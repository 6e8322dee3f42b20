"""Skinny matrix products for decode steps: y = x @ w.T with a handful of rows in x, bound by reading w.

    y = skinny_linear(x, w)          # x [M, K], w [N, K] -> y [M, N] in x's dtype, M <= SKINNY_ROWS

One program per BN rows of w reads them once, front to back in BK-wide tiles, against all M rows of x
(padded to 16, the matrix units' smallest tile); fp32 accumulation, one rounding at the store. No split
over K: each output is summed in one fixed order, so a graph replay and a direct launch agree to the bit.
cuBLAS picks split-K plus a separate reduce for the decode step's out / o projections (K 4096 -> N 2048),
two launches at 1.9 TB/s (docs/PERF.md, issue 20); engine/models/fast.py sends every decode projection
here. M = rows of x, K = input width, N = output width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2, pdl_args, pdl_enter

SKINNY_ROWS = 16


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        xa = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(xa, tl.trans(w), input_precision=PREC)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


# (BN, BK, warps, stages) for 16-bit weights by output width, from `python -m engine.bench.tiles` on the H200
# (weights read from HBM, docs/PERF.md issue 20): outputs of a few thousand (out / o, 4096 -> 2048) read best in
# 16-row tiles of 512 (8.7 us, cuBLAS 9.0); wide ones (DeltaNet in 12,352, q|k|v 9,216) and the vocabulary's
# (the lm_head) in 32-row tiles of 128 (15.8 / 13.0 / 233.6 us against cuBLAS's 17.0 / 13.0 / 242.6); on an H100
# the best of 13 candidates was within 2% of these in every class (the lm_head at 3.11 TB/s)
SKINNY_TILES = {"narrow": (16, 512, 4, 3), "wide": (32, 128, 4, 4), "head": (32, 128, 4, 4)}
_CHOSEN: dict = {}  # set_skinny_tiles' choice


def width_class(n: int) -> str:
    """SKINNY_TILES' key for an output of width n: narrow up to 4,096, head past 65,536 (a vocabulary)."""
    return "narrow" if n <= 4096 else "wide" if n <= 65536 else "head"


def set_skinny_tiles(tiles: dict | None) -> None:
    """Width class -> (BN, BK, warps, stages) for every skinny product from now on, the others as SKINNY_TILES
    (None: all of them as SKINNY_TILES again); `killick bench model --skinny-tiles` times the whole step so."""
    if tiles is not None and not set(tiles) <= set(SKINNY_TILES):
        raise ValueError(f"set_skinny_tiles: width classes are {', '.join(SKINNY_TILES)}, got {', '.join(tiles)}")
    _CHOSEN.clear()
    _CHOSEN.update({k: tuple(v) for k, v in (tiles or {}).items()})


def skinny_tiles(n: int) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) of an output n wide: set_skinny_tiles' choice for its class, else SKINNY_TILES'."""
    c = width_class(n)
    return _CHOSEN.get(c, SKINNY_TILES[c])


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  tiles: tuple[int, int, int, int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= SKINNY_ROWS), w [N, K], both contiguous and of one dtype -> [M, N] in `dtype`
    (default x's; float32 keeps the fp32 sums unrounded, as logits want)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit together")
    M, K = x.shape
    N = w.shape[0]
    if M > SKINNY_ROWS:
        raise ValueError(f"skinny_linear takes at most {SKINNY_ROWS} rows, got {M}: use F.linear")
    if not (x.is_contiguous() and w.is_contiguous()) or x.dtype != w.dtype:
        raise ValueError("skinny_linear wants contiguous x and w of one dtype")
    y = out if out is not None else torch.empty(M, N, dtype=dtype or x.dtype, device=x.device)
    bn, bk, warps, stages = tiles or skinny_tiles(N)
    bk = min(bk, next_pow2(K))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exact; 16-bit inputs ignore it
    _skinny_kernel[(cdiv(N, bn),)](x, w, y, M, N, K, BM=SKINNY_ROWS, BN=bn, BK=bk, PREC=prec, num_warps=warps,
                                          num_stages=stages, **pdl_args(x))
    return y
