"""`--moe-backend fused|offload|cpu|hybrid|auto`: name -> backend, importing only what is chosen.

The slot backends take a HostPool (host_pool.pool_from_source over the model's ExpertWeights source) and
a slot count; `fused` is the model's reference backend (engine/experts/fused.py, built by its loader).
"""
from __future__ import annotations

import importlib

from engine.experts.policy import choose_backend

_SLOT_BACKENDS = {
    "offload": ("engine.experts.offload", "OffloadBackend"),
    "cpu": ("engine.experts.cpu", "CpuBackend"),
    "hybrid": ("engine.experts.hybrid", "HybridBackend"),
}
NAMES = ("fused", *_SLOT_BACKENDS, "auto")


def resolve(name: str, *, dense: bool, pool_bytes: int, free_bytes: int, profile: dict | None) -> str:
    """The concrete backend for `name` ('auto' decided here, see policy.choose_backend)."""
    if name not in NAMES:
        raise ValueError(f"unknown --moe-backend {name!r}; choose one of {', '.join(NAMES)}")
    if name != "auto":
        return name
    return choose_backend(dense=dense, pool_bytes=pool_bytes, free_bytes=free_bytes, profile=profile)


def create_slot_backend(name: str, pool, num_slots: int, device, **kw):
    """An offload / cpu / hybrid backend over `pool` with `num_slots` device slots."""
    if name not in _SLOT_BACKENDS:
        raise ValueError(f"{name!r} is not a slot-cache backend; choose one of {', '.join(_SLOT_BACKENDS)}")
    module, cls = _SLOT_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(pool, num_slots, device, **kw)
