"""A slot backend's device experts: routed experts whose weights sit in device slots, run where they are.

    runner = SlotRunner(cache)
    runner.run_grouped(x, y, routing, experts, slots, topk_ids)  # Routing.experts[experts] from `slots`, one
                                                                 # launch pair of the grouped Triton kernels
    runner.launch(x, y, ids)                                     # those kernels over each pair's slot ids [T, K]
    runner.launch_blocks(x, y, routing, experts, slots, (T, K))  # run_grouped's of a prompt: blocks made here
    out = runner.unread(x, ids, w, table)                         # a wholly resident layer, weighed and summed
    runner.run_one(x, y, routing, i, slot)                       # one expert through torch (the reference)

T = tokens, K = experts per token, H = hidden. Each writes the unweighted expert outputs into the (token, k) rows
of y [T*K, H]; compute.combine weighs and sums them, as for the other paths (unread does both).

A prompt's wholly resident layer (an extend's first and last ones after a streamed prompt) queues a dozen device
ops for its experts, four of them Triton launches of some thirty arguments, while the CPU's next job or the
extend's end waits for the host (docs/PERF.md issue 17). With `prompt_graphs` on (a fast path's), unread runs of
PROMPT_TOKENS to a token bucket's rows (and GROUP_PAIRS pairs or more) go padded to the bucket (token_graphs.BUCKETS,
padding pairs routed nowhere) through one CUDA graph a bucket for every such layer (capture: the slots hold them
all, the table copied in says which), or the same launches; the real rows' results do not depend on the padding:
the pairs routed nowhere sort past the others, which keep their blocks, and each pair's row is its own.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.experts.compute import Routing, combine, run_expert
from engine.experts.cpu_jobs import PROMPT_TOKENS
from engine.experts.slot_cache import SlotCache


class _UnreadIO:
    """One bucket's static inputs of unread runs, and its graph with its output once captured."""

    def __init__(self, size: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor):
        self.x = torch.zeros(size, x.shape[1], dtype=x.dtype, device=x.device)
        self.ids = torch.full((size, ids.shape[1]), -1, dtype=ids.dtype, device=x.device)  # padding: routed nowhere
        self.w = torch.zeros(size, w.shape[1], dtype=w.dtype, device=x.device)
        self.table = torch.full(table.shape, -1, dtype=table.dtype, device=x.device)
        self.filled = 0  # rows of ids the last call wrote: those past a shorter call's go back to -1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class SlotRunner:
    def __init__(self, cache: SlotCache) -> None:
        self.cache = cache
        self._ones: dict = {}  # (T, K) -> unit weights for the grouped kernels (combine weighs afterwards)
        self.bucketed = self.capture = False  # prompt_graphs
        self._io: dict[tuple, _UnreadIO] = {}
        self._pool = None

    def prompt_graphs(self, capture: bool) -> None:
        """unread's prompt runs from now on padded to a token bucket, one graph a bucket when capture (CUDA)."""
        self.bucketed, self.capture = True, bool(capture)

    def unread_modes(self) -> dict[int, str]:
        """How unread's bucketed runs go by token bucket so far: "graph", or "direct" (capture off or failed)."""
        return {key[0]: "graph" if io.graph is not None else "direct" for key, io in sorted(self._io.items(),
                                                                                           key=lambda kv: kv[0][0])}

    def unread(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """A layer with every expert in a slot: x [T, H], ids [T, K] expert ids (-1: padding, left out), w [T, K],
        table [E + 1] int32 each expert's slot (entry E -1) -> the weighed sum of each row's experts [T, H]."""
        from engine.kernels.moe_pairs_triton import GROUP_PAIRS
        from engine.models.token_graphs import BUCKETS, bucket_for, capture

        T = x.shape[0]
        # (fewer pairs than GROUP_PAIRS run in another mapping than the bucket's, with other bits)
        size = bucket_for(T, BUCKETS) if self.bucketed and T >= PROMPT_TOKENS and ids.numel() >= GROUP_PAIRS \
            else None
        if size is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._unread(x, ids, w, table)
        key = (size, x.device, x.dtype, x.shape[1], ids.shape[1], ids.dtype, w.dtype, table.shape[0])
        io = self._io.get(key)
        if io is None:
            io = self._io[key] = _UnreadIO(size, x, ids, w, table)
            if self.capture:
                got = capture(lambda *_: self._unread(io.x, io.ids, io.w, io.table), (io.x,), self._pool,
                              f"an unread layer's experts over {size} tokens")
                if got is not None:
                    io.graph, io.out = got
                    self._pool = self._pool or io.graph.pool()
        io.x[:T].copy_(x)
        io.ids[:T].copy_(ids)
        if io.filled > T:
            io.ids[T: io.filled].fill_(-1)
        io.filled = T
        io.w[:T].copy_(w)
        io.table.copy_(table)
        if io.graph is None:
            return self._unread(io.x, io.ids, io.w, io.table)[:T]
        io.graph.replay()
        return io.out[:T].clone()  # (the graph's output is the next replay's)

    def _unread(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        y = x.new_zeros(ids.numel(), x.shape[1])  # padding pairs are left unwritten and must read zero
        self.launch(x, y, table[ids])  # id -1 (padding) looks up -1
        return combine(y, w)

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
