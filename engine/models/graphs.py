"""Decode steps in batch-size buckets; on CUDA each bucket is a graph captured on first use and replayed.

    steps = DecodeSteps(fast, max_batch=8, capture=True)
    logits = steps.run(ids, slots, positions)      # lists of ints (ids may be a device tensor) -> [B, V] fp32,
                                                   # valid until the next run

A bucket holds its inputs in one int32 device tensor [4, b] (token ids, slots, positions, valid flags),
filled by one copy from (pinned) host memory; rows past the batch are padding (the pool's scratch slot,
routed to no expert). The same bucket shapes run with or without capture, so a replayed step and a
directly launched one compute bit-identical logits. Replay launches the whole step (hundreds of kernels)
at once and releases the GIL, so the proxy's event loop keeps running while the GPU works. With an expert
cache a step is one graph too when the cache is mapped (its kernels read missing experts in place; the host
keeps the cache before and after each replay, engine/experts/mapped.py), else several graphs, one per stretch
of device work between the cache's layers, the host running each layer's routed experts in between
(FastPath.decode_segments): one replay per layer instead of hundreds of launches.
"""
from __future__ import annotations

import gc
import logging

import torch

log = logging.getLogger("killick.engine")


def buckets_for(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class _Bucket:
    def __init__(self, fast, size: int, capture: bool):
        dev = fast.model.device
        self.fast, self.size, self.graph = fast, size, None
        self.segments: list[torch.cuda.CUDAGraph] = []  # with an expert cache: a graph between its layers
        self.calls: list = []  # the ExpertCall the host runs after segment i (its tensors live in the graphs)
        # two page-locked staging buffers used in turn: a chained step fills one while the step before may
        # not have copied the other yet (the engine reads a step's tokens before it queues the one after next)
        self.hosts = [torch.zeros(4, size, dtype=torch.int32, pin_memory=dev.type == "cuda") for _ in range(2)]
        self.stagings = [h.numpy() for h in self.hosts]  # written through numpy: a step's inputs cost microseconds
        self.turn = 0  # the buffer the last (or next, before any) step filled
        # after each buffer's last copy to the device (an event never recorded waits for nothing)
        self.copied = [torch.cuda.Event() for _ in range(2)] if dev.type == "cuda" else None
        self.inputs = torch.zeros(4, size, dtype=torch.int32, device=dev)
        self._pad(fast.pool.scratch, 0)
        self.inputs.copy_(self.host)
        if capture:
            self._capture(dev)

    def _capture(self, dev) -> None:
        fast = self.fast
        if fast.cached_experts:  # every row of a bucket is a real one (no padding): warm up and capture so
            self.staging[3] = 1  # the cache sees routed rows, as it will at every replay
            self.inputs.copy_(self.host)
        ids, slots, pos, valid = self.inputs
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile kernels, create handles, fill the caches, off the capture
            for _ in range(2):
                fast.decode(ids, slots, pos, valid)
        torch.cuda.current_stream(dev).wait_stream(side)
        if fast.cached_experts and fast.mapped is None:
            try:
                self._capture_segments(ids, slots, pos, valid)
            except RuntimeError as exc:  # the step then runs launched directly, as it did before graphs
                log.warning("decode step of %d rows: the graphs between the expert cache's layers could not "
                            "be captured (%s); launching it directly", self.size, exc)
                self.segments, self.calls = [], []
            return
        graph = torch.cuda.CUDAGraph()
        gc.collect()
        gc.disable()  # no finalizer (a freed pinned buffer, an unregistered pool) may run inside the capture
        try:
            # thread_local: an expert cache's CPU workers may touch CUDA meanwhile; that must not void it
            with torch.cuda.graph(graph, capture_error_mode="thread_local" if fast.cached_experts else "global"):
                self.logits = fast.decode_step(ids, slots, pos, valid)
        except RuntimeError as exc:
            if not fast.cached_experts:
                raise
            log.warning("decode step of %d rows through the mapped expert cache could not be captured (%s); "
                        "launching it directly", self.size, exc)
            return
        finally:
            gc.enable()
        self.graph = graph
        self.routes = fast.routes  # mapped expert cache: the step's routes, in the graph's memory

    def _capture_segments(self, ids, slots, pos, valid) -> None:
        """One graph per stretch of device work between expert-cache layers, all in one memory pool and
        replayed in capture order; each expert call's output comes back through one static buffer."""
        fast = self.fast
        model = fast.model
        self.y_in = torch.empty(self.size, model.config.hidden_size, dtype=model.dtype, device=model.device)
        steps, send, pool = fast.decode_segments(ids, slots, pos, valid), None, None
        while True:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                try:
                    call = steps.send(send)
                except StopIteration as done:
                    call, self.logits = None, done.value
            pool = pool or graph.pool()
            self.segments.append(graph)
            if call is None:
                return
            self.calls.append(call)
            send = self.y_in

    @property
    def host(self) -> torch.Tensor:
        return self.hosts[self.turn]

    @property
    def staging(self):
        return self.stagings[self.turn]

    def _pad(self, scratch: int, start: int) -> None:
        self.staging[:, start:] = 0
        self.staging[1, start:] = scratch

    def run(self, ids, slots: list[int], positions: list[int], scratch: int) -> torch.Tensor:
        """ids: a list of ints, or a tensor [n] (on the model's device: copied from there, nothing read back)."""
        n = len(slots)
        self.turn = k = self.turn ^ 1
        if self.copied is not None:
            self.copied[k].synchronize()  # (long done unless another launch came between two chained steps)
        st = self.staging
        if isinstance(ids, torch.Tensor) and ids.device != self.inputs.device:
            ids = ids.tolist()  # host-side ids (a CPU tensor for a CUDA model): through the pinned staging
        on_host = not isinstance(ids, torch.Tensor)
        st[0, :n], st[1, :n], st[2, :n], st[3, :n] = ids if on_host else 0, slots, positions, 1
        self._pad(scratch, n)
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied[k].record()
        if not on_host:
            self.inputs[0, :n].copy_(ids, non_blocking=True)
        if self.segments:
            self.segments[0].replay()  # (segments: the host's part runs inside, between the graphs)
            for call, graph in zip(self.calls, self.segments[1:]):
                self.y_in.copy_(call.run())
                graph.replay()
            return self.logits[:n]
        if self.graph is None:
            return self.fast.decode(*self.inputs)[:n]
        mapped = self.fast.mapped
        if mapped is not None:
            mapped.begin(n)
        self.graph.replay()
        if mapped is not None:
            mapped.end(self.routes, n)
        return self.logits[:n]


class DecodeSteps:
    """pad=False: a bucket for every batch size, no padding rows (an expert cache must not see them)."""

    def __init__(self, fast, max_batch: int, capture: bool, pad: bool = True):
        self.fast, self.capture = fast, capture
        self.sizes = buckets_for(max_batch) if pad else list(range(1, max_batch + 1))
        self._buckets: dict[int, _Bucket] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def modes(self) -> dict[int, str]:
        """How each bucket made so far runs: "graph" (one per step), "segments" (graphs between an expert
        cache's layers) or "direct" (launched directly: capture off, or it failed and was logged)."""
        return {size: "segments" if b.segments else "graph" if b.graph is not None else "direct"
                for size, b in sorted(self._buckets.items())}

    def reset(self) -> None:
        """Drop every bucket (graphs included): the next step of each size captures afresh (after an expert
        cache's slots were reallocated, which the graphs read in place)."""
        self._buckets.clear()

    def run(self, ids, slots: list[int], positions: list[int]) -> torch.Tensor:
        """ids: list of ints or an int tensor [n] (device: read in place by the step's input copy)."""
        size = next(s for s in self.sizes if s >= len(slots))
        if size not in self._buckets:
            self._buckets[size] = _Bucket(self.fast, size, self.capture)
        self.replays += self.capture
        return self._buckets[size].run(ids, slots, positions, self.fast.pool.scratch)
