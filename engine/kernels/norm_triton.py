"""Residual add + RMSNorm in one pass: the seam between every two blocks of a decoder layer.

    x_out, h = add_rms_norm(x, delta, weight, eps, zero_centered)
    x [N, H]; delta None, [N, H] or [N, R, H] (R rows summed first: the MoE's per-expert outputs);
    x_out = x + sum_r delta[:, r]  (rounded to x's dtype, as the residual stream is);  h = rms_norm(x_out).

Statistics and the sum in fp32, one rounding at the end. Reference: add_rms_norm_ref below, which is the
eager path's arithmetic (engine/layers/norm.py). N = tokens, H = hidden, R = rows summed into x.

    x_out, h, logits = add_rms_norm_router(x, delta, weight, eps, zero_centered, router_w)

The decode step's seam before a MoE block: the same add + norm, and the router's logits h @ router_w.T
[N, E] in the same launch (each program normalises its token's row again and takes BE router rows), so
the router costs no launch of its own. E = router rows.

    x_out, h, guess = add_rms_norm_guess(x, delta, weight, eps, zero_centered, guess_w, router_w)

The seam after a MoE block, where the next layer's experts are prefetched (engine/experts/mapped.py): the
same add + norm, and in the same launch the next layer's guess, router_w @ rms_norm(x_out, guess_w) in fp32
(the normed row not rounded; guess_w is that layer's post-attention norm): the guess is ready when the seam
is. As a launch of its own on the guess stream it waited 10-14 us for SMs behind the next layer's input
projection, and the PCIe link idled meanwhile (H200 box, docs/PERF.md twenty-third session).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_args, pdl_enter

from engine.layers.norm import rms_norm


@triton.jit
def _add_norm_row(x_ptr, d_ptr, w_ptr, xo_ptr, eps, row, H, cols, live,
                  R: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's row -> (x, y) fp32: x plus its R delta rows rounded to the residual's dtype, and
    rms_norm(x) * weight before its rounding. Both kernels below store from here: one arithmetic."""
    x = tl.load(x_ptr + row * H + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_DELTA:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(R):  # unrolled: the R row loads are in flight together
            acc += tl.load(d_ptr + (row * R + r) * H + cols, mask=live, other=0.0).to(tl.float32)
        x = (x + acc).to(xo_ptr.dtype.element_ty).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return x, x * inv * w


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, eps, H,
                         R: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_DELTA: tl.constexpr,
                         BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    x, y = _add_norm_row(x_ptr, d_ptr, w_ptr, xo_ptr, eps, row, H, cols, live, R, ZERO_CENTERED, HAS_DELTA,
                         BLOCK_H)
    if HAS_DELTA:
        tl.store(xo_ptr + row * H + cols, x.to(xo_ptr.dtype.element_ty), mask=live)
    tl.store(h_ptr + row * H + cols, y.to(h_ptr.dtype.element_ty), mask=live)


def _check_rows(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, who: str):
    """-> delta as [N, R, H] (or None), after checking x, delta and the norm weight fit together."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{who} wants a contiguous [N, H] x, got {tuple(x.shape)}")
    N, H = x.shape
    if delta is not None:
        delta = delta.view(N, -1, H)
        if not delta.is_contiguous() or delta.dtype != x.dtype:
            raise ValueError(f"{who} wants delta contiguous and in x's dtype")
    if weight.shape != (H,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {H}")
    return delta


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centered: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> (x_out, h); with delta None, x_out is x itself (nothing added). `out` reuses buffers."""
    delta = _check_rows(x, delta, weight, "add_rms_norm")
    N, H = x.shape
    x_out, h = out if out is not None else (torch.empty_like(x) if delta is not None else x, torch.empty_like(x))
    _add_rms_norm_kernel[(N,)](x, delta if delta is not None else x, weight, x_out, h, eps, H,
                               R=0 if delta is None else delta.shape[1], ZERO_CENTERED=zero_centered,
                               HAS_DELTA=delta is not None, BLOCK_H=triton.next_power_of_2(H),
                               num_warps=4 if H <= 2048 else 8, **pdl_args(x))
    return x_out, h


def add_rms_norm_ref(x, delta, weight, eps, zero_centered):
    if delta is not None:
        x = x + delta.view(x.shape[0], -1, x.shape[1]).float().sum(1).to(x.dtype)
    return x, rms_norm(x, weight, eps, zero_centered)


@triton.jit
def _add_norm_router_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, gw_ptr, rw_ptr, rstride, lg_ptr, eps, H, E,
                            R: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_H: tl.constexpr,
                            BE: tl.constexpr, GUESS: tl.constexpr, PDL: tl.constexpr):
    """add_rms_norm_router (GUESS False: the router on h, logits in h's dtype) or add_rms_norm_guess (GUESS:
    the router on the row normed with gw_ptr's weight, in fp32 and not rounded)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    re = blk * BE + tl.arange(0, BE)
    # the router's rows before the wait: weights, which no kernel writes, so their reads need not wait for the
    # predecessor (H200 box: the kernel's time after the out projection 3.8 -> 2.4 us, docs/PERF.md)
    rw = tl.load(rw_ptr + re[:, None] * rstride + cols[None, :], mask=(re < E)[:, None] & live[None, :], other=0.0)
    if GUESS:
        gw = tl.load(gw_ptr + cols, mask=live, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            gw = gw + 1.0
    pdl_enter(PDL)
    x, y = _add_norm_row(x_ptr, d_ptr, w_ptr, xo_ptr, eps, row, H, cols, live, R, ZERO_CENTERED, True, BLOCK_H)
    h = y.to(h_ptr.dtype.element_ty)
    if blk == 0:
        tl.store(xo_ptr + row * H + cols, x.to(xo_ptr.dtype.element_ty), mask=live)
        tl.store(h_ptr + row * H + cols, h, mask=live)
    if GUESS:
        g = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)) * gw
        tl.store(lg_ptr + row * E + re, tl.sum(rw.to(tl.float32) * g[None, :], axis=1), mask=re < E)
    else:
        logit = tl.sum(rw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        tl.store(lg_ptr + row * E + re, logit.to(lg_ptr.dtype.element_ty), mask=re < E)


def add_rms_norm_router(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered: bool, router_w: torch.Tensor,
                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """-> (x_out, h, logits [N, E] in x's dtype): add_rms_norm(x, delta, ...) and h @ router_w.T at once."""
    delta = _check_rows(x, delta, weight, "add_rms_norm_router")
    H = x.shape[1]
    if router_w.dim() != 2 or router_w.shape[1] != H or not router_w.is_contiguous():
        raise ValueError(f"add_rms_norm_router: router {tuple(router_w.shape)} does not match hidden size {H}")
    return _router_seam(x, delta, weight, eps, zero_centered, None, router_w, out)


def add_rms_norm_guess(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool, guess_w: torch.Tensor, router_w: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """-> (x_out, h, guess [N, E] fp32): add_rms_norm(x, delta, weight, ...) and router_w @ rms_norm(x_out,
    guess_w) at once; router_w [E, H] may be a row slice (unit column stride)."""
    delta = _check_rows(x, delta, weight, "add_rms_norm_guess")
    H = x.shape[1]
    if router_w.dim() != 2 or router_w.shape[1] != H or router_w.stride(1) != 1 or guess_w.shape != (H,):
        raise ValueError(f"add_rms_norm_guess: router {tuple(router_w.shape)} or guess norm "
                         f"{tuple(guess_w.shape)} does not match hidden size {H}")
    return _router_seam(x, delta, weight, eps, zero_centered, guess_w, router_w, out)


def _router_seam(x, delta, weight, eps, zero_centered, guess_w, router_w, out):
    """The launch of both seams, their arguments checked: guess_w None -> the router on h, logits in x's dtype;
    else the guess, in fp32."""
    N, H = x.shape
    E = router_w.shape[0]
    x_out, h, logits = out if out is not None else (
        torch.empty_like(x), torch.empty_like(x),
        torch.empty(N, E, dtype=x.dtype if guess_w is None else torch.float32, device=x.device))
    block_h = triton.next_power_of_2(H)
    be = max(1, min(16, 8192 // block_h))  # a [BE, H] router tile of at most 8k values per program
    _add_norm_router_kernel[(N, triton.cdiv(E, be))](x, delta, weight, x_out, h,
                                                     weight if guess_w is None else guess_w, router_w,
                                                     router_w.stride(0), logits, eps, H, E, R=delta.shape[1],
                                                     ZERO_CENTERED=zero_centered, BLOCK_H=block_h, BE=be,
                                                     GUESS=guess_w is not None, num_warps=4, **pdl_args(x))
    return x_out, h, logits
