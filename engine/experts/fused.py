"""The reference expert backend: every routed expert resident on the model's device, run grouped by expert.

    backend = FusedExperts(source)
    backend.forward(layer, x [T, H], topk_ids [T, K], topk_w [T, K]) -> [T, H]   (sum of weighted experts)
    backend.stats() -> {"layers": {layer: {...}}, "total": {...}}
"""
from __future__ import annotations

import torch

from engine.experts.source import ExpertWeights
from engine.layers.mlp import swiglu_fused

_COUNTERS = ("hits", "misses", "fills", "cpu_runs", "bytes")


class FusedExperts:
    name = "fused"

    def __init__(self, source: ExpertWeights):
        self.source = source
        self._stats = {layer: dict.fromkeys(_COUNTERS, 0) for layer in source.layers}

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.source.stacked(layer)  # [E, 2I, H], [E, H, I]
        K = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
        tokens, weights = order // K, topk_w.reshape(-1)[order]
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                y = swiglu_fused(x[rows], gate_up[expert], down[expert])
                outs.append(y * weights[start : start + count, None])
            start += count
        # back to (token, slot) order, then sum the K slots; plain indexing instead of index_add_, which
        # parallelises even tiny sizes and crawls on an oversubscribed CPU
        per_slot = torch.empty(flat_ids.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        per_slot[order] = torch.cat(outs).to(x.dtype)
        out = per_slot.view(-1, K, x.shape[1]).sum(dim=1)
        self._stats[layer]["hits"] += sum(1 for c in counts if c)  # experts run this step, all resident
        return out

    def stats(self) -> dict:
        total = {c: sum(s[c] for s in self._stats.values()) for c in _COUNTERS}
        return {"backend": self.name, "layers": {k: dict(v) for k, v in self._stats.items()}, "total": total}
