"""Rotary position embedding on the leading `rotary_dim` channels of each head (partial RoPE).

Qwen3.5's multimodal RoPE reduces to this for text: all three position streams are the token index.
"""
from __future__ import annotations

import torch


class Rope:
    def __init__(self, rotary_dim: int, theta: float, device: torch.device):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [R/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions LongTensor[T] -> cos, sin [T, R] (each frequency twice, halves layout)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotates x[..., :R] by the angles of its token, leaves the rest as is."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2 :]
    rotated = torch.cat([-second, first], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
