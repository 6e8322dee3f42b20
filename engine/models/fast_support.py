"""Whether a loaded model can take the fast path, and building it (imports Triton only when it can).

The fast path needs Triton and a CUDA device (or Triton's CPU interpreter, TRITON_INTERPRET=1, which the
tests use) and head dims the kernels tile (powers of two). Routed experts either all resident (`fused`: decode
steps as CUDA graphs) or in an expert cache (offload / cpu / hybrid): mapped, the decode kernels read missing
experts in place from the host pool and a step is one graph; else the fast kernels around the cache, a decode
step as one graph per stretch between the cache's layers, which decide fills and CPU runs on the host.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.experts.registry import is_expert_cache

log = logging.getLogger("killick.engine")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fast_unsupported(model) -> str | None:
    """None when the fast path can serve `model`, else the reason in a sentence."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if model.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the fast path runs on CUDA (this model is on {model.device})"
    experts = getattr(model, "experts", None)
    if (experts is not None and not is_expert_cache(experts) and getattr(experts, "name", None) != "fused"
            and model.config.moe_layers):
        return f"the {experts.name} expert backend has no fast path"
    cfg = model.config
    dims = [cfg.head_dim] + ([cfg.linear_k_head_dim, cfg.linear_v_head_dim] if cfg.linear_num_v_heads else [])
    if not all(_pow2(d) for d in dims):
        return f"head dims {dims} are not all powers of two"
    return None


def make_fast_path(model, slots: int, capacity: int, graphs: bool | None):
    """-> (FastPath, DecodeSteps); graphs: capture decode steps as CUDA graphs (default: on CUDA).
    ValueError naming why when the model cannot take the fast path."""
    reason = fast_unsupported(model)
    if reason is not None:
        raise ValueError(f"the fast path is not available: {reason}")
    from engine.kernels.deltanet_triton import rule_tail
    from engine.models.fast import FastPath
    from engine.models.graphs import DecodeSteps
    from engine.models.slots import StatePool

    capture = model.device.type == "cuda" if graphs is None else graphs
    rule = prompt_rule(model, capture)
    # a prompt's last tokens past its first checkpoint: one launch, not a pass of the rule per checkpoint
    tail = rule_tail if model.device.type == "cuda" else None
    fast = FastPath(model, StatePool(model, slots, capacity), chunked_rule=rule, tail_rule=tail, capture=capture)
    if fast.cached_experts and fast.mapped is None:  # the host picks fills and CPU runs between graphs
        return fast, DecodeSteps(fast, slots, capture=capture, pad=False)
    return fast, DecodeSteps(fast, slots, capture)


def prompt_rule(model, capture: bool):
    """A prompt's chunked DeltaNet rule for the fast path: fla-core's kernels (a BucketedRule: short runs, an
    extend's, pad to a token bucket, replayed as one graph each when decode steps are; token_graphs.py), or None
    for the model's own torch rule. fla computes in TF32 inside: fp32 models (the verification dtype) keep the
    exact torch rule."""
    from engine.kernels import delta_rule_fla
    from engine.models.token_graphs import BucketedRule

    if model.dtype == torch.float32:
        return None
    if not delta_rule_fla.available():
        if model.device.type == "cuda":  # its host time, ~1.5 ms a DeltaNet layer of a prompt: extends ~10% slower
            log.warning("fla-core is not installed: a prompt's DeltaNet layers run the torch rule, slower on the "
                        "host (pip install 'killick[gpu]' installs it)")
        return None
    return BucketedRule(delta_rule_fla.chunked_gated_delta_rule_fla, capture)
