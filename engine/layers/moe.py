"""The MoE block: router (softmax -> top-k -> renormalise where the model does), routed experts through the
expert backend, plus the sigmoid-gated shared expert (Qwen3.5). N = tokens, E = experts, K = top-k."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.mlp import DenseMLP


class MoE:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], backend):
        self.cfg, self.layer, self.backend = cfg, layer, backend
        self.router_w = w["mlp.gate.weight"]  # [E, H]
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            p = "mlp.shared_expert."
            self.shared = DenseMLP(w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
            self.shared_gate_w = w["mlp.shared_expert_gate.weight"]  # [1, H]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (topk_ids [N, K], topk_w [N, K] in x's dtype)."""
        probs = F.softmax(F.linear(x, self.router_w), dim=-1, dtype=torch.float32)  # [N, E]
        topk_w, topk_ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return topk_ids, topk_w.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_w = self.route(x)
        out = self.backend.forward(self.layer, x, topk_ids, topk_w)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate_w)) * self.shared(x)
        return out
