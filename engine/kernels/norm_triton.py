"""Residual add + RMSNorm in one pass: the seam between every two blocks of a decoder layer.

    x_out, h = add_rms_norm(x, delta, weight, eps, zero_centered)
    x [N, H]; delta None, [N, H] or [N, R, H] (R rows summed first: the MoE's per-expert outputs);
    x_out = x + sum_r delta[:, r]  (rounded to x's dtype, as the residual stream is);  h = rms_norm(x_out).

Statistics and the sum in fp32, one rounding at the end. Reference: add_rms_norm_ref below, which is the
eager path's arithmetic (engine/layers/norm.py). N = tokens, H = hidden, R = rows summed into x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.norm import rms_norm


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, eps, H,
                         R: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_DELTA: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_DELTA:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(R):  # unrolled: the R row loads are in flight together
            acc += tl.load(d_ptr + (row * R + r) * H + cols, mask=live, other=0.0).to(tl.float32)
        x = (x + acc).to(xo_ptr.dtype.element_ty).to(tl.float32)
        tl.store(xo_ptr + row * H + cols, x.to(xo_ptr.dtype.element_ty), mask=live)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    tl.store(h_ptr + row * H + cols, (x * inv * w).to(h_ptr.dtype.element_ty), mask=live)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centered: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> (x_out, h); with delta None, x_out is x itself (nothing added). `out` reuses buffers."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"add_rms_norm wants a contiguous [N, H] x, got {tuple(x.shape)}")
    N, H = x.shape
    R = 0
    if delta is not None:
        delta = delta.view(N, -1, H)
        if not delta.is_contiguous() or delta.dtype != x.dtype:
            raise ValueError("add_rms_norm wants delta contiguous and in x's dtype")
        R = delta.shape[1]
    if weight.shape != (H,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {H}")
    x_out, h = out if out is not None else (torch.empty_like(x) if delta is not None else x, torch.empty_like(x))
    _add_rms_norm_kernel[(N,)](x, delta if delta is not None else x, weight, x_out, h, eps, H, R=R,
                               ZERO_CENTERED=zero_centered, HAS_DELTA=delta is not None,
                               BLOCK_H=triton.next_power_of_2(H), num_warps=4 if H <= 2048 else 8)
    return x_out, h


def add_rms_norm_ref(x, delta, weight, eps, zero_centered):
    if delta is not None:
        x = x + delta.view(x.shape[0], -1, x.shape[1]).float().sum(1).to(x.dtype)
    return x, rms_norm(x, weight, eps, zero_centered)
