"""Model runners. `load_model(path, device, dtype) -> Model` (see docs/CONTRACTS.md, 'engine model runner')."""
from __future__ import annotations


def load_model(path, device="cpu", dtype="float32", experts=None, expert_device=None):
    """Load a checkpoint directory into a Model.

    dtype: torch.dtype or its name ("float32", "bfloat16", "float16").
    experts: optional factory `ExpertWeights -> backend` (default: the all-resident FusedExperts reference).
    expert_device: where the routed experts are loaded (default `device`; "cpu" for a host-RAM pool).
    """
    import torch

    from engine.experts.fused import FusedExperts
    from engine.loader import load_checkpoint
    from engine.models.qwen import Model

    dtype = parse_dtype(dtype)
    cfg, tensors, source = load_checkpoint(path, device, dtype, expert_device)
    backend = (experts or FusedExperts)(source)
    return Model(cfg, tensors, backend, torch.device(device), dtype)


def parse_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]
