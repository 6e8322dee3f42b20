"""`--synthetic NAME`: expert pools of real model shapes filled with seeded values, no checkpoint, no disk.

Filling is the slow part on the lent box (first touch of fresh host memory ~1 GB/s; torch's CPU normal_()
over 64 GB never finished), so values are generated on the GPU a layer at a time and copied down, or on
CPU one small set of host blocks is generated once and replicated. Build the pool once per process.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.experts.block_layout import ExpertLayout
from engine.experts.host_pool import HostPool

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SCALE = 0.02  # weight std: keeps activations finite through SwiGLU


@dataclass(frozen=True)
class SyntheticShape:
    name: str
    layers: int  # all decoder layers carry an MoE FFN
    experts: int
    top_k: int
    hidden: int
    inter: int  # routed expert intermediate size
    shared_inter: int  # shared expert (device-resident; not part of the pool)
    full_attention: int  # layers with full attention (the rest are gated DeltaNet)
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.hidden, self.inter, torch.empty(0, dtype=self.torch_dtype).element_size())

    @property
    def pool_bytes(self) -> int:
        return self.layers * self.experts * self.layout.nbytes


SHAPES = {
    "qwen3.6-35b-a3b": SyntheticShape("qwen3.6-35b-a3b", layers=40, experts=256, top_k=8, hidden=2048,
                                      inter=512, shared_inter=512, full_attention=10),
}


def get_shape(name: str, scale_down: bool = False) -> SyntheticShape:
    """The named shape; scale_down gives a seconds-sized variant (same top-k, fewer/smaller experts)."""
    if name not in SHAPES:
        raise ValueError(f"unknown --synthetic {name!r}; known: {', '.join(SHAPES)}")
    s = SHAPES[name]
    if not scale_down:
        return s
    return replace(s, name=s.name + "-small", layers=4, experts=32, hidden=256, inter=64, shared_inter=64,
                   full_attention=1, dtype="float32")


def _fill_gpu(seed: int, device: torch.device):
    def fill(layer: int, buf: torch.Tensor) -> None:
        g = torch.Generator(device).manual_seed(seed + layer)
        block = torch.randn(buf.shape, generator=g, device=device, dtype=buf.dtype)  # [E, numel]
        buf.copy_(block.mul_(_SCALE))

    return fill


def _fill_cpu(seed: int, numel: int, dtype: torch.dtype, distinct: int = 4):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(distinct, numel, generator=g) * _SCALE).to(dtype)  # [distinct, numel]

    def fill(layer: int, buf: torch.Tensor) -> None:
        for i in range(0, buf.shape[0], distinct):
            n = min(distinct, buf.shape[0] - i)
            buf[i:i + n].copy_(base.roll(layer, dims=0)[:n])

    return fill


def synthetic_pool(shape: SyntheticShape, *, seed: int = 0, device: str | torch.device = "cpu",
                   **load_kw) -> HostPool:
    """A filled host pool of `shape`; GPU-generated values when `device` is CUDA."""
    device = torch.device(device)
    pool = HostPool(range(shape.layers), shape.experts, shape.layout, shape.torch_dtype)
    fill = (_fill_gpu(seed, device) if device.type == "cuda"
            else _fill_cpu(seed, shape.layout.numel, shape.torch_dtype))
    return pool.load(fill, **load_kw)
