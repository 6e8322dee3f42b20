"""An expert cache's layer output in one launch: out[t] = sum over k of y[t*K + k] * w[t, k], in fp32, k in order.

compute.combine's arithmetic (the torch reference it is tested against): each product in fp32, summed over k
from 0 up, rounded to y's dtype once. Torch takes five launches for it (two casts, the product, the sum, the
cast back), each queued by the host in every MoE layer call of an expert cache (OffloadBackend.forward), on
CUDA between the layer's experts and the next layer's routing. T = tokens, K = experts per token, H = hidden.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv

BLOCK_H = 512


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # (t * K + k) * H passes 2^31 for long pieces of wide models
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    m = h < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += tl.load(y_ptr + (t * K + k) * H + h, mask=m, other=0.0).to(tl.float32) * w
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_rows(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [T*K, H] (contiguous), w [T, K] -> [T, H] in y's dtype."""
    T, K = w.shape
    H = y.shape[1]
    if y.shape[0] != T * K or not y.is_contiguous():
        raise ValueError(f"combine_rows: y must be contiguous [{T * K}, H] for w [{T}, {K}], got {tuple(y.shape)}")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T:
        _combine_kernel[(T, cdiv(H, BLOCK_H))](y, w.contiguous(), out, H, K=K, BH=BLOCK_H, num_warps=4)
    return out
