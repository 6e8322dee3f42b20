"""y = x @ W^T for a few rows of x (a decode step's projections): each program streams BN rows of W once.

    y = linear_skinny(x, w)     # x [M, K] (M <= 16), w [N, K] -> [M, N] in x's dtype

cuBLAS picks split-K GEMV kernels for these shapes that leave much of the memory bandwidth unused on
some of them (a 2048 x 4096 output projection ran at under half the copy rate); here every program owns a
disjoint slice of W's rows, so no reduction pass follows. Reference: F.linear.
M = rows of x, N = output features, K = input features.
"""
from __future__ import annotations

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
