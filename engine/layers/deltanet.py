"""Gated DeltaNet (Qwen3.5's linear attention): causal depthwise conv with state, gated delta rule, gated norm.

Projections and the output norm run on all tokens at once; conv and delta rule per sequence, each carrying
its own LinearState. N = tokens in the batch, C = conv channels (q, k, v side by side), K = conv width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule
from engine.layers.norm import gated_rms_norm


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor]):
        self.cfg = cfg
        p = "linear_attn."
        self.qkv_w, self.z_w = w[p + "in_proj_qkv.weight"], w[p + "in_proj_z.weight"]
        self.b_w, self.a_w = w[p + "in_proj_b.weight"], w[p + "in_proj_a.weight"]
        self.conv_w = w[p + "conv1d.weight"]  # [C, 1, K]
        self.neg_A = -w[p + "A_log"].float().exp()  # [Hv]; decay rate, in fp32 as fp16 could overflow
        self.dt_bias, self.norm_w, self.out_w = w[p + "dt_bias"], w[p + "norm.weight"], w[p + "out_proj.weight"]

    def __call__(self, x: torch.Tensor, spans: list) -> torch.Tensor:
        """x [N, H]; spans: (offset, length, position, LinearState, marks) per sequence -> [N, H].

        marks: absolute positions inside (position, position + length) where the state is also copied
        into state.saved, the recurrence running piecewise between them."""
        cfg, N = self.cfg, x.shape[0]
        qkv = F.linear(x, self.qkv_w)  # [N, C]
        z = F.linear(x, self.z_w).view(N, cfg.linear_num_v_heads, -1)  # output gate [N, Hv, dv]
        beta = torch.sigmoid(F.linear(x, self.b_w))  # [N, Hv]
        g = self.neg_A * F.softplus(F.linear(x, self.a_w).float() + self.dt_bias)  # log-decay <= 0
        out = torch.empty_like(z)
        for off, n, pos, state, marks in spans:
            cuts = [m - pos for m in marks if pos < m < pos + n]
            conv_in = state.conv
            q, k, v = self._conv(qkv[off : off + n], state).split(
                [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
            q = q.reshape(n, cfg.linear_num_k_heads, -1)
            k = k.reshape(n, cfg.linear_num_k_heads, -1)
            v = v.reshape(n, cfg.linear_num_v_heads, -1)
            bounds = [0, *cuts, n]
            for a, b in zip(bounds, bounds[1:]):
                s = slice(off + a, off + b)
                rule = recurrent_gated_delta_rule if b - a == 1 else chunked_gated_delta_rule
                out[s], state.recurrent = rule(q[a:b], k[a:b], v[a:b], g[s], beta[s], state.recurrent)
                if b < n:
                    state.saved[pos + b] = (self._conv_state_at(conv_in, qkv[off : off + n], b),
                                            state.recurrent.clone())
        out = gated_rms_norm(out, z, self.norm_w, cfg.rms_norm_eps).reshape(N, -1)
        return F.linear(out, self.out_w)

    def _conv(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [T, C] -> silu(causal depthwise conv) [T, C]; state.conv keeps the last K-1 inputs [C, K-1]."""
        full = torch.cat([state.conv, x.t()], dim=-1)  # [C, K-1+T]
        state.conv = full[:, full.shape[1] - state.conv.shape[1] :].contiguous()
        windows = full.unfold(1, self.conv_w.shape[-1], 1)  # [C, T, K]: the K inputs each output sees
        y = (windows * self.conv_w).sum(-1)  # depthwise conv as elementwise ops (conv1d is slow for tiny T)
        return F.silu(y).t()

    @staticmethod
    def _conv_state_at(conv_in: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
        """The conv state after the first t inputs of x [T, C], given the state before them [C, K-1]."""
        width = conv_in.shape[1]
        return torch.cat([conv_in, x[max(0, t - width) : t].t()], dim=-1)[:, -width:].contiguous()
