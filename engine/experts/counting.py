"""Counting: what a layer call adds to the slot table (heat, recency) and to the stats (hits, fills, CPU runs).

A routed layer call counts itself as it runs (OffloadBackend.forward); a layer call that ran without reading its
routing back (a streamed layer's pieces, a wholly resident layer: device_runs.py) is counted at settle(), one host
sync for all of them after the forward's work is queued. A prompt's calls add heat by the tokens routed to each
expert (lru.prompt_use_weights), a decode's one use per expert. Admissions made outside a routed layer call
(idle refresh, the mapped decode) are copied in and counted as fills by place_admitted.

CallCounting is the part of OffloadBackend that counts; it reads the backend's cache, pool, stats_ and _count_looked,
and the forward's _unsettled and _sent, which settle() empties.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.experts.lru import prompt_use_weights


class CallCounting:
    def place_admitted(self, chosen) -> list[tuple[object, list[tuple[int, int, int]]]]:
        """Copy admissions (row, expert, slot) (admission.admissions) into their slots, one place() a layer in
        the order they come, counted as fills -> per layer (the event after its copies, None where they landed
        already: a CPU device; its (row, expert, slot))."""
        by_row: dict[int, list[tuple[int, int]]] = {}
        for row, e, slot in chosen:
            by_row.setdefault(row, []).append((e, slot))
        out = []
        for row, pairs in by_row.items():
            layer = self.pool.layers[row]
            done = self.cache.place(layer, [e for e, _ in pairs], [s for _, s in pairs])
            st = self.stats_[layer]
            st.fills += len(pairs)
            st.bytes_moved += len(pairs) * self.pool.expert_bytes
            out.append((done, [(row, e, s) for e, s in pairs]))
        return out

    def send_back(self) -> None:
        """Start the unsettled calls' routing on its way to the host without waiting for it: settle() then waits
        for the layers alone, not for what the caller queues after this (a prompt's head), and counts while the
        device runs that (on a CPU device the routing is the host's already)."""
        pending, self._unsettled = self._unsettled, []
        if not pending:
            return
        ids, landed = _routing(pending), None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
            ids = host
        self._sent.append((pending, ids, landed))

    def settle(self) -> None:
        """Count the layer calls a streamed forward, or a wholly resident layer, ran without reading their routing
        back (heat, recency, hits): one host sync for all of them, after the forward's work is queued. On the
        engine's thread only (it changes the slot table): end_forward, the next begin_forward, the last layer of
        a forward that was not held."""
        sent, self._sent = self._sent, []
        for pending, host, landed in sent:  # send_back's, in the order the calls ran
            if landed is not None:
                landed.synchronize()
            self._settle(pending, host.to(torch.long).numpy())
        pending, self._unsettled = self._unsettled, []
        if pending:
            # one read-back for all the calls; grouping each call's routing (Routing.of, one read-back apiece) took
            # ~40 ms after an 8k prompt's 32 pieces (H200 box), all of it before the first token
            self._settle(pending, _routing(pending).to("cpu", torch.long).numpy())

    def _settle(self, pending: list[tuple], flat: np.ndarray) -> None:
        """Count the calls of pending from flat, their routing read back one after another."""
        table, e = self.cache.table, self.pool.num_experts
        start = 0
        for layer, topk_ids, at, span in pending:
            ids = flat[start: start + topk_ids.numel()]
            start += topk_ids.numel()
            counts = np.bincount(ids[ids >= 0], minlength=e)  # id -1: a padding pair
            experts = np.flatnonzero(counts)
            table.note_use(self.pool.row[layer], experts, at=at, weights=self._use_weights(counts[experts], span))
            slots = self.cache.lookup(layer, experts)
            table.touch(slots[slots >= 0], clock=at[0])  # (a later layer's window may have taken some since)
            self._count(layer, len(experts), 0, 0, 0)
            self._count_looked(layer, experts)  # copies ahead into a layer that ran wholly resident

    def _use_weights(self, counts, span: int):
        """Heat per routed expert of a layer call: one use each in a decode (None), the tokens routed to it
        weighed as a prompt of `span` tokens' (lru.prompt_use_weights)."""
        if span <= 1:
            return None
        return prompt_use_weights(counts, span, half_life=self.cache.table.half_life)

    def _count(self, layer: int, hits: int, misses: int, fills: int, cpu: int) -> None:
        st = self.stats_[layer]
        st.hits += hits
        st.misses += misses
        st.fills += fills
        st.cpu_runs += cpu
        st.bytes_moved += fills * self.pool.expert_bytes


def _routing(pending: list[tuple]) -> torch.Tensor:
    """The routing of the calls of pending, one after another, flat (on the device)."""
    return torch.cat([ids.reshape(-1) for _, ids, _, _ in pending])
