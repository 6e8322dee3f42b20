"""Device runs: the experts of a layer call that run on the device, from their slots.

Hits run from their slots while the fills copy in, then the fills run: with `grouped` (the default on CUDA) in
two launch pairs of the grouped Triton kernels reading the slots in place (one pair after the copies in a prompt's
call with a CPU job, which the layer waits for anyway); else, and when the fills go in rounds (a cache smaller than
one step's experts), one expert at a time through torch (slot_runner.py). A layer with every
expert in a slot (streamed, or wholly resident in a routed prompt) runs without reading its routing back, counted
later at settle() (counting.py).

DeviceRuns is the part of OffloadBackend that queues them; it reads the backend's cache, runner, pool, grouped,
keep_bonus, handoff_clock, call_log, settle, _unlock, _behind, _looking_ahead, _ahead_plan, _copy_ahead,
_mark_enter, _mark_exit and _log_call, and the forward's _unsettled, _span, _looked and _held; it sets
_fill_run_s.
"""
from __future__ import annotations

import time

import torch

from engine.experts.compute import Routing
from engine.experts.cpu_jobs import PROMPT_TOKENS
from engine.experts.slot_cache import COALESCE_FILLS


class DeviceRuns:
    def _forward_unread(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                        slots: torch.Tensor, t_in: float):
        """A layer with every expert in a slot — streamed, or in a routed prompt wholly resident (after a streamed
        prompt: the layers of the windows it keeps and its last two) — has nothing to fill or run on the CPU, so
        its routing need not come back to the host: the pairs look their slots up on the device (slots: the
        layer's expert -> slot table [E + 1], entry E -1 for padding) and run in one launch pair of the grouped
        kernels, the call is counted at settle(), and the host goes on to queue the next layer while the device
        works. Reading each piece's routing back made the host wait for that piece's compute, so it could not
        queue the next piece, and a layer of an 8k prompt took several times its GPU time (H200 box, docs/PERF.md
        issue 17). In a routed prompt the next layer's copies ahead may then take this layer's slots, behind its
        kernels: the first layer of an extend after a streamed prompt is one such, and its locked slots left the
        copy engine idle until the second layer's routing (H200 box, docs/PERF.md twenty-fourth session)."""
        entered = time.perf_counter()  # (the call's begin and its slot table done: the call log's 'planned')
        self._mark_enter(layer)  # (a routed prompt's: the device's gap before it counts in the CPU's handoff)
        self.handoff_clock.read_gaps()  # those done by now, without waiting
        out = self.runner.unread(x, topk_ids, topk_w, slots)
        ran = time.perf_counter()
        # a copy: read at settle(), after the caller may have reused its tensor (token_graphs.BucketedRoute's
        # graph writes a layer's routing of every piece of a prompt into the same buffer)
        self._unsettled.append((layer, topk_ids.clone(), self.cache.table.moment(), self._span))
        behind = self._behind() if self._looking_ahead() else 0
        ahead = self._ahead_plan(layer, behind)  # None in a streamed forward
        if ahead and len(ahead[1]):
            self._copy_ahead(ahead[0], ahead[1], with_cpu=False, after=self.cache.mark())  # after this layer's reads
        queued = time.perf_counter()
        self._unlock()  # as a layer call ends: the copies' slots are the next layer's to plan with
        self._mark_exit(layer)
        if layer == self.pool.layers[-1] and not self._held:
            self.settle()
        if self.call_log is not None:
            self._log_call(layer, "unread", t_in, -1, 0, 0, 0, len(self._looked.get(ahead[0], ())) if ahead else 0,
                           behind, planned=entered, ran=ran, queued=queued)
        return out

    def _run_device(self, layer, x, y, routing: Routing, hit_slots, hits, fills, with_cpu: bool,
                    topk_ids: torch.Tensor) -> bool:
        """Hits from their slots; fills copied (overlapping the hits' compute) then run. When the cache
        is smaller than one step's experts, fills go in rounds, each reusing the slots of the last (-> True).
        with_cpu: this call's CPU runs go on alongside the copies (kept with their timing)."""
        want = routing.experts[fills].tolist()
        # before the hits run: copies overlap them; many fills (an extend's tokens) copy in sorted runs
        coalesce = len(want) > COALESCE_FILLS
        admitted = self.cache.admit(layer, want, with_cpu=with_cpu, coalesce=coalesce, bonus=self.keep_bonus(layer))
        if self.grouped and len(admitted) == len(fills) and x.dtype == self.pool.dtype:
            if fills and with_cpu and x.shape[0] >= PROMPT_TOKENS:
                # a prompt's CPU job runs meanwhile and the layer's output waits for it: hits and fills in one launch
                # pair once the fills are in (one launch_blocks fewer, ~0.8 ms of the engine thread on the H100 box,
                # before it queues the layers after this one; the device computes the hits after the copies)
                self.cache.ready()
                self.runner.run_grouped(x, y, routing, hits + fills, hit_slots + admitted, topk_ids)
                return False
            self.runner.run_grouped(x, y, routing, hits, hit_slots, topk_ids)  # overlapping the copies
            self.cache.ready()
            self.runner.run_grouped(x, y, routing, fills, admitted, topk_ids)
            return False
        for i, s in zip(hits, hit_slots):
            self.runner.run_one(x, y, routing, i, s)
        done = 0
        while True:
            self.cache.ready()
            t0 = time.perf_counter()
            for j, s in enumerate(admitted):
                self.runner.run_one(x, y, routing, fills[done + j], s)
            self._fill_run_s = time.perf_counter() - t0 if self.cache.copy_stream is None else 0.0
            done += len(admitted)
            if done == len(fills):
                return done > len(admitted)
            self._unlock()
            admitted = self.cache.admit(layer, want[done:], with_cpu=with_cpu, coalesce=coalesce,
                                        bonus=self.keep_bonus(layer))
            if not admitted:
                raise RuntimeError("no unlocked expert slot left for a fill")
