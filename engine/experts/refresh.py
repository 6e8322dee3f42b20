"""Idle refresh: between requests, the hottest experts not in a slot move into the slots the policy evicts first.

A streamed prompt leaves whole layers in the slots, the first and the last ones, and an agent's next turn (a
short extend of the same context) routes to the hottest experts of every layer: idle time (no request running
or waiting; EngineCore through ModelRunner.idle) brings them in. REFRESH_FILLS a call at most (~2 ms of PCIe gen5
at the Qwen3.6-35B-A3B width: what a request that arrives meanwhile waits at most); a newcomer takes an occupied
slot when REFRESH_RATIO x hotter than its expert (admission.admissions, the mapped decode's rule).

IdleRefresh is the part of OffloadBackend that does it; it reads the backend's cache, pool, streamer, stats_,
refresh_idle, _held, settle and place_admitted.
"""
from __future__ import annotations

import numpy as np

from engine.experts import admission

REFRESH_MODES = ("auto", "on", "off")
REFRESH_FILLS = 16
REFRESH_RATIO = 1.25


class IdleRefresh:
    def refresh(self, budget: int = REFRESH_FILLS) -> int:
        """Idle time (EngineCore between requests, through ModelRunner.idle; never inside a forward): the
        hottest experts not in a slot move into the slots the policy evicts first, while a slot is free or the
        newcomer is REFRESH_RATIO x hotter than its expert (admission.admissions, the mapped decode's rule), at
        most `budget` a call, and the call waits for their copies. The windows a streamed prompt keeps for its
        first layers (PrefillStreamer.kept_windows) are left alone. -> experts moved (0: the slots hold what
        the heat asks for, or refresh is off). Counted as fills and as `refreshed`."""
        if not self.refresh_idle or self._held or budget <= 0:
            return 0
        self.settle()
        t = self.cache.table
        loaded = np.array([self.pool.layer_ready(layer) for layer in self.pool.layers])[:, None]
        rows, experts = np.nonzero((t.resident < 0) & (t.heat > 0) & loaded)  # never waits for the pool's loader
        if not len(rows):
            return 0
        top = np.argsort(-t.heat[rows, experts], kind="stable")[:budget]
        candidates = [(float(t.heat[r, e]), int(r), int(e)) for r, e in zip(rows[top], experts[top])]
        # the windows a streamed prompt keeps for its first layers stay as they are: taken, the next long prompt
        # copied those layers whole again (H200 box: its prefill 0.87x)
        locked = t.locked.copy()
        if self.streamer is not None:
            t.lock(self.streamer.kept_windows())
        try:
            chosen = admission.admissions(t, candidates, max_fills=budget, ratio=REFRESH_RATIO)
        finally:
            t.locked[:] = locked
        placed = self.place_admitted(chosen)
        for _, fills in placed:
            self.stats_[self.pool.layers[fills[0][0]]].refreshed += len(fills)
        if placed and placed[-1][0] is not None:
            placed[-1][0].synchronize()  # the copy stream is FIFO: the last layer's copies end after the others
        return len(chosen)
