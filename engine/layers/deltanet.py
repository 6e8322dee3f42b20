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
        self.chunked_rule = chunked_gated_delta_rule  # the fast path swaps in fla's kernels on CUDA
        # (q, k, v, g, beta, state, marks) -> (o, state, states at the marks): the fast path's one-launch
        # kernel on CUDA (deltanet_triton.rule_tail) for a prompt's last tail_tokens when checkpoints fall there
        self.tail_rule = None
        self.tail_tokens = 0
        # (x [T, C], state.conv [C, K-1] updated in place) -> _conv's output: the fast path's one-launch kernel
        # (deltanet_prefill_triton.conv_prefill)
        self.prefill_conv = None

    def __call__(self, x: torch.Tensor, spans: list) -> torch.Tensor:
        """x [N, H]; spans: a Span per sequence (its state a LinearState) -> [N, H]."""
        qkv = F.linear(x, self.qkv_w)  # [N, C]
        z = F.linear(x, self.z_w)  # output gate [N, Hv*dv]
        beta, g = self.gates(F.linear(x, self.b_w), F.linear(x, self.a_w))
        out = torch.empty_like(z).view(x.shape[0], self.cfg.linear_num_v_heads, -1)
        for span in spans:
            self.run_sequence(qkv, g, beta, span, out)
        return self.output(out, z)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw b, a projections [N, Hv] -> (beta in the model dtype, log-decay g <= 0 in fp32)."""
        return torch.sigmoid(b), self.neg_A * F.softplus(a.float() + self.dt_bias)

    def output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Delta-rule output [N, Hv, dv], gate z [N, Hv*dv] -> the layer's output [N, H]."""
        N = out.shape[0]
        out = gated_rms_norm(out, z.reshape(out.shape), self.norm_w, self.cfg.rms_norm_eps).reshape(N, -1)
        return F.linear(out, self.out_w)

    def run_sequence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, span, out: torch.Tensor) -> None:
        """Conv + delta rule over one sequence's rows of qkv [N, C], writing out [N, Hv, dv].

        At each checkpoint position after the span's first token, up to and including its last one, the state
        is also copied into state.checkpoints, the recurrence running piecewise between them (with a tail rule,
        the last few tokens in one pass from the first checkpoint among them). (A forward's
        own end is never among the positions: the runner snapshots there itself; a piece of a layer-major
        forward may end on one.)"""
        cfg = self.cfg
        off, n, pos, state, positions = span
        inside = [p - pos for p in positions if pos < p <= pos + n]
        rows = qkv[off : off + n]
        conv_in = state.conv.clone() if inside else state.conv  # a slot state's conv is overwritten in place
        q, k, v = self._conv(rows, state).split([cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
        q = q.reshape(n, cfg.linear_num_k_heads, -1)
        k = k.reshape(n, cfg.linear_num_k_heads, -1)
        v = v.reshape(n, cfg.linear_num_v_heads, -1)
        # the tail rule takes the run past the first checkpoint within tail_tokens of the end in one pass,
        # keeping the state at the later ones; before it (or without one) the recurrence runs piecewise
        near = [p for p in inside if p < n and n - p <= self.tail_tokens] if self.tail_rule is not None else []
        tail = near[0] if near else None
        bounds = sorted({0, *(p for p in inside if tail is None or p <= tail), n})
        for a, b in zip(bounds, bounds[1:]):
            s = slice(off + a, off + b)
            if a == tail:
                later = [p for p in inside if p > a]
                out[s], state.recurrent, snaps = self.tail_rule(q[a:], k[a:], v[a:], g[s], beta[s],
                                                                state.recurrent, [p - a for p in later])
                for m, snap in zip(later, snaps):
                    state.checkpoints[pos + m] = (self._conv_state_at(conv_in, rows, m), snap)
                break
            rule = recurrent_gated_delta_rule if b - a == 1 else self.chunked_rule
            out[s], state.recurrent = rule(q[a:b], k[a:b], v[a:b], g[s], beta[s], state.recurrent)
            if b in inside:
                state.checkpoints[pos + b] = (self._conv_state_at(conv_in, rows, b), state.recurrent.clone())

    def _conv(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [T, C] -> silu(causal depthwise conv) [T, C]; state.conv keeps the last K-1 inputs [C, K-1]."""
        if self.prefill_conv is not None:
            return self.prefill_conv(x, state.conv)
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
