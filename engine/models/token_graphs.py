"""A prompt's short runs (an extend's) padded to a token bucket, the work on them one CUDA graph a bucket.

    rule = BucketedRule(chunked_gated_delta_rule_fla, capture=True)
    o, state = rule(q, k, v, g, beta, state)        # the chunked rule's contract (engine/layers/delta_rule.py)
    route = BucketedRoute(route_cached, capture=True)
    call = route(mlp, h)                            # route_cached(mlp, h, None)'s ExpertCall (models/fast.py)
    mixer = BucketedMixer(chunked_gated_delta_rule_fla, capture=True)
    normed = mixer(i, m, proj, span)                # a DeltaNet layer's gated-norm rows (models/fast.py), or None

A 256-token extend after a cached prompt is host-bound between its MoE layer calls: the CPU's share of the next
layer waits while the host queues the layer's launches (an extend's DeltaNet layers took 2.2-2.4 ms of host time
between two calls on the H200 box, its attention layers 1.0; docs/PERF.md, issue 17). Two pieces of every layer
take many launches and hold no state a graph would have to know: fla's chunked rule (~10 Triton launches through
Python wrappers) and an expert-cache layer's routing with its shared expert (~10). A run of at most BUCKETS[-1]
tokens is copied into static buffers of the next bucket's size and the work runs there: as a graph captured on
the bucket's first use (capture=True, CUDA) or launched directly (capture=False: the same shapes, so the two give
the same bits). Longer runs go as they come: their launches are a small part of their time.

A DeltaNet layer of one sequence's run with no checkpoint inside it goes further (BucketedMixer): its gates, conv,
rule and gated norm, some twenty launches and the host's Python between them, are one graph a (layer, bucket) over
the layer's projected rows; the states go in and come out by copies, the projections stay outside (their matrix
products over the real rows keep the bits a run as it comes gets).

Padding rows: the rule's carry beta = 0 and g = 0, steps that leave the state as it is (decay exp(0) = 1, a
delta times 0), appended after the real rows, which no later row influences; the routing's are routed and
dropped (every row is routed on its own). The rule holds no weights: one graph a bucket serves every DeltaNet
layer; the routing's graphs are one a (layer, bucket), all of a bucket writing into one set of buffers (a layer's
routing is read within its call), so their memory does not grow with the layers.
"""
from __future__ import annotations

import gc
import logging

import torch

from engine.kernels.deltanet_prefill_triton import conv_prefill, prefill_gates
from engine.kernels.deltanet_triton import gated_norm
from engine.models.slots import SlotLinear

log = logging.getLogger("killick.engine")

BUCKETS = (64, 128, 256, 512, 1024)  # tokens a short run is padded to: the smallest bucket that holds it


def bucket_for(tokens: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= tokens), None)


def capture(fn, args: tuple, pool, what: str):
    """Warm fn(*args) up on a side stream (Triton compiles and autotunes outside the capture), then capture it
    -> (graph, its outputs), or None when capture failed (logged: the caller launches fn directly)."""
    dev = args[0].device
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # no finalizer (a freed pinned buffer) may run inside the capture; no gc.collect() first (decode graphs do,
    # once each at warm-up): a prompt's first run at a bucket captures a graph a layer, each a full collection
    gc.disable()
    try:
        # thread_local: an expert cache's CPU workers may touch CUDA meanwhile; that must not void it
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn(*args)
    except RuntimeError as exc:
        log.warning("%s could not be captured as a graph (%s); launching it directly", what, exc)
        return None
    finally:
        gc.enable()
    return graph, out


class _Graphs:
    """Graphs (or direct launches) by key, all in one memory pool (replayed one at a time, in stream order)."""

    def __init__(self, capture: bool, buckets: tuple[int, ...]):
        self.capture, self.buckets = capture, tuple(sorted(buckets))
        self._runs: dict[tuple, object] = {}
        self._pool = None

    def bucket(self, x: torch.Tensor) -> int | None:
        """The bucket for x's rows, None when they go as they come (too many, or inside another capture)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return bucket_for(x.shape[0], self.buckets)

    def _capture(self, run, fn, args: tuple, what: str) -> None:
        got = capture(fn, args, self._pool, what) if self.capture else None
        if got is not None:
            run.graph, run.out = got
            self._pool = self._pool or run.graph.pool()

    def modes(self) -> dict[int, str]:
        """How each bucket made so far runs: "graph", or "direct" (capture off, or it failed and was logged);
        a bucket with several keys (layers) reads "graph" only when all of them do."""
        out: dict[int, str] = {}
        for key, run in sorted(self._runs.items(), key=lambda item: item[0][0]):
            mode = "graph" if run.graph is not None else "direct"
            out[key[0]] = mode if out.get(key[0], mode) == mode else "direct"
        return out


class _RuleRun:
    """One bucket's static inputs, and its graph's outputs once captured."""

    def __init__(self, size: int, q, k, v, g, beta, state):
        dev = q.device
        # q | k | v side by side in one buffer, as the DeltaNet conv leaves them: one copy loads all three
        keys, values = q[0].numel(), v[0].numel()
        self.qkv = torch.zeros(size, 2 * keys + values, dtype=q.dtype, device=dev) if q.dtype == k.dtype == v.dtype \
            else None
        if self.qkv is not None:
            self.q, self.k, self.v = (t.view(size, *x.shape[1:]) for t, x in zip(
                self.qkv.split([keys, keys, values], dim=1), (q, k, v)))
        else:
            self.q, self.k, self.v = (torch.zeros(size, *x.shape[1:], dtype=x.dtype, device=dev) for x in (q, k, v))
        self.g = torch.zeros(size, g.shape[1], dtype=torch.float32, device=dev)
        self.beta = torch.zeros(size, beta.shape[1], dtype=beta.dtype, device=dev)
        self.state = torch.zeros(state.shape, dtype=torch.float32, device=dev)
        self.filled = 0  # rows of g and beta the last call wrote: padding past a shorter call must be zeroed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's (o, state)

    def load(self, q, k, v, g, beta, state) -> None:
        T = q.shape[0]
        rows = _side_by_side(q, k, v) if self.qkv is not None else None
        if rows is not None:
            self.qkv[:T].copy_(rows)
        else:
            for buf, x in ((self.q, q), (self.k, k), (self.v, v)):
                buf[:T].copy_(x)
        for buf, x in ((self.g, g), (self.beta, beta)):
            buf[:T].copy_(x)
        if self.filled > T:
            self.g[T : self.filled].zero_()
            self.beta[T : self.filled].zero_()
        self.filled = T
        self.state.copy_(state)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta, self.state


def _side_by_side(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The rows [T, 2*keys + values] that q, k and v are column slices of, in that order (the conv's output
    split into heads), or None when they are not."""
    T, keys, values = q.shape[0], q[0].numel(), v[0].numel()
    size = q.element_size()
    flat = all(x.stride(-1) == 1 and x[0].is_contiguous() for x in (q, k, v))
    if not (T and flat and q.stride(0) == k.stride(0) == v.stride(0) >= 2 * keys + values
            and k.data_ptr() == q.data_ptr() + keys * size and v.data_ptr() == k.data_ptr() + keys * size):
        return None
    return q.as_strided((T, 2 * keys + values), (q.stride(0), 1))


class BucketedRule(_Graphs):
    """rule: (q, k, v, g, beta, state) -> (o, state), the chunked rule's contract. capture: graphs (CUDA)."""

    def __init__(self, rule, capture: bool, buckets: tuple[int, ...] = BUCKETS):
        super().__init__(capture, buckets)
        self.rule = rule

    def __call__(self, q, k, v, g, beta, state):
        T, size = q.shape[0], self.bucket(q)
        if size is None:
            return self.rule(q, k, v, g, beta, state)
        key = (size, q.device, q.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, beta.dtype)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _RuleRun(size, q, k, v, g, beta, state)
            run.load(q, k, v, g, beta, state)
            self._capture(run, self.rule, run.inputs, f"the delta rule over {size} tokens")
        else:
            run.load(q, k, v, g, beta, state)
        if run.graph is not None:
            run.graph.replay()
            o, new = run.out
        else:
            o, new = self.rule(*run.inputs)
        # copies: the graph's buffers are the next call's, and a caller may keep the state it is handed
        return o[:T].clone(), new.clone()


class _RouteIO:
    """One bucket's static rows and the routing's outputs, shared by every layer's graph at that bucket (a
    layer's routing is read within its call, before the next layer's replays)."""

    def __init__(self, size: int, h: torch.Tensor):
        self.h = torch.zeros(size, h.shape[1], dtype=h.dtype, device=h.device)
        self.out = None  # (ids, w, shared or None): made like the first routing's outputs


class _Run:
    """One key's graph once captured, and what it returned (a BucketedRoute's ExpertCall, its tensors dropped: they
    are copied into _RouteIO.out inside the graph)."""

    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None


class BucketedRoute(_Graphs):
    """route: (mlp, h, valid) -> ExpertCall (fast.route_cached); called with every row real (a prompt's)."""

    def __init__(self, route, capture: bool, buckets: tuple[int, ...] = BUCKETS):
        super().__init__(capture, buckets)
        self.route = route
        self._io: dict[tuple, _RouteIO] = {}

    def __call__(self, mlp, h: torch.Tensor):
        """-> the ExpertCall of h's rows; its ids, w and shared stay valid until the next call at this bucket."""
        T, size = h.shape[0], self.bucket(h)
        if size is None:
            return self.route(mlp, h, None)
        io = self._io.get((size, h.device, h.dtype))
        if io is None:
            io = self._io[(size, h.device, h.dtype)] = _RouteIO(size, h)
        io.h[:T].copy_(h)
        key = (size, mlp.layer, h.device, h.dtype)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run()
            if self.capture:
                if io.out is None:
                    call = self.route(mlp, io.h, None)
                    io.out = tuple(None if t is None else torch.empty_like(t) for t in (call.ids, call.w, call.shared))
                self._capture(run, lambda x: _route_into(self.route(mlp, x, None), io.out), (io.h,),
                              f"layer {mlp.layer}'s routing of {size} tokens")
                if run.graph is not None:  # the graph's own outputs go back to its pool for later captures
                    run.out = run.out._replace(h=None, ids=None, w=None, shared=None)
        if run.graph is not None:
            run.graph.replay()
            ids, w, shared = io.out
            call = run.out._replace(ids=ids, w=w, shared=shared)
        else:
            call = self.route(mlp, io.h, None)
        shared = None if call.shared is None else call.shared[:T]
        return call._replace(h=h, ids=call.ids[:T], w=call.w[:T], shared=shared)


def _route_into(call, out: tuple):
    """Inside a route graph: the routing's outputs copied into the bucket's shared buffers."""
    for buf, t in zip(out, (call.ids, call.w, call.shared)):
        if buf is not None:
            buf.copy_(t)
    return call


class _MixerIO:
    """One bucket's static rows, states and outputs, shared by every DeltaNet layer's graph at that bucket (a
    layer's outputs are read within its call, before the next layer's replay)."""

    def __init__(self, size: int, proj: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, values: int):
        dev = proj.device
        self.proj = torch.zeros(size, proj.shape[1], dtype=proj.dtype, device=dev)
        self.conv = torch.zeros(conv.shape, dtype=conv.dtype, device=dev)  # the conv overwrites it: copied in each call
        self.rec = torch.zeros(rec.shape, dtype=torch.float32, device=dev)
        self.rows = torch.arange(size, device=dev)
        self.n = torch.zeros((), dtype=torch.long, device=dev)  # the call's real rows, read inside the graph
        self.normed = torch.zeros(size, values, dtype=proj.dtype, device=dev)
        self.state = torch.zeros(rec.shape, dtype=torch.float32, device=dev)


class BucketedMixer(_Graphs):
    """A prompt's DeltaNet layer between its two projections, for one sequence's run of at most BUCKETS[-1] rows
    with no checkpoint inside it (FastPath._deltanet_prefill's case of an extend): the gates (zero past the real
    rows), the conv, the chunked rule (rule: its contract) and the gated norm over the bucket's rows, one graph a
    (layer, bucket) when capture is on, else the same launches. The real rows' results are those of the layer run
    as it comes with a BucketedRule: the conv and the norm are row by row, the rule pads as that one does."""

    def __init__(self, rule, capture: bool, buckets: tuple[int, ...] = BUCKETS):
        super().__init__(capture, buckets)
        self.rule = rule
        self._io: dict[tuple, _MixerIO] = {}

    def __call__(self, layer: int, m, proj: torch.Tensor, span) -> torch.Tensor | None:
        """layer's fused weights m (FusedDeltaNet), its projected rows proj [n, P] and the Span of the sequence they
        are -> the gated norm's rows [n, Hv*dv] (valid until the next call at this bucket), the span's state moved
        on past them; None (nothing done) when the run is not one this takes."""
        n, size, state = proj.shape[0], self.bucket(proj), span.state
        inside = any(span.position < p <= span.position + span.length for p in span.checkpoint_positions)
        if size is None or inside or n < 2 or span.offset != 0 or span.length != n:  # (one row: the recurrent rule)
            return None
        c = m.consts
        C, values = 2 * c.key_heads * c.key_dim + c.value_heads * c.value_dim, c.value_heads * c.value_dim
        at = (size, proj.device, proj.dtype, proj.shape[1], state.conv.shape, state.recurrent.shape)
        io = self._io.get(at)
        if io is None:
            io = self._io[at] = _MixerIO(size, proj, state.conv, state.recurrent, values)
        io.proj[:n].copy_(proj)
        io.n.fill_(n)
        io.rec.copy_(state.recurrent)
        key = (size, layer, proj.device, proj.dtype)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run()
            # (the warm-up runs overwrite io.conv: the state goes in below, after them)
            self._capture(run, lambda *_: self._mix(m, io, C, values), (io.proj,),
                          f"DeltaNet layer {layer}'s gates, conv, rule and norm over {size} tokens")
        io.conv.copy_(state.conv)
        if run.graph is not None:
            run.graph.replay()
        else:
            self._mix(m, io, C, values)
        km1 = io.conv.shape[1]  # the conv state: the last K-1 inputs, of the earlier state where n < K-1
        last = io.proj[n - km1: n, :C].t() if n >= km1 else torch.cat([state.conv[:, n:], io.proj[:n, :C].t()], 1)
        _store(state, "conv", last)
        _store(state, "recurrent", io.state)
        return io.normed[:n]

    def _mix(self, m, io: _MixerIO, C: int, values: int) -> None:
        c, size = m.consts, io.proj.shape[0]
        beta, g = prefill_gates(io.proj, C + values, C + values + c.value_heads, c.neg_A, c.dt_bias)
        keep = (io.rows < io.n)[:, None]  # padding rows: beta = g = 0 leave the rule's state as it is
        beta, g = torch.where(keep, beta, 0.0), torch.where(keep, g, 0.0)
        kd = c.key_heads * c.key_dim
        q, k, v = conv_prefill(io.proj[:, :C], io.conv, m.conv_w).split([kd, kd, values], dim=-1)
        o, new = self.rule(q.reshape(size, c.key_heads, -1), k.reshape(size, c.key_heads, -1),
                           v.reshape(size, c.value_heads, -1), g, beta, io.rec)
        gated_norm(o.to(io.proj.dtype).reshape(size, values), io.proj, C, c, out=io.normed)
        io.state.copy_(new)


def _store(state, name: str, value: torch.Tensor) -> None:
    """state.<name> <- value's numbers: a slot state copies them into its slot; another keeps a copy of its own
    (value may be a view of a bucket's buffers)."""
    setattr(state, name, value if isinstance(state, SlotLinear) else value.clone(memory_format=torch.contiguous_format))
