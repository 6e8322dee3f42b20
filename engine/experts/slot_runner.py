"""A slot backend's device experts: routed experts whose weights sit in device slots, run where they are.

    runner = SlotRunner(cache)
    runner.run_grouped(x, y, routing, experts, slots, topk_ids)  # Routing.experts[experts] from `slots`, one
                                                                 # launch pair of the grouped Triton kernels
    runner.launch(x, y, ids)                                     # those kernels over each pair's slot ids [T, K]
    runner.launch_blocks(x, y, routing, experts, slots, (T, K))  # run_grouped's of a prompt: blocks made here
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
        from engine.kernels.moe_pairs_triton import GROUP_PAIRS

        if not experts:
            return
        if topk_ids.numel() >= GROUP_PAIRS:  # expert_blocks' mapping, made here from the routing the host holds
            self.launch_blocks(x, y, routing, experts, slots, topk_ids.shape)
            return
        lut = np.full(self.cache.pool.num_experts + 1, -1, dtype=np.int32)  # id -1 (routed nowhere): the extra -1
        lut[routing.experts[experts]] = slots
        self.launch(x, y, torch.from_numpy(lut).to(self.cache.device, non_blocking=True)[topk_ids])

    def launch_blocks(self, x: torch.Tensor, y: torch.Tensor, routing: Routing, experts: list[int], slots: list[int],
                      shape: tuple[int, int]) -> None:
        """run_grouped's launch pair with the blocks made on the host (host_blocks: a routed prompt's call), one
        upload, where launch's expert_blocks queues a score of small device ops for them."""
        from engine.kernels.moe_pairs_triton import GROUP_BLOCK, Blocks, host_blocks

        slots = np.asarray(slots, dtype=np.int64)
        by_slot = np.argsort(slots, kind="stable")  # runs in ascending slot, as expert_blocks orders its blocks
        chosen = np.asarray(experts, dtype=np.int64)[by_slot]
        pos, _ = routing.pairs(chosen)
        rows, expert = host_blocks(pos, routing.counts[chosen], slots[by_slot], GROUP_BLOCK)
        both = torch.from_numpy(np.concatenate((rows.reshape(-1), expert))).to(self.cache.device, non_blocking=True)
        self._run(x, y, None, Blocks(both[: rows.size].view(rows.shape), both[rows.size:]), shape)

    def launch(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> None:
        """The grouped kernels over the slots: ids [T, K] int32, each pair's slot (-1: not run here)."""
        from engine.kernels.moe_pairs_triton import blocks_for

        self._run(x, y, ids, blocks_for(ids, self.cache.num_slots), ids.shape)

    def _run(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None, blocks, shape: tuple[int, int]) -> None:
        from engine.kernels.moe_triton import run_experts

        T, K = shape
        ones = self._ones.get((T, K))
        if ones is None:
            ones = self._ones[T, K] = torch.ones(T, K, dtype=torch.float32, device=self.cache.device)
        act = torch.empty(T * K, self.cache.pool.layout.inter, dtype=x.dtype, device=self.cache.device)
        gate_up, down = self.cache.all_weights()
        run_experts(x.contiguous(), gate_up, down, ids, ones, blocks, out=(act, y.view(T, K, -1)))

    def run_one(self, x: torch.Tensor, y: torch.Tensor, routing: Routing, i: int, slot: int) -> None:
        """Routing.experts[i] from `slot`, one expert through torch."""
        pos = routing.position(i).to(self.cache.device, non_blocking=True)
        run_expert(y, x, pos, routing.top_k, *self.cache.weights(slot))
