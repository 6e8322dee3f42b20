"""y = x @ W^T for a few rows of x (a decode step's projections): each program streams BN rows of W once.

    y = linear_skinny(x, w)                                   # x [M, K] (M <= 16), w [N, K] -> [M, N]
    y = gated_out_proj(o, proj, z_off, norm_w, eps, w_out)    # DeltaNet's gated RMSNorm + out_proj in one


cuBLAS picks split-K GEMV kernels for these shapes that leave much of the memory bandwidth unused on
some of them (a 2048 x 4096 output projection ran at under half the copy rate); here every program owns a
disjoint slice of W's rows, so no reduction pass follows. Reference: F.linear.
M = rows of x, N = output features, K = input features.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_y,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    mm = m < M
    nm = n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def linear_skinny(x: torch.Tensor, w: torch.Tensor, bn: int = 32, bk: int = 256, warps: int = 4,
                  stages: int = 3) -> torch.Tensor:
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K or M > 16 or x.stride(1) != 1 or not w.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"linear_skinny wants x [M<=16, K] (unit column stride) and a contiguous w [N, K] of "
                         f"its dtype; got {tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    _skinny_kernel[(triton.cdiv(N, bn),)](x, w, y, M, N, K, x.stride(0), y.stride(0), BM=16, BN=bn,
                                          BK=min(bk, triton.next_power_of_2(K)), PREC=prec, num_warps=warps,
                                          num_stages=stages)
    return y


def _out_configs():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BN": 16}, num_warps=4)]
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st) for bn in (8, 16, 32) for w in (2, 4)
            for st in (3, 4)]


@triton.autotune(configs=_out_configs(), key=["M", "N", "K"])
@triton.jit
def _gated_out_kernel(o_ptr, z_ptr, z_stride, nw_ptr, w_ptr, y_ptr, M, N, K, eps,
                      DV: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    # K is the value heads' width Hv*dv; each K tile is one head, normalised in registers before the dot
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    mm = m < M
    nm = n < N
    d = tl.arange(0, DV)
    dt = y_ptr.dtype.element_ty
    nw = tl.load(nw_ptr + d).to(tl.float32)
    acc = tl.zeros([16, BN], dtype=tl.float32)
    for k0 in range(0, K, DV):
        kk = k0 + d
        o = tl.load(o_ptr + m[:, None] * K + kk[None, :], mask=mm[:, None], other=0.0).to(dt).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / DV + eps)
        y = (o * inv[:, None]).to(dt).to(tl.float32) * nw[None, :]
        z = tl.load(z_ptr + m[:, None] * z_stride + kk[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        x = (y * z / (1.0 + tl.exp(-z))).to(dt)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nm[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(dt), mask=mm[:, None] & nm[None, :])


def gated_out_proj(o: torch.Tensor, proj: torch.Tensor, z_off: int, norm_w: torch.Tensor, eps: float,
                   w_out: torch.Tensor) -> torch.Tensor:
    """o [M, Hv*dv] fp32 (the delta rule's output), gate z = proj[:, z_off : z_off + Hv*dv], norm_w [dv],
    w_out [H, Hv*dv] -> out_proj(gated_rms_norm(o, z)) [M, H] in w_out's dtype."""
    M, K = o.shape
    N, Kw = w_out.shape
    DV = norm_w.shape[0]
    if Kw != K or K % DV or M > 16 or not o.is_contiguous() or proj.stride(1) != 1 or not w_out.is_contiguous():
        raise ValueError(f"gated_out_proj: o {tuple(o.shape)}, norm {DV}, w_out {tuple(w_out.shape)} do not fit")
    y = torch.empty(M, N, dtype=w_out.dtype, device=o.device)
    prec = "ieee" if w_out.dtype == torch.float32 else "tf32"
    _gated_out_kernel[lambda meta: (triton.cdiv(N, meta["BN"]),)](
        o, proj[:, z_off:], proj.stride(0), norm_w, w_out, y, M, N, K, eps, DV=DV, PREC=prec)
    return y
