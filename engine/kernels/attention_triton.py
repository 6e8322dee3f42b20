"""Gated full attention over KV slabs: per-token q/k norm + RoPE + KV store, decode (split over the keys,
then combined) and prefill (flash, causal from each sequence's cached length).

    qk_rope_store(proj, q, k_slab, v_slab, slots, positions, consts)   q [N, h, D]; K/V written at (slot, pos)
    decode_attention(q, proj, k_slab, v_slab, slots, positions, consts) -> [B, h*D]   (one new token each)
    prefill_attention(q, proj, k_slab, v_slab, tiles, consts) -> [N, h*D]             (tiles: prefill_tiles)

proj [N, P] is the fused q|k|v projection: q heads first ([q_h, gate_h] per head when gated, else q_h),
then k heads, then v heads. Slabs are [S, kv, cap, D] per layer; a token at position p of the sequence in
slot s has its key at k_slab[s, :, p]. The output gate sigmoid(gate) is applied here; o_proj is the
caller's. Arithmetic: the eager path's (engine/layers/attention.py), references *_ref below.
N = tokens, B = sequences, h / kv = query / KV heads, G = h / kv, D = head dim, R = rotary dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2, pdl_args, pdl_enter

from engine.layers.attention import attend_reference
from engine.layers.norm import rms_norm
from engine.layers.rope import apply_rope


@dataclass(frozen=True)
class AttnConsts:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    gated: bool
    zero_centered: bool
    eps: float
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    inv_freq: torch.Tensor  # [R/2] fp32

    @property
    def q_width(self) -> int:  # columns of one query head in proj
        return 2 * self.head_dim if self.gated else self.head_dim


@triton.jit
def _qk_rope_store_kernel(proj_ptr, proj_stride, q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, qn_ptr, kn_ptr,
                          freq_ptr, eps, cap, HQ, HKV, QW,
                          D: tl.constexpr, R: tl.constexpr, ZERO_CENTERED: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    i = tl.program_id(1)
    d = tl.arange(0, D)
    is_q = i < HQ
    j = i - HQ
    row = proj_ptr + t * proj_stride
    src = row + tl.where(is_q, i * QW, HQ * QW + j * D)
    x = tl.load(src + d).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    half: tl.constexpr = R // 2
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(src + partner, mask=d < R, other=0.0).to(tl.float32)
    w = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
    wp = tl.where(is_q, tl.load(qn_ptr + partner, mask=d < R, other=0.0),
                  tl.load(kn_ptr + partner, mask=d < R, other=0.0)).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
        wp = wp + 1.0
    dt = q_ptr.dtype.element_ty
    x = (x * inv * w).to(dt).to(tl.float32)  # normed in fp32, handed to RoPE in the model dtype
    xp = (xp * inv * wp).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    angle = pos * tl.load(freq_ptr + (d % half), mask=d < R, other=0.0)
    cos = tl.cos(angle).to(dt).to(tl.float32)
    sin = tl.sin(angle).to(dt).to(tl.float32)
    rot = tl.where(d < half, -xp, xp)
    y = tl.where(d < R, x * cos + rot * sin, x).to(dt)
    if is_q:
        tl.store(q_ptr + (t * HQ + i) * D + d, y)
    else:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        at = ((slot * HKV + j) * cap + p) * D + d
        tl.store(k_ptr + at, y)
        v = tl.load(row + HQ * QW + HKV * D + j * D + d)
        tl.store(v_ptr + at, v)


def qk_rope_store(proj: torch.Tensor, q: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor,
                  slots: torch.Tensor, positions: torch.Tensor, c: AttnConsts) -> torch.Tensor:
    """Normalise + rotate q into q [N, h, D]; k (normalised, rotated) and v into the slabs at (slot, pos)."""
    N = proj.shape[0]
    S, kv, cap, D = k_slab.shape
    if (kv, D) != (c.kv_heads, c.head_dim) or v_slab.shape != k_slab.shape or proj.stride(1) != 1:
        raise ValueError(f"qk_rope_store: slab {tuple(k_slab.shape)} does not fit {c.kv_heads} heads of {c.head_dim}")
    if proj.shape[1] < c.heads * c.q_width + 2 * kv * D or q.shape != (N, c.heads, D):
        raise ValueError("qk_rope_store: proj / q shapes do not match the attention layer")
    if D & (D - 1) or c.rotary_dim % 2:
        raise ValueError(f"qk_rope_store wants a power-of-two head dim and an even rotary dim, got {D}, {c.rotary_dim}")
    _qk_rope_store_kernel[(N, c.heads + kv)](proj, proj.stride(0), q, k_slab, v_slab, slots, positions,
                                             c.q_norm, c.k_norm, c.inv_freq, c.eps, cap, c.heads, kv,
                                             c.q_width, D=D, R=c.rotary_dim, ZERO_CENTERED=c.zero_centered,
                                             num_warps=2 if D <= 128 else 4, **pdl_args(proj))
    return q


def qk_rope_store_ref(proj, k_slab, v_slab, slots, positions, c: AttnConsts):
    N, D = proj.shape[0], c.head_dim
    q = proj[:, : c.heads * c.q_width].reshape(N, c.heads, c.q_width)[..., :D]
    k = proj[:, c.heads * c.q_width : c.heads * c.q_width + c.kv_heads * D].reshape(N, c.kv_heads, D)
    v = proj[:, c.heads * c.q_width + c.kv_heads * D :][:, : c.kv_heads * D].reshape(N, c.kv_heads, D)
    q, k = rms_norm(q, c.q_norm, c.eps, c.zero_centered), rms_norm(k, c.k_norm, c.eps, c.zero_centered)
    freqs = positions.float()[:, None] * c.inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos().to(proj.dtype), angles.sin().to(proj.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for t, (s, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        k_slab[s, :, p], v_slab[s, :, p] = k[t], v[t]
    return q


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, o_ptr, lse_ptr, scale, cap, HQ, HKV, SPLITS,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                         PREC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, GP)
    gm = g < G
    d = tl.arange(0, D)
    heads = j * G + g
    q = tl.load(q_ptr + (b * HQ + heads)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    length = tl.load(pos_ptr + b) + 1
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BN) * BN
    start = s * chunk
    end = tl.minimum(start + chunk, length)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    base = (slot * HKV + j) * cap * D
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < end
        kt = tl.load(k_ptr + base + n.to(tl.int64)[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale
        sc = tl.where(nm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(v_ptr + base + n.to(tl.int64)[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    live = l_i > 0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
    at = (b * HQ + heads) * SPLITS + s
    tl.store(o_ptr + at[:, None] * D + d[None, :], o, mask=gm[:, None])
    tl.store(lse_ptr + at, lse, mask=gm)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, proj_ptr, proj_stride, out_ptr, HQ, SPLITS, QW,
                    D: tl.constexpr, BS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BS)
    d = tl.arange(0, D)
    at = (b * HQ + h) * SPLITS + sp
    lse = tl.load(lse_ptr + at, mask=sp < SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(o_ptr + at[:, None] * D + d[None, :], mask=(sp < SPLITS)[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    dt = out_ptr.dtype.element_ty
    if GATED:
        gate = tl.load(proj_ptr + b * proj_stride + h * QW + D + d).to(tl.float32)
        o = o.to(dt).to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + (b * HQ + h) * D + d, o.to(dt))


def _precision(x: torch.Tensor) -> str:
    """fp32 inputs multiply exactly (the verification dtype); others in the tensor cores' own mode."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def decode_splits(cap: int) -> int:
    """Key ranges a decode step splits each (sequence, KV head) into: enough programs for long contexts."""
    return max(4, min(64, cdiv(cap, 1024)))


def decode_attention(q: torch.Tensor, proj: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, c: AttnConsts, splits: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, h, D] of tokens at `positions` (their keys already stored) -> gated output [B, h*D]."""
    B = q.shape[0]
    cap, D = k_slab.shape[2], c.head_dim
    splits = splits or decode_splits(cap)
    G = c.heads // c.kv_heads
    o_part = torch.empty(B, c.heads, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, c.heads, splits, dtype=torch.float32, device=q.device)
    bn = 64 if D <= 128 else 32
    _decode_split_kernel[(B, c.kv_heads, splits)](q, k_slab, v_slab, slots, positions, o_part, lse, D ** -0.5, cap,
                                                  c.heads, c.kv_heads, splits, G=G,
                                                  GP=max(16, next_pow2(G)),
                                                  D=D, BN=bn, PREC=_precision(q), num_warps=4, **pdl_args(q))
    out = out if out is not None else torch.empty(B, c.heads * D, dtype=q.dtype, device=q.device)
    _combine_kernel[(B, c.heads)](o_part, lse, proj, proj.stride(0), out, c.heads, splits, c.q_width, D=D,
                                  BS=next_pow2(splits), GATED=c.gated, num_warps=4, **pdl_args(o_part))
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tiles_ptr, out_ptr, scale, cap, HQ, HKV, gate_ptr, gate_stride, QW,
                    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                    GATED: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    j = h // G
    row0 = tl.load(tiles_ptr + tile * 4)
    nrows = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    slot = tl.load(tiles_ptr + tile * 4 + 3).to(tl.int64)
    m = tl.arange(0, BM)
    qm = m < nrows
    d = tl.arange(0, D)
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + (rows * HQ + h)[:, None] * D + d[None, :], mask=qm[:, None], other=0.0)
    qpos = pos0 + m
    end = pos0 + nrows
    base = (slot * HKV + j) * cap * D
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n0 in range(0, end, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < end
        kt = tl.load(k_ptr + base + n.to(tl.int64)[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale
        sc = tl.where((n[None, :] <= qpos[:, None]) & nm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(v_ptr + base + n.to(tl.int64)[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    dt = out_ptr.dtype.element_ty
    o = (acc / l_i[:, None]).to(dt)
    if GATED:  # the output gate (proj's q columns past D): the eager path's product of two values in dt
        gate = tl.load(gate_ptr + rows[:, None] * gate_stride + h * QW + D + d[None, :], mask=qm[:, None],
                       other=0.0).to(tl.float32)
        o = (o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + (rows * HQ + h)[:, None] * D + d[None, :], o, mask=qm[:, None])


def prefill_block(head_dim: int) -> tuple[int, int, int]:
    """(BM, BN, warps) of the prefill kernel: smaller key tiles for wide heads keep the tiles in registers."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 8)


def prefill_tiles(spans: list[tuple[int, int, int, int]], bm: int, device) -> torch.Tensor:
    """spans: (first row in the packed batch, tokens, first position, slot) per sequence ->
    tiles [n, 4] int32 (row0, rows, pos0, slot) of at most bm query rows each."""
    tiles = [(off + i, min(bm, n - i), pos + i, slot) for off, n, pos, slot in spans for i in range(0, n, bm)]
    return torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True)


def prefill_attention(q: torch.Tensor, proj: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor,
                      tiles: torch.Tensor, c: AttnConsts) -> torch.Tensor:
    """q [N, h, D] (keys of these tokens already stored) -> gated output [N, h*D] (the gate read from proj's q
    columns inside the kernel: attention_ref's three more launches)."""
    N, D = q.shape[0], c.head_dim
    bm, bn, warps = prefill_block(D)
    if c.gated and proj.stride(1) != 1:
        raise ValueError("prefill_attention: proj must have unit column stride (the gate is read from it)")
    out = torch.empty(N, c.heads, D, dtype=q.dtype, device=q.device)
    _prefill_kernel[(tiles.shape[0], c.heads)](q, k_slab, v_slab, tiles, out, D ** -0.5, k_slab.shape[2], c.heads,
                                               c.kv_heads, proj, proj.stride(0), c.q_width, G=c.heads // c.kv_heads,
                                               D=D, BM=bm, BN=bn, PREC=_precision(q), GATED=c.gated,
                                               num_warps=warps)
    return out.reshape(N, -1)


def attention_ref(q, proj, k_slab, v_slab, spans, c: AttnConsts):
    """spans: (first row, tokens, first position, slot) per sequence -> gated output [N, h*D]."""
    N, D = q.shape[0], c.head_dim
    out = torch.empty_like(q)
    for off, n, pos, slot in spans:
        keys, values = k_slab[slot, :, : pos + n], v_slab[slot, :, : pos + n]
        out[off : off + n] = attend_reference(q[off : off + n], keys, values, pos, D ** -0.5)
    out = out.reshape(N, -1)
    if c.gated:
        gate = proj[:, : c.heads * c.q_width].reshape(N, c.heads, c.q_width)[..., D:].reshape(N, -1)
        out = out * torch.sigmoid(gate)
    return out
