"""A prompt's DeltaNet conv and gates, one launch each: what the eager layer does in a dozen torch ops.

    out = conv_prefill(x, conv_state, conv_w)      # x [T, C] -> silu(causal depthwise conv) [T, C]
    beta, g = prefill_gates(proj, b_off, a_off, neg_A, dt_bias)     # GatedDeltaNet.gates of proj's b, a columns

The eager layer (engine/layers/deltanet.py GatedDeltaNet._conv) builds the windows with a concatenation, an
unfold, a product and a sum, then a silu and a transpose that the split heads copy back: about eight launches
the host queues in each DeltaNet layer of an extend, between two MoE layer calls (FastPath hands this kernel to
the layer instead). Programs tile (tokens, channels); an output at step t reads inputs t-K+1..t, those before
the sequence from the state. The program of the first token block, the only one that reads the state, then
writes the new one: the last K-1 inputs of state and x together. Products and sums in fp32, as conv_step (the
decode step's kernel) does. T = tokens, C = conv channels, K = conv width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2

BLOCK_T, BLOCK_C = 32, 128


@triton.jit
def _conv_prefill_kernel(x_ptr, x_stride, state_ptr, w_ptr, out_ptr, T, C,
                         KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr):
    pt = tl.program_id(0)
    t = (pt * BT + tl.arange(0, BT)).to(tl.int64)  # row offsets t * x_stride pass 2^31 for long pieces
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(KW):
        s = t - (KW - 1) + j  # the input step output t reads at tap j; before 0: the state's column K-1+s
        xv = tl.load(x_ptr + s[:, None] * x_stride + c[None, :], mask=(tm & (s >= 0))[:, None] & cm[None, :],
                     other=0.0)
        sv = tl.load(state_ptr + c[None, :] * (KW - 1) + (KW - 1 + s)[:, None],
                     mask=(tm & (s < 0))[:, None] & cm[None, :], other=0.0)
        w = tl.load(w_ptr + c * KW + j, mask=cm, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * C + c[None, :], y.to(out_ptr.dtype.element_ty), mask=tm[:, None] & cm[None, :])
    if pt == 0:
        i = tl.arange(0, BW)
        im = i < KW - 1
        src = (T - (KW - 1) + i).to(tl.int64)  # the input step that becomes state column i
        x_tail = tl.load(x_ptr + src[None, :] * x_stride + c[:, None], mask=cm[:, None] & (im & (src >= 0))[None, :],
                     other=0.0)
        s_tail = tl.load(state_ptr + c[:, None] * (KW - 1) + (KW - 1 + src)[None, :],
                     mask=cm[:, None] & (im & (src < 0))[None, :], other=0.0)
        new = tl.where((src >= 0)[None, :], x_tail.to(state_ptr.dtype.element_ty), s_tail)
        tl.debug_barrier()  # every thread's reads of the old state above come before any write
        tl.store(state_ptr + c[:, None] * (KW - 1) + i[None, :], new, mask=cm[:, None] & im[None, :])


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor) -> torch.Tensor:
    """x [T, C] one sequence's conv inputs (row stride free, unit column stride); conv_state [C, K-1]
    (contiguous, x's dtype), left holding the last K-1 inputs; conv_w [C, K] -> silu(conv) [T, C] in x's dtype,
    contiguous (its column slices reshape into heads without a copy)."""
    T, C = x.shape
    km1 = conv_state.shape[1]
    if conv_w.shape != (C, km1 + 1) or conv_state.shape[0] != C or x.stride(1) != 1:
        raise ValueError(f"conv_prefill: x {tuple(x.shape)}, state {tuple(conv_state.shape)} and conv_w "
                         f"{tuple(conv_w.shape)} must agree on C and K, x with unit column stride")
    if km1 > BLOCK_T:  # the first token block must hold every output that reads the state
        raise ValueError(f"conv_prefill: conv width {km1 + 1} is wider than {BLOCK_T + 1}")
    if not conv_state.is_contiguous() or conv_state.dtype != x.dtype:
        raise ValueError("conv_prefill: the conv state must be contiguous, in x's dtype")
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    grid = (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C))
    _conv_prefill_kernel[grid](x, x.stride(0), conv_state, conv_w.contiguous(), out, T, C, KW=km1 + 1,
                               BT=BLOCK_T, BC=BLOCK_C, BW=next_pow2(max(km1, 2)), num_warps=4)
    return out


@triton.jit
def _gates_kernel(proj_ptr, proj_stride, b_off, a_off, nega_ptr, dtb_ptr, beta_ptr, g_ptr, T, HV,
                  BT: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.arange(0, BH)
    m = (t < T)[:, None] & (h < HV)[None, :]
    row = proj_ptr + t[:, None] * proj_stride
    b = tl.load(row + b_off + h[None, :], mask=m, other=0.0).to(tl.float32)
    a = tl.load(row + a_off + h[None, :], mask=m, other=0.0).to(tl.float32)
    a = a + tl.load(dtb_ptr + h, mask=h < HV, other=0.0).to(tl.float32)[None, :]
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's softplus (threshold 20)
    g = tl.load(nega_ptr + h, mask=h < HV, other=0.0)[None, :] * softplus
    at = t[:, None] * HV + h[None, :]
    tl.store(beta_ptr + at, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=m)
    tl.store(g_ptr + at, g, mask=m)


def prefill_gates(proj: torch.Tensor, b_off: int, a_off: int, neg_A: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """proj [T, P] (unit column stride) with b at columns b_off.. and a at a_off.. (Hv each); neg_A [Hv] fp32;
    dt_bias [Hv] -> (beta = sigmoid(b) [T, Hv] in proj's dtype, g = neg_A * softplus(a + dt_bias) [T, Hv] fp32),
    GatedDeltaNet.gates' arithmetic (the decode rule's too)."""
    T, Hv = proj.shape[0], neg_A.shape[0]
    if proj.stride(1) != 1 or proj.shape[1] < max(b_off, a_off) + Hv or neg_A.dtype != torch.float32:
        raise ValueError(f"prefill_gates: proj {tuple(proj.shape)} must hold b at {b_off} and a at {a_off} "
                         f"({Hv} columns each, unit column stride), neg_A fp32")
    beta = torch.empty(T, Hv, dtype=proj.dtype, device=proj.device)
    g = torch.empty(T, Hv, dtype=torch.float32, device=proj.device)
    if T:
        bt = 32
        _gates_kernel[(cdiv(T, bt),)](proj, proj.stride(0), b_off, a_off, neg_A.contiguous(), dt_bias, beta,
                                             g, T, Hv, BT=bt, BH=next_pow2(Hv), num_warps=4)
    return beta, g
