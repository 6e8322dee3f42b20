"""Gated full attention (Qwen3.5) and plain attention (Qwen3-MoE): q/k RMSNorm per head, partial RoPE, GQA.

Projections run on all tokens of the batch at once; the attention itself per sequence against its own KV.
N = tokens in the batch, T = tokens of one sequence, L = its cached length, h / kv = heads, D = head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.norm import rms_norm
from engine.layers.rope import Rope, apply_rope


class Attention:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], rope: Rope):
        self.cfg, self.rope = cfg, rope
        self.q_w, self.k_w, self.v_w, self.o_w = (w[f"self_attn.{n}_proj.weight"] for n in "qkvo")
        self.q_norm, self.k_norm = w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"]

    def __call__(self, x: torch.Tensor, spans: list) -> torch.Tensor:
        """x [N, H]; spans: a Span per sequence (its state a KVCache) -> [N, H]."""
        cfg, N = self.cfg, x.shape[0]
        norm = dict(eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)
        q = F.linear(x, self.q_w).view(N, cfg.num_heads, -1)  # [N, h, D] or [N, h, 2D] with the gate
        if cfg.attn_output_gate:
            q, gate = q.split(cfg.head_dim, dim=-1)
            gate = gate.reshape(N, -1)
        q = rms_norm(q, self.q_norm, **norm)
        k = rms_norm(F.linear(x, self.k_w).view(N, cfg.num_kv_heads, -1), self.k_norm, **norm)
        v = F.linear(x, self.v_w).view(N, cfg.num_kv_heads, -1)
        positions = torch.cat([torch.arange(s.position, s.position + s.length, device=x.device) for s in spans])
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.empty_like(q)
        for off, n, pos, kv, _ in spans:  # KV needs no checkpoints: a prefix of it is the KV at any position
            kv.append(k[off : off + n], v[off : off + n])
            out[off : off + n] = self._attend(q[off : off + n], kv, pos)
        out = out.reshape(N, -1)
        if cfg.attn_output_gate:
            out = out * torch.sigmoid(gate)
        return F.linear(out, self.o_w)

    def _attend(self, q: torch.Tensor, kv, pos: int) -> torch.Tensor:
        """q [T, h, D] at positions pos..pos+T-1 against the sequence's keys [kv, L, D] -> [T, h, D]."""
        T, kv_heads = q.shape[0], self.cfg.num_kv_heads
        keys, values = kv.keys(), kv.values()
        scale = self.cfg.head_dim**-0.5
        if T == 1:  # decode: query heads grouped per KV head, no copy of the cache, no SDPA call overhead
            qg = q.view(kv_heads, -1, q.shape[-1])  # [kv, h/kv, D]
            probs = torch.softmax((qg @ keys.transpose(1, 2)).float() * scale, dim=-1).to(q.dtype)  # [kv, h/kv, L]
            return (probs @ values).reshape(1, -1, q.shape[-1])
        if q.device.type == "cpu" and _FLASH_CPU is not None and keys.shape[1] == pos + T:
            return attend_split_cpu(q, keys, values, pos, scale)
        return attend_reference(q, keys, values, pos, scale)


def attend_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int,
                     scale: float) -> torch.Tensor:
    """Chunk attention with an explicit causal mask offset by `pos` (the slow, obviously right path)."""
    T = q.shape[0]
    rep = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
    key_pos = torch.arange(keys.shape[1], device=q.device)
    mask = key_pos[None, :] <= (pos + torch.arange(T, device=q.device)[:, None])  # [T, L]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=scale)[0]
    return out.transpose(0, 1)


# torch's fused CPU attention, which also returns each row's log-sum-exp (torch >= 2.2). Public SDPA with a
# mask falls back to a path that materialises [heads, T, L] scores: 5-9x slower at 26k tokens of context.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_split_cpu(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int,
                     scale: float) -> torch.Tensor:
    """The same as attend_reference, as two unmasked fused calls merged by log-sum-exp.

    The causal mask only bites inside the chunk: the cached keys 0..pos-1 are visible to every query, the
    chunk's own keys causally (T x T, where top-left and bottom-right alignment agree). For the cached part
    the query heads of one KV group are stacked along the token axis ([kv, rep*T, D]), so the cache is never
    repeated per query head; only the chunk's T keys are.
    """
    T, h, D = q.shape
    kv = keys.shape[0]
    rep = h // kv
    qh = q.transpose(0, 1)  # [h, T, D]
    own_k = keys[:, pos:].repeat_interleave(rep, dim=0)[None]
    own_v = values[:, pos:].repeat_interleave(rep, dim=0)[None]
    out, lse = _FLASH_CPU(qh[None], own_k, own_v, 0.0, True, scale=scale)
    if pos == 0:
        return out[0].transpose(0, 1)
    grouped = qh.reshape(kv, rep * T, D)[None]  # heads are kv-major: head i belongs to group i // rep
    past, past_lse = _FLASH_CPU(grouped, keys[None, :, :pos], values[None, :, :pos], 0.0, False, scale=scale)
    past, past_lse = past.reshape(h, T, D), past_lse.reshape(h, T)
    top = torch.maximum(lse[0], past_lse)
    w_own, w_past = (lse[0] - top).exp(), (past_lse - top).exp()
    merged = (out[0].float() * w_own[..., None] + past.float() * w_past[..., None]) / (w_own + w_past)[..., None]
    return merged.to(q.dtype).transpose(0, 1)
