"""The fast path's weight layout, built once from a loaded Model without holding any weight twice.

Per attention layer one q|k|v projection, per DeltaNet layer one conv-input|z|b|a projection, per MoE layer
one router|shared-gate projection, and the shared expert stacked after the routed ones as expert E (when its
width equals theirs), so each block starts with one GEMM and runs its experts in one launch pair. With an
expert cache (CachedMoE) the routed experts stay where the backend keeps them. The eager
layers' weights are re-pointed at row slices of the fused tensors: same values, one copy in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.attention_triton import AttnConsts
from engine.kernels.deltanet_triton import RuleConsts


@dataclass
class FusedAttention:
    qkv_w: torch.Tensor  # [h*QW + 2*kv*D, H]
    o_w: torch.Tensor
    consts: AttnConsts


@dataclass
class FusedDeltaNet:
    in_w: torch.Tensor  # [C + Hv*dv + 2*Hv, H]: conv input (q | k | v), z, b, a
    conv_w: torch.Tensor  # [C, K]
    out_w: torch.Tensor
    consts: RuleConsts


@dataclass
class FusedMoE:
    router_w: torch.Tensor  # [E (+1 shared gate), H]
    gate_up: torch.Tensor  # [E (+1 shared), 2I, H]
    down: torch.Tensor  # [E (+1 shared), H, I]
    top_k: int
    norm_topk: bool
    shared_folded: bool  # expert E is the shared expert, weighted by sigmoid(router row E)
    shared: object | None  # the shared expert when not folded (its width differs), else None
    shared_gate_w: torch.Tensor | None


@dataclass
class CachedMoE:
    """An MoE layer whose routed experts live in an expert cache (offload / cpu / hybrid): the router (and the
    shared expert's gate, last) in one projection, the shared expert's gate|up in one, the routed experts
    through the backend."""

    router_w: torch.Tensor  # [E (+1 shared gate), H]
    top_k: int
    norm_topk: bool
    backend: object  # OffloadBackend and its kin: forward(layer, x, ids, w) -> [N, H]
    layer: int
    shared_gate_up: torch.Tensor | None  # [2Is, H]
    shared_down: torch.Tensor | None  # [H, Is]


def _concat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Row-concatenate; -> (fused, views of it equal to each input)."""
    fused = torch.cat(tensors)
    views, start = [], 0
    for t in tensors:
        views.append(fused[start : start + t.shape[0]])
        start += t.shape[0]
    return fused, views


def fuse_attention(attn, cfg) -> FusedAttention:
    qkv, (attn.q_w, attn.k_w, attn.v_w) = _concat([attn.q_w, attn.k_w, attn.v_w])
    consts = AttnConsts(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.attn_output_gate,
                        cfg.zero_centered_norm, cfg.rms_norm_eps, attn.q_norm, attn.k_norm,
                        attn.rope.inv_freq.float())
    return FusedAttention(qkv, attn.o_w, consts)


def fuse_deltanet(net, cfg) -> FusedDeltaNet:
    in_w, (net.qkv_w, net.z_w, net.b_w, net.a_w) = _concat([net.qkv_w, net.z_w, net.b_w, net.a_w])
    consts = RuleConsts(cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_head_dim,
                        cfg.linear_v_head_dim, net.neg_A.contiguous(), net.dt_bias, net.norm_w, cfg.rms_norm_eps)
    return FusedDeltaNet(in_w, net.conv_w.reshape(net.conv_w.shape[0], -1).contiguous(), net.out_w, consts)


def fuse_moe(moe, cfg) -> FusedMoE:
    gate_up, down = moe.backend.source.stacked(moe.layer)  # [E, 2I, H], [E, H, I]
    shared = moe.shared
    folded = shared is not None and shared.gate_w.shape[0] == gate_up.shape[1] // 2
    if folded:
        gu_all = torch.cat([gate_up, torch.cat([shared.gate_w, shared.up_w])[None]])
        dn_all = torch.cat([down, shared.down_w[None]])
        E = gate_up.shape[0]
        moe.backend.source.rebind(moe.layer, gu_all[:E], dn_all[:E])
        shared.gate_w, shared.up_w = gu_all[E, : shared.gate_w.shape[0]], gu_all[E, shared.gate_w.shape[0] :]
        shared.down_w = dn_all[E]
        gate_up, down = gu_all, dn_all
    router = moe.router_w
    if folded:
        router, (moe.router_w, moe.shared_gate_w) = _concat([moe.router_w, moe.shared_gate_w])
    return FusedMoE(router, gate_up, down, cfg.top_k, cfg.norm_topk_prob, folded,
                    None if folded else shared, None if folded or shared is None else moe.shared_gate_w)


def fuse_cached_moe(moe, cfg) -> CachedMoE:
    """The layout of an MoE layer whose routed experts stay in the backend's cache (nothing of theirs moves)."""
    shared = moe.shared
    router, gate_up = moe.router_w, None
    if shared is not None:
        router, (moe.router_w, moe.shared_gate_w) = _concat([moe.router_w, moe.shared_gate_w])
        gate_up, (shared.gate_w, shared.up_w) = _concat([shared.gate_w, shared.up_w])
    return CachedMoE(router, cfg.top_k, cfg.norm_topk_prob, moe.backend, moe.layer, gate_up,
                     None if shared is None else shared.down_w)
