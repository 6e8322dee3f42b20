"""`--moe-backend fused|offload|cpu|hybrid|auto`: name -> backend, importing only what is chosen.

The slot backends take a HostPool (host_pool.pool_from_source over the model's ExpertWeights source) and
a slot count; `fused` is the model's reference backend (engine/experts/fused.py, built by its loader).
"""
from __future__ import annotations

import importlib
import logging

from engine.experts.policy import choose_backend, slots_from_spec

log = logging.getLogger("killick.engine")

_SLOT_BACKENDS = {
    "offload": ("engine.experts.offload", "OffloadBackend"),
    "cpu": ("engine.experts.cpu", "CpuBackend"),
    "hybrid": ("engine.experts.hybrid", "HybridBackend"),
}
NAMES = ("fused", *_SLOT_BACKENDS, "auto")


def resolve(name: str, *, dense: bool, pool_bytes: int, free_bytes: int, profile: dict | None,
            slots: str | None = None, expert_bytes: int = 0) -> str:
    """The concrete backend for `name` ('auto' decided here, see policy.choose_backend). With `--moe-slots`
    (slots, and expert_bytes to count them) auto judges whether the experts fit against the slots asked for:
    a cap on the device's experts is an expert cache of that size."""
    if name not in NAMES:
        raise ValueError(f"unknown --moe-backend {name!r}; choose one of {', '.join(NAMES)}")
    if name != "auto":
        return name
    if slots is not None and expert_bytes and not dense:
        n = slots_from_spec(slots, total_experts=pool_bytes // expert_bytes, expert_bytes=expert_bytes,
                            free_bytes=free_bytes)
        free_bytes = min(free_bytes, n * expert_bytes)
    return choose_backend(dense=dense, pool_bytes=pool_bytes, free_bytes=free_bytes, profile=profile)


def warn_unused_slots(name: str, slots: str | None) -> None:
    """`--moe-backend fused --moe-slots ...`: said once, not silently dropped."""
    if name == "fused" and slots is not None:
        log.warning("--moe-slots %s left unused: --moe-backend fused keeps every expert on the device (offload, "
                    "cpu, hybrid or auto take slots)", slots)


def is_expert_cache(backend) -> bool:
    """An expert cache (offload / cpu / hybrid: host pool + device slots), told of each forward by
    begin_forward / end_forward; False for `fused` (every expert resident) and for no backend."""
    return hasattr(backend, "begin_forward")


def create_slot_backend(name: str, pool, num_slots: int, device, **kw):
    """An offload / cpu / hybrid backend over `pool` with `num_slots` device slots."""
    if name not in _SLOT_BACKENDS:
        raise ValueError(f"{name!r} is not a slot-cache backend; choose one of {', '.join(_SLOT_BACKENDS)}")
    module, cls = _SLOT_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(pool, num_slots, device, **kw)


def experts_factory(name: str = "auto", *, device="cpu", slots=None, free_bytes: int | None = None,
                    reserve_bytes: int = 0, profile: dict | None = None, estimate=None,
                    stream_prefill: bool | str = True, progress=None, background: bool = False, checkpoint=None,
                    slot_policy: str = "lfu", decode: str = "auto", prefetch: bool | str = "auto",
                    lookahead: bool | str = "auto", refresh: bool | str = "auto"):
    """`load_model(path, experts=experts_factory(...), expert_device="cpu")`: ExpertWeights -> backend.

    device: where the slots live (the model's device). slots: `--moe-slots` (N, "N%" or None = all the memory in
    free_bytes). free_bytes: device bytes left after non-expert weights and the KV budget (default: free now on CUDA
    minus reserve_bytes, e.g. the KV budget; on CPU, room for every expert). profile: the bench bw profile (default:
    this machine's, if `killick bench bw` ran; {} = none). For `fused` the source must already be on `device` (load
    with expert_device=None). checkpoint: fill the pool straight from this directory's safetensors (load the model
    with expert_device="meta" so experts are not held twice). stream_prefill: whether prompts stream whole layers
    through the slots, auto (True) | on | off (False) (prefill_stream.py). slot_policy: which slot a fill evicts,
    lru or lfu (engine/experts/lru.py). decode: how a fast path decodes through the cache, auto | mapped | host
    (offload.DECODE_MODES). prefetch: a mapped decode copies each layer's likely expert in while the layer's mixer
    runs (mapped.py), auto (on CUDA with a mapped decode) | on (True) | off (False). lookahead: a routed prompt
    copies the next layer's likely misses while a layer runs (lookahead.AHEAD_TOUCHED), auto (on CUDA) | on | off.
    refresh: idle time moves the hottest experts not in a slot in (OffloadBackend.refresh), auto (on CUDA) | on |
    off."""

    def build(source):
        import torch

        total, expert_bytes = len(source.layers) * source.num_experts, source.expert_nbytes()
        free = free_bytes
        if free is None:
            dev = torch.device(device)
            free = (torch.cuda.mem_get_info(dev)[0] - reserve_bytes if dev.type == "cuda"
                    else total * expert_bytes)
        prof = profile if profile is not None else _machine_profile(source)
        chosen = resolve(name, dense=not source.layers, pool_bytes=total * expert_bytes, free_bytes=free,
                         profile=prof, slots=slots, expert_bytes=expert_bytes)
        if chosen == "fused":
            from engine.experts.fused import FusedExperts

            warn_unused_slots(name, slots)
            return FusedExperts(source)
        from engine.experts.host_pool import pool_from_source
        from engine.experts.policy import BandwidthEstimate

        n = slots_from_spec(slots, total_experts=total, expert_bytes=expert_bytes, free_bytes=free)
        est = estimate or (BandwidthEstimate(bp=prof["bp"] or float("inf"), bh=prof["bh"],
                                             stream=prof.get("stream_read") or 0.0)
                           if prof else BandwidthEstimate())
        if checkpoint is not None:
            from engine.experts.safetensors_fill import pool_from_checkpoint

            pool = pool_from_checkpoint(checkpoint, source, progress=progress, background=background)
        else:
            pool = pool_from_source(source, progress=progress, background=background)
        return create_slot_backend(chosen, pool, n, device, estimate=est, stream_prefill=stream_prefill,
                                   slot_policy=slot_policy, decode=decode, prefetch=prefetch,
                                   lookahead=lookahead, refresh=refresh)

    return build


def _machine_profile(source) -> dict | None:
    """This machine's `bench bw` profile for the source's expert format, if one was measured."""
    import torch

    from engine.experts.profile import load_profile
    from engine.experts.block_layout import ExpertLayout

    layout = ExpertLayout(source.hidden_size, source.intermediate_size, source.dtype.itemsize)
    return load_profile(layout, source.dtype, torch.get_num_threads())
