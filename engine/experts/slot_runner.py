"""A slot backend's device experts: routed experts whose weights sit in device slots, run where they are.

    runner = SlotRunner(cache)
    runner.run_grouped(x, y, routing, experts, slots, topk_ids)  # Routing.experts[experts] from `slots`, one
                                                                 # launch pair of the grouped Triton kernels
    runner.launch(x, y, ids)                                     # those kernels over each pair's slot ids [T, K]
    runner.run_one(x, y, routing, i, slot)                       # one expert through torch (the reference)

T = tokens, K = experts per token, H = hidden. Each writes the unweighted expert outputs into the (token, k) rows
of y [T*K, H]; compute.combine weighs and sums them, as for the other paths.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.experts.compute import Routing, run_expert
from engine.experts.slot_cache import SlotCache


class SlotRunner:
    def __init__(self, cache: SlotCache) -> None:
        self.cache = cache
        self._ones: dict = {}  # (T, K) -> unit weights for the grouped kernels (combine weighs afterwards)

    def run_grouped(self, x: torch.Tensor, y: torch.Tensor, routing: Routing, experts: list[int], slots: list[int],
                    topk_ids: torch.Tensor) -> None:
        """Routing.experts[experts] from their `slots` in one launch pair. Each pair's slot is looked up on the
        device from the layer's expert -> slot table of this group (-1: not in it), so the host sends E int32s,
        not a gathered copy of the routing."""
        if not experts:
            return
        lut = np.full(self.cache.pool.num_experts + 1, -1, dtype=np.int32)  # id -1 (routed nowhere): the extra -1
        lut[routing.experts[experts]] = slots
        self.launch(x, y, torch.from_numpy(lut).to(self.cache.device, non_blocking=True)[topk_ids])

    def launch(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> None:
        """The grouped kernels over the slots: ids [T, K] int32, each pair's slot (-1: not run here)."""
        from engine.kernels.moe_pairs_triton import blocks_for
        from engine.kernels.moe_triton import run_experts

        T, K = ids.shape
        ones = self._ones.get((T, K))
        if ones is None:
            ones = self._ones[T, K] = torch.ones(T, K, dtype=torch.float32, device=self.cache.device)
        act = torch.empty(T * K, self.cache.pool.layout.inter, dtype=x.dtype, device=self.cache.device)
        gate_up, down = self.cache.all_weights()
        run_experts(x.contiguous(), gate_up, down, ids, ones, blocks_for(ids, self.cache.num_slots),
                    out=(act, y.view(T, K, -1)))

    def run_one(self, x: torch.Tensor, y: torch.Tensor, routing: Routing, i: int, slot: int) -> None:
        """Routing.experts[i] from `slot`, one expert through torch."""
        pos = routing.position(i).to(self.cache.device, non_blocking=True)
        run_expert(y, x, pos, routing.top_k, *self.cache.weights(slot))
