"""The chunked delta rule over short runs, padded to a token bucket and replayed as one CUDA graph a bucket.

    rule = BucketedRule(chunked_gated_delta_rule_fla, capture=True)
    o, state = rule(q, k, v, g, beta, state)        # the chunked rule's contract (engine/layers/delta_rule.py)

A 256-token extend runs fla's chunked rule once in each DeltaNet layer, and one call is ~10 Triton launches
through Python wrappers: ~1 ms of the host's time a layer on the H200 box (docs/PERF.md, issue 17), while the
CPU's share of the next MoE layer waits for that layer's routing. A run of at most BUCKETS[-1] tokens is copied
into static buffers of the next bucket's size, its padding rows with beta = 0 and g = 0 (steps that leave the
state as it is: decay exp(0) = 1, a delta times 0; appended after the real rows, which no later row influences),
and the rule runs there, as a graph captured on the bucket's first use (capture=True, CUDA) or launched directly
(capture=False: the same shapes, so the two give the same result). Longer runs call the rule as they come: their
launches are a small part of their time. The rule holds no weights, so one graph serves every DeltaNet layer.
"""
from __future__ import annotations

import gc
import logging

import torch

log = logging.getLogger("killick.engine")

BUCKETS = (64, 128, 256, 512, 1024)  # tokens a short run is padded to: the smallest bucket that holds it


class _Run:
    """One bucket's static inputs, and its graph's outputs once captured."""

    def __init__(self, size: int, q, k, v, g, beta, state):
        dev = q.device
        self.q = torch.zeros(size, *q.shape[1:], dtype=q.dtype, device=dev)
        self.k = torch.zeros(size, *k.shape[1:], dtype=k.dtype, device=dev)
        self.v = torch.zeros(size, *v.shape[1:], dtype=v.dtype, device=dev)
        self.g = torch.zeros(size, g.shape[1], dtype=torch.float32, device=dev)
        self.beta = torch.zeros(size, beta.shape[1], dtype=beta.dtype, device=dev)
        self.state = torch.zeros(state.shape, dtype=torch.float32, device=dev)
        self.filled = 0  # rows of g and beta the last call wrote: padding past a shorter call must be zeroed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's (o, state)

    def load(self, q, k, v, g, beta, state) -> None:
        T = q.shape[0]
        for buf, x in ((self.q, q), (self.k, k), (self.v, v), (self.g, g), (self.beta, beta)):
            buf[:T].copy_(x)
        if self.filled > T:
            self.g[T : self.filled].zero_()
            self.beta[T : self.filled].zero_()
        self.filled = T
        self.state.copy_(state)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta, self.state


class BucketedRule:
    """rule: (q, k, v, g, beta, state) -> (o, state), the chunked rule's contract. capture: graphs (CUDA)."""

    def __init__(self, rule, capture: bool, buckets: tuple[int, ...] = BUCKETS):
        self.rule, self.capture, self.buckets = rule, capture, tuple(sorted(buckets))
        self._runs: dict[tuple, _Run] = {}
        self._pool = None  # one memory pool for every bucket's graph (replayed one at a time, in stream order)

    def __call__(self, q, k, v, g, beta, state):
        T = q.shape[0]
        size = next((b for b in self.buckets if b >= T), None)
        if size is None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.rule(q, k, v, g, beta, state)
        key = (size, q.device, q.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, beta.dtype)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(size, q, k, v, g, beta, state)
            run.load(q, k, v, g, beta, state)
            if self.capture:
                self._capture(run)
        else:
            run.load(q, k, v, g, beta, state)
        if run.graph is not None:
            run.graph.replay()
            o, new = run.out
        else:
            o, new = self.rule(*run.inputs)
        # copies: the graph's buffers are the next call's, and a caller may keep the state it is handed
        return o[:T].clone(), new.clone()

    def modes(self) -> dict[int, str]:
        """How each bucket made so far runs: "graph", or "direct" (capture off, or it failed and was logged)."""
        return {key[0]: "graph" if run.graph is not None else "direct" for key, run in sorted(
            self._runs.items(), key=lambda item: item[0][0])}

    def _capture(self, run: _Run) -> None:
        """Warm up (Triton compiles and autotunes outside the capture) and capture the rule on run's buffers;
        on failure the bucket runs launched directly, as without capture."""
        dev = run.q.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.rule(*run.inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        gc.collect()
        gc.disable()  # no finalizer (a freed pinned buffer) may run inside the capture
        try:
            # thread_local: an expert cache's CPU workers may touch CUDA meanwhile; that must not void it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.rule(*run.inputs)
        except RuntimeError as exc:
            log.warning("the delta rule over %d tokens could not be captured as a graph (%s); launching it "
                        "directly", run.q.shape[0], exc)
            return
        finally:
            gc.enable()
        self._pool = self._pool or graph.pool()
        run.graph, run.out = graph, out
