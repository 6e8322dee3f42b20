"""RMSNorm in the two flavours of the Qwen family. Statistics in fp32, result in the input dtype.

Qwen3.5 / Qwen3-Next store the weight zero-centred and scale by (1 + w) in fp32; Qwen3-MoE scales by w after
casting back. The gated variant (DeltaNet output) scales by plain w, then multiplies by silu(gate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    if zero_centered:
        return (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return weight * _normalize(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = weight * _normalize(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)
