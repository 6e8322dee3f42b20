"""One decode step of Gated DeltaNet per sequence, states updated in place in the slot pools.

    conv_step(proj, conv_state, slots, conv_w) -> qkv [B, C]          (silu of the causal conv, state shifted)
    rule_step(qkv, proj, rec_state, slots, consts) -> out [B, Hv*dv]  (delta rule, then gated RMSNorm)

The rule runs a program per (sequence, value head), the head's whole [dk, dv] state in registers, and
applies the gated norm over the head's dv before it stores (one launch); heads wider than FUSED_DV run a
program per (sequence, value head, block of dv columns) instead, the state's columns updating independently,
and the gated norm follows as a second launch, or runs in the program that finishes each head's last slice.
RuleTiles chooses any of these for any width (engine/bench/tiles.py times them).

proj [B, P] is the fused input projection of a DeltaNet layer: columns [0, C) the conv input (q | k | v),
then z [Hv*dv], b [Hv], a [Hv] (engine/models/fused.py lays it out). States: conv [S, C, K-1] in the model
dtype, recurrent [S, Hv, dk, dv] fp32; `slots` [B] int32 picks each sequence's row. The arithmetic is the
eager path's (engine/layers/deltanet.py, delta_rule.recurrent_gated_delta_rule, norm.gated_rms_norm):
references conv_step_ref / rule_step_ref below. B = sequences, C = conv channels, K = conv width,
Hk / Hv = key / value heads, dk / dv = head dims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, last_to_finish, next_pow2, pdl_args, pdl_enter, zeroed_counts

from engine.layers.delta_rule import recurrent_gated_delta_rule
from engine.layers.norm import gated_rms_norm


@triton.jit
def _conv_step_kernel(x_ptr, x_stride, state_ptr, slots_ptr, w_ptr, out_ptr, C,
                      KW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    j = tl.arange(0, BLOCK_W)
    old = j < KW - 1
    slot = tl.load(slots_ptr + b).to(tl.int64)
    st = state_ptr + slot * C * (KW - 1) + c[:, None] * (KW - 1)  # [BLOCK_C, 1]
    x = tl.load(x_ptr + b * x_stride + c, mask=cm, other=0.0)
    hist = tl.load(st + j[None, :], mask=cm[:, None] & old[None, :], other=0.0)  # [BLOCK_C, BLOCK_W]
    w_hist = tl.load(w_ptr + c[:, None] * KW + j[None, :], mask=cm[:, None] & old[None, :], other=0.0)
    w_new = tl.load(w_ptr + c * KW + (KW - 1), mask=cm, other=0.0)
    y = tl.sum(hist.to(tl.float32) * w_hist.to(tl.float32), axis=1) + x.to(tl.float32) * w_new.to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + b * C + c, y.to(out_ptr.dtype.element_ty), mask=cm)
    # shift: slot j takes slot j + 1, the last takes x (every read above happens before any write)
    nxt = tl.load(st + (j + 1)[None, :], mask=cm[:, None] & (j + 1 < KW - 1)[None, :], other=0.0)
    shifted = tl.where((j == KW - 2)[None, :], x[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()
    tl.store(st + j[None, :], shifted, mask=cm[:, None] & old[None, :])


def conv_step(proj: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """proj [B, >=C] (row stride free, unit column stride); conv_state [S, C, K-1]; conv_w [C, K]."""
    B = proj.shape[0]
    S, C, km1 = conv_state.shape
    if conv_w.shape != (C, km1 + 1) or proj.stride(1) != 1 or not conv_state.is_contiguous():
        raise ValueError(f"conv_step: conv_w {tuple(conv_w.shape)} / state {tuple(conv_state.shape)} mismatch")
    if slots.dtype != torch.int32 or slots.shape != (B,):
        raise ValueError("conv_step wants slots int32 [B]")
    out = out if out is not None else torch.empty(B, C, dtype=proj.dtype, device=proj.device)
    block_c = 256
    _conv_step_kernel[(B, cdiv(C, block_c))](proj, proj.stride(0), conv_state, slots, conv_w.contiguous(),
                                                    out, C, KW=km1 + 1, BLOCK_C=block_c,
                                                    BLOCK_W=next_pow2(max(km1, 2)), num_warps=4,
                                                    **pdl_args(proj))
    return out


def conv_step_ref(proj, conv_state, slots, conv_w):
    C = conv_state.shape[1]
    x = proj[:, :C]
    out = torch.empty_like(x)
    for i, s in enumerate(slots.tolist()):
        full = torch.cat([conv_state[s], x[i, :, None]], dim=-1)  # [C, K]
        out[i] = F.silu((full * conv_w).sum(-1))
        conv_state[s] = full[:, 1:]
    return out


@dataclass(frozen=True)
class RuleConsts:
    """The per-layer constants of the decode rule (head counts and dims, weights)."""

    key_heads: int
    value_heads: int
    key_dim: int  # dk
    value_dim: int  # dv
    neg_A: torch.Tensor  # [Hv] fp32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv]
    norm_w: torch.Tensor  # [dv]
    eps: float


@triton.jit
def _gated_head(o, row, z_off, h, cols, normw_ptr, eps, DV: tl.constexpr, dt: tl.constexpr):
    """One head's row of the rule's output o [DV] (fp32) -> its gated RMSNorm in fp32, to store as dt:
    _gated_norm_kernel's arithmetic, for the rule kernel's programs that normalise a head themselves."""
    o = o.to(dt).to(tl.float32)
    y = (o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dt).to(tl.float32)
    y = y * tl.load(normw_ptr + cols).to(tl.float32)
    z = tl.load(row + z_off + h * DV + cols).to(tl.float32)
    return y * z / (1.0 + tl.exp(-z))


@triton.jit
def _rule_step_kernel(qkv_ptr, proj_ptr, proj_stride, b_off, a_off, state_ptr, slots_ptr, nega_ptr, dtb_ptr,
                      o_ptr, scale, C, HV, z_off, normw_ptr, eps, out_ptr, count_ptr,
                      REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KEYS: tl.constexpr,
                      NORM: tl.constexpr, LAST: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # one program: one sequence, one value head, BV of its dv columns (the state columns are independent).
    # NORM (BV == DV): the gated norm too, o_ptr then takes the normed output in qkv's dtype. LAST: o_ptr takes
    # the raw fp32 slice, and the head's last program to finish (count_ptr [B, HV], back at 0 after) normalises
    # the whole head into out_ptr
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    q = tl.load(qkv_ptr + b * C + hk * DK + dk).to(tl.float32)
    k = tl.load(qkv_ptr + b * C + KEYS + hk * DK + dk).to(tl.float32)
    v = tl.load(qkv_ptr + b * C + 2 * KEYS + h * DV + dv).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    row = proj_ptr + b * proj_stride
    a = tl.load(row + a_off + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = tl.load(nega_ptr + h) * softplus
    beta_in = tl.load(row + b_off + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-beta_in))).to(qkv_ptr.dtype.element_ty).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    sp = state_ptr + ((slot * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    S = tl.load(sp) * tl.exp(g)  # [DK, BV]
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * delta[None, :]
    tl.store(sp, S)
    o = tl.sum(S * q[:, None], axis=0)
    dt = qkv_ptr.dtype.element_ty
    if NORM:
        tl.store(o_ptr + (b * HV + h) * DV + dv, _gated_head(o, row, z_off, h, dv, normw_ptr, eps, DV, dt).to(dt))
    else:
        tl.store(o_ptr + (b * HV + h) * DV + dv, o)
        if LAST:
            if last_to_finish(count_ptr + b * HV + h, DV // BV):
                cols = tl.arange(0, DV)
                full = tl.load(o_ptr + (b * HV + h) * DV + cols, cache_modifier=".cg")
                gated = _gated_head(full, row, z_off, h, cols, normw_ptr, eps, DV, dt)
                tl.store(out_ptr + (b * HV + h) * DV + cols, gated.to(dt))


@triton.jit
def _gated_norm_kernel(o_ptr, proj_ptr, proj_stride, z_off, normw_ptr, out_ptr, eps, HV,
                       DV: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hs < HV
    dv = tl.arange(0, DV)
    at = hs[:, None] * DV + dv[None, :]
    dt = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + b * HV * DV + at, mask=hm[:, None], other=0.0).to(dt).to(tl.float32)  # [BH, DV]
    y = (o / tl.sqrt(tl.sum(o * o, axis=1) / DV + eps)[:, None]).to(dt).to(tl.float32)
    y = y * tl.load(normw_ptr + dv).to(tl.float32)[None, :]
    z = tl.load(proj_ptr + b * proj_stride + z_off + at, mask=hm[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + b * HV * DV + at, (y * z / (1.0 + tl.exp(-z))).to(dt), mask=hm[:, None])


FUSED_DV = 128  # heads up to this wide run rule and gated norm in one program ([dk, dv] fp32 in registers)
SPLIT_DV = 32  # dv columns a program of the split rule
RULE_NORMS = ("fused", "launch", "last")


class RuleTiles(NamedTuple):
    """How the decode rule runs: block_v dv columns a program, `warps` warps, and where the gated norm runs:
    "fused" in the rule's program (which then takes the whole head: block_v == dv), "launch" in a launch of its
    own after the rule, "last" in the program that finishes a head's last slice (no launch; the others' slices
    read back from L2)."""
    norm: str
    block_v: int
    warps: int


_CHOSEN: dict = {}  # set_rule_tiles' choice


def set_rule_tiles(tiles: RuleTiles | None) -> None:
    """Every decode rule from now on runs in these tiles (None: the default again); `killick bench model
    --rule-tiles` times the whole step so."""
    _CHOSEN.pop("tiles", None)
    if tiles is not None:
        _CHOSEN["tiles"] = RuleTiles(*tiles)


def rule_tiles(value_dim: int, fused: bool | None = None) -> RuleTiles:
    """The default: set_rule_tiles' choice where one is set, else fused (8 warps) for heads up to FUSED_DV wide,
    else SPLIT_DV columns a program (4 warps) and the norm's own launch; fused True / False asks for one of
    the two."""
    if fused is None and "tiles" in _CHOSEN:
        return _CHOSEN["tiles"]
    if fused if fused is not None else value_dim <= FUSED_DV:
        return RuleTiles("fused", value_dim, 8)
    return RuleTiles("launch", min(SPLIT_DV, value_dim), 4)


def rule_step(qkv: torch.Tensor, proj: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
              consts: RuleConsts, out: torch.Tensor | None = None, fused: bool | None = None,
              tiles: RuleTiles | None = None) -> torch.Tensor:
    """qkv [B, C] from conv_step; proj [B, P] the fused projection (z, b, a read from it); rec_state
    [S, Hv, dk, dv] fp32 updated in place -> [B, Hv*dv] in qkv's dtype (already gated-normed).
    fused: rule and norm in one launch (default: when dv <= FUSED_DV); tiles overrides it (rule_tiles)."""
    c = consts
    B, C = qkv.shape
    values = c.value_heads * c.value_dim
    tiles = tiles or rule_tiles(c.value_dim, fused)
    bv = tiles.block_v
    if tiles.norm not in RULE_NORMS or c.value_dim % bv or bv & (bv - 1) or (tiles.norm == "fused" and
                                                                          bv != c.value_dim):
        raise ValueError(f"rule_step: block_v {bv} must be a power of two dividing dv {c.value_dim}, dv itself when "
                         f"the norm is fused; the norm one of {', '.join(RULE_NORMS)}, got {tiles.norm!r}")
    out = out if out is not None else torch.empty(B, values, dtype=qkv.dtype, device=qkv.device)
    if tiles.norm == "fused":
        _rule(qkv, proj, rec_state, slots, c, out, tiles)
        return out
    o = torch.empty(B, values, dtype=torch.float32, device=qkv.device)
    if tiles.norm == "last":
        counts = zeroed_counts("rule", B * c.value_heads, qkv.device)
        _rule(qkv, proj, rec_state, slots, c, o, tiles, out=out, counts=counts)
        return out
    _rule(qkv, proj, rec_state, slots, c, o, tiles)
    return gated_norm(o, proj, C, c, out)


def gated_norm(o: torch.Tensor, proj: torch.Tensor, z_off: int, consts: RuleConsts,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated RMSNorm of the rule's output in one launch: o [N, Hv*dv] (contiguous, fp32 or the model
    dtype), z from proj [N, P] at column z_off (unit column stride) -> [N, Hv*dv] in out's dtype (default
    proj's). A decode step's rows or a prompt's (FastPath's DeltaNet prefill), norm.gated_rms_norm's arithmetic
    except that weight x normalised stays fp32 until the gate's product is rounded."""
    c = consts
    N = o.shape[0]
    values = c.value_heads * c.value_dim
    if not o.is_contiguous() or o.shape != (N, values) or proj.stride(1) != 1 or proj.shape[1] < z_off + values:
        raise ValueError(f"gated_norm: o must be contiguous [N, {values}] and proj hold z at column {z_off}")
    out = out if out is not None else torch.empty(N, values, dtype=proj.dtype, device=o.device)
    bh = min(next_pow2(c.value_heads), max(1, 4096 // c.value_dim))  # heads a program (masked)
    _gated_norm_kernel[(N, cdiv(c.value_heads, bh))](o, proj, proj.stride(0), z_off, c.norm_w, out, c.eps,
                                                            c.value_heads, DV=c.value_dim, BH=bh, num_warps=4,
                                                            **pdl_args(o))
    return out


def rule_step_raw(qkv: torch.Tensor, proj: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                  consts: RuleConsts) -> torch.Tensor:
    """The delta rule alone -> o [B, Hv*dv] fp32, before the gated norm."""
    c = consts
    o = torch.empty(qkv.shape[0], c.value_heads * c.value_dim, dtype=torch.float32, device=qkv.device)
    _rule(qkv, proj, rec_state, slots, c, o, rule_tiles(c.value_dim, fused=False))
    return o


def _rule(qkv, proj, rec_state, slots, c: RuleConsts, o, tiles: RuleTiles, out=None, counts=None) -> None:
    """The rule's launch: "fused" normalises too (o then in qkv's dtype), else o is fp32; "last" normalises into
    out, counting slices in counts."""
    B, C = qkv.shape
    keys, values = c.key_heads * c.key_dim, c.value_heads * c.value_dim
    if C != 2 * keys + values or rec_state.dtype != torch.float32 or not rec_state.is_contiguous():
        raise ValueError(f"rule_step: qkv has {C} channels, expected {2 * keys + values}; state must be fp32")
    if proj.stride(1) != 1 or proj.shape[1] < C + values + 2 * c.value_heads:
        raise ValueError("rule_step: proj must hold conv input, z, b and a, unit column stride")
    z_off = C
    b_off = z_off + values
    a_off = b_off + c.value_heads
    bv = tiles.block_v
    last = tiles.norm == "last"
    _rule_step_kernel[(B, c.value_heads, c.value_dim // bv)](
        qkv, proj, proj.stride(0), b_off, a_off, rec_state, slots, c.neg_A, c.dt_bias, o, c.key_dim ** -0.5, C,
        c.value_heads, z_off, c.norm_w, c.eps, out if last else o, counts if last else slots,
        REP=c.value_heads // c.key_heads, DK=c.key_dim, DV=c.value_dim, BV=bv, KEYS=keys,
        NORM=tiles.norm == "fused", LAST=last, num_warps=tiles.warps, **pdl_args(qkv))


TAIL_TOKENS = 64  # the most tokens rule_tail takes: a prompt's last ones, from the first checkpoint among them


@triton.jit
def _rule_tail_kernel(q_ptr, k_ptr, v_ptr, qk_stride, v_stride, g_ptr, g_stride, beta_ptr, beta_stride,
                      state_ptr, o_ptr, snap_ptr, mark_ptr, T, scale, HV,
                      REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    # one program: one value head, BV of its dv columns, through all T steps in order (_rule_step_kernel's
    # arithmetic a step); after step t+1 the state is also stored where mark[t] >= 0 points
    h = tl.program_id(0)
    hk = h // REP
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    at = (h * DK + dk[:, None]) * DV + dv[None, :]
    S = tl.load(state_ptr + at)  # [DK, BV] fp32
    for t in range(T):
        q = tl.load(q_ptr + t * qk_stride + hk * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + t * qk_stride + hk * DK + dk).to(tl.float32)
        v = tl.load(v_ptr + t * v_stride + h * DV + dv).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        S = S * tl.exp(tl.load(g_ptr + t * g_stride + h))
        delta = (v - tl.sum(S * k[:, None], axis=0)) * tl.load(beta_ptr + t * beta_stride + h).to(tl.float32)
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + (t * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty))
        mark = tl.load(mark_ptr + t)
        if mark >= 0:
            tl.store(snap_ptr + mark * HV * DK * DV + at, S)
    tl.store(state_ptr + at, S)


def rule_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, marks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta rule over a short run of one sequence's tokens in one launch, with the state kept after
    some of its steps: what a prompt's last few tokens need when checkpoints fall among them (split at each,
    the chunked rule would cost a whole pass of launches a piece).

    q, k [T, Hk, dk]; v [T, Hv, dv]; g [T, Hv] fp32; beta [T, Hv]; state [Hv, dk, dv] fp32 (left as it is);
    marks: steps in 1..T, ascending -> (o [T, Hv, dv] in v's dtype, the state after step T, the states after
    each marked step [len(marks), Hv, dk, dv]). recurrent_gated_delta_rule's contract and arithmetic."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if not 0 < T <= TAIL_TOKENS or sorted(set(marks)) != list(marks) or not all(0 < m <= T for m in marks):
        raise ValueError(f"rule_tail: {T} tokens (at most {TAIL_TOKENS}), marks {marks} must ascend in 1..T")
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (q, k, v))
    if k.stride(0) != q.stride(0):
        q, k = q.contiguous(), k.contiguous()
    g, beta = (x if x.stride(1) == 1 else x.contiguous() for x in (g.float(), beta))
    after = state.contiguous().clone()
    snaps = torch.empty(len(marks), Hv, dk, dv, dtype=torch.float32, device=q.device)
    where = [-1] * T
    for i, m in enumerate(marks):
        where[m - 1] = i
    o = torch.empty(T, Hv, dv, dtype=v.dtype, device=q.device)
    bv = min(SPLIT_DV, dv)
    _rule_tail_kernel[(Hv, dv // bv)](
        q, k, v, q.stride(0), v.stride(0), g, g.stride(0), beta, beta.stride(0), after, o, snaps,
        torch.tensor(where, dtype=torch.int32).to(q.device, non_blocking=True), T, dk ** -0.5, Hv,
        REP=Hv // Hk, DK=dk, DV=dv, BV=bv, num_warps=4)
    return o, after, snaps


def rule_step_ref(qkv, proj, rec_state, slots, consts: RuleConsts):
    c = consts
    B, C = qkv.shape
    keys, values = c.key_heads * c.key_dim, c.value_heads * c.value_dim
    q, k, v = qkv.split([keys, keys, values], dim=-1)
    z = proj[:, C : C + values].reshape(B, c.value_heads, c.value_dim)
    beta = torch.sigmoid(proj[:, C + values : C + values + c.value_heads])
    a = proj[:, C + values + c.value_heads : C + values + 2 * c.value_heads]
    g = c.neg_A * F.softplus(a.float() + c.dt_bias)
    out = torch.empty(B, c.value_heads, c.value_dim, dtype=qkv.dtype, device=qkv.device)
    for i, s in enumerate(slots.tolist()):
        o, rec_state[s] = recurrent_gated_delta_rule(
            q[i].view(1, c.key_heads, -1), k[i].view(1, c.key_heads, -1), v[i].view(1, c.value_heads, -1),
            g[i : i + 1], beta[i : i + 1], rec_state[s])
        out[i] = o[0]
    return gated_rms_norm(out, z, c.norm_w, c.eps).reshape(B, -1)
