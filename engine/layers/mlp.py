"""SwiGLU MLP: the dense FFN of Qwen3-MoE's mlp_only layers, the shared expert and every routed expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_w, up_w [I, H]; down_w [H, I] -> [T, H]."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def swiglu_fused(x: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """Same with gate and up stacked as in the checkpoints: gate_up_w [2I, H] (gate rows first)."""
    gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w)


class DenseMLP:
    def __init__(self, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor):
        self.gate_w, self.up_w, self.down_w = gate_w, up_w, down_w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_w, self.up_w, self.down_w)
