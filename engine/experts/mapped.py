"""Decode through an expert cache in one graph: missing experts are read in place from the pinned host pool.

The decode step's expert kernels take, per MoE layer, a location table on the device (loc [L, E+1] int32,
moe_pairs_triton.ExpertMap): a slot id where the expert sits in a device slot, LOC_HOST where it does not (the
kernel reads its weights from the page-locked host pool over PCIe, no copy first), LOC_SHARED for entry E
(the shared expert). Routing, every expert and the rest of the step run on the device without the host, so
the step is one CUDA graph, as with every expert resident; a miss costs its bytes at PCIe speed inside the
kernel instead of a host round trip, a copy and a launch.

The host keeps the cache between steps (`begin` before a step, `end` after it):
- it reads each step's routes back (one copy) and, once the next step is queued, while the device runs it,
  counts per layer hits, misses and in-place reads, with the heat and recency the slot policy evicts by;
- it admits a missed expert into a slot (copy stream) when the slot is free or the expert is hotter than the
  victim by admission.ADMIT_RATIO: a copy costs what one in-place read costs, so only experts used again
  repay it — under uniform routing almost none are, under skewed routing the popular ones move in and stay;
- an admitted expert's entry switches to its slot at the first step after its copy landed; an evicted one's
  goes back to LOC_HOST in the same push that precedes the next step (its slot's copy waits for the work
  already queued, so no kernel reads a slot while it is overwritten).
The table is derived from the slot table each begin (plus the fills still in flight), so the prefill path's
own fills and evictions (OffloadBackend.forward) need no bookkeeping here. With a hybrid backend a share of
the non-resident experts is marked LOC_CPU: a native thread runs those inside the step (graph_cpu.py).

With prefetch (--moe-prefetch, on by default for a mapped decode on CUDA) the step guesses, at the end of each
layer, the next layer's likely expert among those read in place (its router on the hidden state before the next
layer's mixer) and copies part of that expert's gate/up weights (stage_rows) to the device on a side stream
while the mixer runs: the PCIe link idles through a layer's attention or DeltaNet, and a right guess spends
that time on bytes the layer needs (`stage`, stage_triton.stage_guess). The layer's experts wait for the pick
only; a staged gate/up tile waits inside the kernel for the copy's done count (stage_done), so a copy that
outlasts the mixer overlaps the layer's other reads instead of holding them back. The first cache layer is
never guessed. Guesses, right ones and their bytes are counted per layer (docs/PERF.md: fourteenth and
twentieth sessions).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.experts import admission
from engine.kernels.moe_pairs_triton import LOC_HOST, LOC_SHARED, ExpertMap
from engine.kernels.stage_triton import stage_guess


def stage_rows(inter: int) -> int:
    """Rows of the gate and of the up projection a guess prefetches: about half of them (in whole 64-row decode
    tiles) where experts are wide, so the copy fits the ~68 us a layer's mixer leaves the link idle (the whole
    4 MB gate/up took longer, and the layer's experts waited for it: H200 box, docs/PERF.md thirteenth
    session); all of them for narrow experts."""
    return inter if inter < 128 else max(64, inter // 2 // 64 * 64)


class MappedExperts:
    def __init__(self, backend) -> None:
        self.b = backend
        pool, cache = backend.pool, backend.cache
        self.L, self.E = len(pool.layers), pool.num_experts
        cuda = cache.device.type == "cuda"
        self.loc = torch.full((self.L, self.E + 1), LOC_HOST, dtype=torch.int32, device=cache.device)
        self.loc[:, self.E] = LOC_SHARED
        self._staging = torch.full((self.L, self.E + 1), LOC_HOST, dtype=torch.int32, pin_memory=cuda)
        self._staging[:, self.E] = LOC_SHARED
        self._pushed: np.ndarray | None = None  # [L, E] what the kernels read since the last push
        self._push_done = None  # CUDA event after the last push (the staging buffer is free again)
        self._pending: list[tuple[object, list[tuple[int, int, int]]]] = []  # (copy done, [(row, expert, slot)])
        # (host [L, N, KP] int32, event, rows, the table it ran with) of the last step: taken in at the next end
        self._routes = None
        self._last_step = None  # (event, rows) of the last step, for the CPU share's begin
        self._route_host: dict = {}
        self._flip = 0  # which of two host buffers the next step's routes go to
        self._placements, self._own = cache.placements, 0  # own: placements made here since begin() looked
        self._maps: dict[int, ExpertMap] = {}
        self.cpu = None  # graph_cpu.CpuShare: a hybrid backend's CPU share inside the step (enable_cpu)
        # prefetch: each layer's staged expert (-1 none) [L] int32, one device buffer for its gate/up (a layer's
        # guess is copied after the layer before has read its own), the pinned pair its ids come back through
        self.prefetch = bool(getattr(backend, "prefetch", False))
        self.stage_ids = torch.full((self.L,), -1, dtype=torch.int32, device=cache.device)
        self.stage_done = torch.zeros(self.L, dtype=torch.int32, device=cache.device)  # the copies' done counts
        self.stage_gate_up = None
        self._stage_host: list[torch.Tensor] = []
        self._stage_flip = 0
        self._host_gate_up: dict[int, torch.Tensor] = {}
        self.stage_rows = None
        if self.prefetch:
            self._stage_host = [torch.full((self.L,), -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
            lay = pool.layout
            self.stage_gate_up = torch.empty(2 * lay.inter, lay.hidden, dtype=pool.dtype, device=cache.device)
            self.stage_rows = stage_rows(lay.inter)

    def enable_cpu(self, n_max: int, kp: int, dtype: torch.dtype, share: float | None = None, tag: str = ""):
        """A hybrid backend: run a share of the misses on the CPU inside the step's graph (graph_cpu.py) for
        steps of up to n_max tokens with kp pairs each (tag: the model's, for the settled shares' key). Returns
        the CpuShare, or None (and one log line) where it cannot run here: the step then reads every miss over
        PCIe, as offload does."""
        from engine.experts import graph_cpu

        why = graph_cpu.available(self.b, dtype)
        if why is not None:
            if self.b.name == "hybrid":
                graph_cpu.log.warning("hybrid decode without its CPU share (%s): misses go over PCIe", why)
            return None
        if self.cpu is None:
            self.cpu = graph_cpu.CpuShare(self.b, n_max, kp, dtype, share, tag=tag)
            self._pushed = None  # the next push marks the CPU's experts
        return self.cpu

    def row(self, layer: int) -> int:
        return self.b.pool.row[layer]

    def folds(self, mlp) -> bool:
        """Whether a CachedMoE's shared expert runs as the kernels' pair K (its width is the routed ones')."""
        lay = self.b.pool.layout
        gu = mlp.shared_gate_up
        return gu is not None and gu.shape == (2 * lay.inter, lay.hidden) and gu.dtype == self.b.pool.dtype \
            and gu.is_contiguous() and mlp.shared_down.is_contiguous()

    def reset(self) -> None:
        """The slot table was rebuilt (a resize, which lets every copy land first): forget what was pushed."""
        self._pending, self._pushed, self._routes, self._last_step = [], None, None, None

    def staged(self, layer: int) -> bool:
        """Whether the step prefetches a guess for `layer` (every cache layer but the first)."""
        return self.prefetch and self.row(layer) > 0

    def layer_map(self, layer: int, shared_gate_up=None, shared_down=None) -> ExpertMap:
        """The kernels' view of `layer`: its row of the table, the host pool's views, the shared expert, and
        its staged expert where the step prefetches one."""
        if layer not in self._maps:
            lay, pool = self.b.pool.layout, self.b.pool
            host = pool.wait_layer(layer)  # [E, numel]
            row = pool.row[layer]
            stage = (self.stage_ids[row: row + 1], self.stage_gate_up, self.stage_rows, self.stage_done[row: row + 1]) \
                if self.staged(layer) else (None, None, None, None)
            self._maps[layer] = ExpertMap(self.loc[row], self._gate_up(layer),
                                          host[:, lay.gate_up_numel:].view(-1, lay.hidden, lay.inter),
                                          shared_gate_up, shared_down, *stage)
        return self._maps[layer]

    def _gate_up(self, layer: int) -> torch.Tensor:
        """The layer's pinned host gate/up weights [E, 2I, H] (views of the pool)."""
        if layer not in self._host_gate_up:
            lay = self.b.pool.layout
            host = self.b.pool.wait_layer(layer)
            self._host_gate_up[layer] = host[:, : lay.gate_up_numel].view(-1, 2 * lay.inter, lay.hidden)
        return self._host_gate_up[layer]

    def stage(self, layer: int, logits: torch.Tensor, valid: torch.Tensor, picked=None) -> None:
        """Inside the step, before `layer` runs: its likely expert read in place (by logits [N, E], a guess at
        its routing) copied to the device for its gate/up kernel (stage_triton.stage_guess; picked() runs
        between the pick and the copy)."""
        row = self.row(layer)
        stage_guess(logits, valid, self.loc[row], self._gate_up(layer), self.stage_ids[row: row + 1],
                    self.stage_gate_up, self.stage_rows, self.stage_done[row: row + 1], picked)

    # --- around each step
    def begin(self, rows: int | None = None) -> None:
        """Before a step (of `rows` sequences, where known): commit the fills that landed, push the table if it
        changed (and with a CPU share, time the last step). Host work only, tens of microseconds."""
        if self._last_step is not None:
            done, n = self._last_step
            self._last_step = None
            if self.cpu is not None:
                if done is not None:
                    done.synchronize()
                self.cpu.after_step(n)
        cache = self.b.cache
        if cache.placements != self._placements + self._own:
            cache.ready()  # the prefill path filled slots: the step reads them after its copies
        self._placements, self._own = cache.placements, 0
        self._commit()
        if self.cpu is not None:
            self.cpu.wake()
            if rows is not None:
                self.cpu.before_step(rows)
        self._push()

    def end(self, routes: torch.Tensor, rows: int) -> None:
        """After a step was queued: its routes [L, N, KP] int32 (device) start back to the host, and the last
        step's are taken in (stats, heat, admissions) while the device runs this one: taken in before this
        step instead (at its begin), their ~0.6 ms of host work a step sat between two steps with the device
        idle (H200 box, offload decode b1: 8% of a step). rows: the real sequences (padding rows route nowhere
        anyway). An admission made here copies after this step's work (it may read the victim's slot); the
        next begin's push already reads the victim in place and the newcomer only once it landed."""
        cache = self.b.cache
        staged = None
        if self.prefetch:
            self._stage_flip ^= 1  # two buffers in turn, as the routes': the last step's is read after this copy
            staged = self._stage_host[self._stage_flip]
            staged.copy_(self.stage_ids, non_blocking=True)
        if cache.device.type == "cuda":
            host = self._routes_buffer(routes)
            host.copy_(routes, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = routes.clone(), None
        last, self._routes, self._last_step = self._routes, (host, done, rows, self._pushed, staged), (done, rows)
        if last is not None:
            self._take_in(last)

    def observe_last(self) -> None:
        """Take in the last step's routes now, not at the next step's end: its counts, and the admissions they
        make (which the next begin pushes)."""
        last, self._routes = self._routes, None
        if last is not None:
            self._take_in(last)

    def _take_in(self, routes) -> None:
        host, done, n, seen, staged = routes
        if done is not None:
            done.synchronize()
        self._observe(host[:, :n].numpy(), seen, None if staged is None else staged.numpy())

    def _routes_buffer(self, routes: torch.Tensor) -> torch.Tensor:
        """Pinned host buffers per routes shape (one pair per decode bucket: pinning costs far more than a step),
        used in turn: a step's routes arrive while the host still reads the last step's."""
        self._flip ^= 1
        key = (routes.shape, self._flip)
        buf = self._route_host.get(key)
        if buf is None:
            buf = self._route_host[key] = torch.empty(routes.shape, dtype=routes.dtype, pin_memory=True)
        return buf

    # --- the cache between steps (the rules: admission.py, which bench routing simulates)
    def _observe(self, routes: np.ndarray, seen: np.ndarray | None, staged: np.ndarray | None = None) -> None:
        """routes [L, N, KP] of a step that ran with the table `seen` (None: none pushed yet, the slot table's
        view) and staged [L] (its prefetched expert per layer, -1 none; None without prefetch): count, heat,
        and admit the hottest misses."""
        b = self.b
        seen = seen if seen is not None else self._table()
        gate_up_bytes = b.pool.layout.gate_up_numel * b.pool.dtype.itemsize
        candidates = []
        for row, layer in enumerate(b.pool.layers):
            step = admission.observe_layer(b.cache.table, row, routes[row], seen[row])
            st = b.stats_[layer]
            st.hits += step.hits
            st.misses += step.misses
            st.cpu_runs += step.cpu
            st.direct_reads += step.reads
            st.bytes_read += step.reads * b.pool.expert_bytes
            if staged is not None and staged[row] >= 0:
                st.guesses += 1
                st.guesses_right += bool((routes[row] == staged[row]).any())
                st.bytes_guessed += gate_up_bytes
            candidates += step.candidates
        placed = b.place_admitted(admission.admissions(b.cache.table, candidates))
        self._own += len(placed)
        self._pending += placed

    def _commit(self) -> None:
        """Fills whose copies landed become readable from their slots (the next push says so)."""
        self._pending = [(done, fills) for done, fills in self._pending if done is not None and not done.query()]

    def _table(self) -> np.ndarray:
        """[L, E] int32: each expert's slot, LOC_HOST where it is not resident or its copy is in flight."""
        return admission.visible(self.b.cache.table, [f for _, fills in self._pending for f in fills])

    def _push(self) -> None:
        want = self._table()
        if self.cpu is not None:
            want = self.cpu.mark(want)
        if self._pushed is not None and np.array_equal(want, self._pushed):
            return
        if self._push_done is not None:
            self._push_done.synchronize()  # the last push may still be reading the staging buffer
        self._staging.numpy()[:, : self.E] = want
        self.loc.copy_(self._staging, non_blocking=True)
        if self.loc.is_cuda:
            self._push_done = torch.cuda.Event()
            self._push_done.record()
        self._pushed = want
