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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, last_to_finish, next_pow2, pdl_args, pdl_enter, zeroed_counts
from engine.kernels.moe_pairs_triton import _topk_of

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
                               HAS_DELTA=delta is not None, BLOCK_H=next_pow2(H),
                               num_warps=4 if H <= 2048 else 8, **pdl_args(x))
    return x_out, h


def add_rms_norm_ref(x, delta, weight, eps, zero_centered):
    if delta is not None:
        x = x + delta.view(x.shape[0], -1, x.shape[1]).float().sum(1).to(x.dtype)
    return x, rms_norm(x, weight, eps, zero_centered)


@triton.jit
def _add_norm_router_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, gw_ptr, rw_ptr, rstride, lg_ptr, eps, H, E,
                            valid_ptr, ids_ptr, wts_ptr, count_ptr,
                            R: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_H: tl.constexpr,
                            BE: tl.constexpr, GUESS: tl.constexpr, TOPK: tl.constexpr, K: tl.constexpr,
                            KP: tl.constexpr, SHARED: tl.constexpr, NORM_TOPK: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """add_rms_norm_router (GUESS False: the router on h, logits in h's dtype) or add_rms_norm_guess (GUESS:
    the router on the row normed with gw_ptr's weight, in fp32 and not rounded). TOPK (the router's): the
    program that finishes a row's last block of logits (count_ptr [N], back at 0 after) routes the row as
    route_topk would, into ids_ptr / wts_ptr [N, KP]."""
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
        if TOPK:
            if last_to_finish(count_ptr + row, tl.num_programs(1)):  # the row's logits all stored: route it
                routed = E - SHARED
                ecols = tl.arange(0, BLOCK_E)  # (a name of its own: a runtime branch must not reshape `cols`)
                logits = tl.load(lg_ptr + row * E + ecols, mask=ecols < routed, other=float("-inf"),
                                 cache_modifier=".cg")
                two = tl.arange(0, 2)
                gate = tl.sum(tl.load(lg_ptr + row * E + routed + two, mask=two < SHARED, other=0.0,
                                      cache_modifier=".cg").to(tl.float32), axis=0)
                ids, wts = _topk_of(logits, gate, routed, tl.load(valid_ptr + row), K, SHARED, NORM_TOPK, BLOCK_E,
                                    BLOCK_K)
                slots = tl.arange(0, BLOCK_K)
                tl.store(ids_ptr + row * KP + slots, ids, mask=slots < KP)
                tl.store(wts_ptr + row * KP + slots, wts, mask=slots < KP)


class SeamRoute(NamedTuple):
    """The routing add_rms_norm_router does in its launch: route_topk's arguments (the shared expert's gate
    logit, with `shared`, the router's last row) and the [N, KP] int32 ids / fp32 weights it writes."""
    top_k: int
    norm_topk: bool
    shared: bool
    valid: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


def add_rms_norm_router(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered: bool, router_w: torch.Tensor,
                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        route: SeamRoute | None = None):
    """-> (x_out, h, logits [N, E] in x's dtype): add_rms_norm(x, delta, ...) and h @ router_w.T at once; with
    `route`, also route_topk(logits, ...) into route.ids / route.weights (no launch of its own)."""
    delta = _check_rows(x, delta, weight, "add_rms_norm_router")
    N, H = x.shape
    if router_w.dim() != 2 or router_w.shape[1] != H or not router_w.is_contiguous():
        raise ValueError(f"add_rms_norm_router: router {tuple(router_w.shape)} does not match hidden size {H}")
    if route is not None:
        kp = route.top_k + route.shared
        if route.ids.shape != (N, kp) or route.weights.shape != (N, kp) or route.ids.dtype != torch.int32 \
                or route.weights.dtype != torch.float32 or not (route.ids.is_contiguous()
                                                                and route.weights.is_contiguous()) \
                or route.valid.shape != (N,) or not 0 < route.top_k <= router_w.shape[0] - route.shared:
            raise ValueError(f"add_rms_norm_router: the route wants contiguous int32 ids and fp32 weights [{N}, {kp}], "
                             f"valid [{N}] and 0 < top_k <= the routed experts")
    return _router_seam(x, delta, weight, eps, zero_centered, None, router_w, out, route)


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


def _router_seam(x, delta, weight, eps, zero_centered, guess_w, router_w, out, route: SeamRoute | None = None):
    """The launch of both seams, their arguments checked: guess_w None -> the router on h, logits in x's dtype
    (and with route, its top-k); else the guess, in fp32."""
    N, H = x.shape
    E = router_w.shape[0]
    x_out, h, logits = out if out is not None else (
        torch.empty_like(x), torch.empty_like(x),
        torch.empty(N, E, dtype=x.dtype if guess_w is None else torch.float32, device=x.device))
    block_h = next_pow2(H)
    be = max(1, min(16, 8192 // block_h))  # a [BE, H] router tile of at most 8k values per program
    if route is None:
        topk = dict(TOPK=False, K=1, KP=1, SHARED=False, NORM_TOPK=False, BLOCK_E=2, BLOCK_K=2)
        into = (x, x, x, x)  # not read
    else:
        kp = route.top_k + route.shared
        topk = dict(TOPK=True, K=route.top_k, KP=kp, SHARED=route.shared, NORM_TOPK=route.norm_topk,
                    BLOCK_E=next_pow2(E - route.shared), BLOCK_K=next_pow2(max(kp, 2)))
        into = (route.valid, route.ids, route.weights, zeroed_counts("router seam", N, x.device))
    _add_norm_router_kernel[(N, cdiv(E, be))](x, delta, weight, x_out, h,
                                                     weight if guess_w is None else guess_w, router_w,
                                                     router_w.stride(0), logits, eps, H, E, *into, R=delta.shape[1],
                                                     ZERO_CENTERED=zero_centered, BLOCK_H=block_h, BE=be,
                                                     GUESS=guess_w is not None, **topk, num_warps=4, **pdl_args(x))
    return x_out, h, logits
