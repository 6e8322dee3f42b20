"""The CPU's handoff: how long a routed prompt's MoE layer call leaves the CPU idle besides its expert runs.

Torch-free. Between two MoE layers the CPU waits while the device runs the rest of the layer (attention or
DeltaNet, the router) and the host reads the routing back and plans the split; with copies ahead the copy
engine works on through it. HandoffClock keeps that time per layer call as an EMA: the device's part from a
pair of timing events around the gap between two consecutive MoE layers (CUDA), the host's as measured. hybrid's
split and its copies ahead give the copy engine that much more (policy.SplitPolicy's cpu_extra). CallTiming is the
part of OffloadBackend that runs the clock and keeps the call log (stats.LayerCall) around each layer call; it
reads the backend's handoff_clock, uses_handoff, call_log, pool and _looking_ahead.
"""
from __future__ import annotations

import time

from typing import Callable

from engine.experts.stats import LayerCall

HANDOFF_ALPHA = 0.3  # weight of a new sample in the running estimate


class HandoffClock:
    """`seconds`: the handoff's running estimate. event: () -> a timing event recorded now on the device's stream
    (query() whether it is done, elapsed_time(later) in ms, as torch.cuda.Event), None where the device's work
    is in line with the host's (a CPU device: nothing to time)."""

    def __init__(self, event: Callable[[], object] | None = None) -> None:
        self.event = event
        self.seconds = 0.0
        self._samples = 0
        self._last_exit = None  # (pool row, event after that MoE layer call) in this forward
        self._gaps: list = []  # (event, event): the device's time between two MoE layer calls, not yet read
        self._gap_s = 0.0  # the last of them read

    def begin(self) -> None:
        """A new forward: its first MoE layer has no gap before it."""
        self._last_exit = None

    def enter(self, row: int) -> None:
        """The MoE layer call of pool row `row` begins: the device's time since row - 1's call ended is a gap."""
        if self.event is None:
            return
        last, self._last_exit = self._last_exit, None
        if last is not None and last[0] == row - 1:
            self._gaps.append((last[1], self.event()))

    def exit(self, row: int) -> None:
        if self.event is not None:
            self._last_exit = (row, self.event())

    def read_gaps(self) -> None:
        """Take in the gaps whose events are done (after a read-back that waited for the device, all of them)."""
        while self._gaps and self._gaps[0][1].query():
            a, b = self._gaps.pop(0)
            self._gap_s = a.elapsed_time(b) / 1e3

    def observe(self, host_s: float) -> None:
        """One layer call's sample: the host's time from the routing's return to the CPU job's start, plus the
        device's last gap read."""
        sample = max(0.0, host_s) + self._gap_s
        self._samples += 1
        w = max(HANDOFF_ALPHA, 1.0 / self._samples)
        self.seconds = (1 - w) * self.seconds + w * sample


class CallTiming:
    """Around each layer call: the handoff clock's marks and the call log's entry (OffloadBackend's part)."""

    def _log_call(self, layer: int, kind: str, t_in: float, hits: int, misses: int, fills: int, cpu: int,
                  ahead: int, behind: int, routed_at: float | None = None, started: float | None = None,
                  seconds: float | None = None, waited: float | None = None) -> None:
        ms = lambda t: (t - t_in) * 1e3 if t is not None else -1.0  # noqa: E731
        self.call_log.append(LayerCall(layer, kind, hits, misses, fills, cpu, ahead, behind, self.handoff * 1e3,
                                       t_in, ms(routed_at), ms(started), (seconds or 0.0) * 1e3,
                                       (waited or 0.0) * 1e3, ms(time.perf_counter())))

    def _mark_enter(self, layer: int) -> None:
        """A routed prompt's MoE layer call begins: the device's time since the last one ended, the layers'
        attention and the rest, is CPU idle time (HandoffClock)."""
        if self._timing_handoff():
            self.handoff_clock.enter(self.pool.row[layer])

    def _mark_exit(self, layer: int) -> None:
        if self._timing_handoff():
            self.handoff_clock.exit(self.pool.row[layer])

    def _timing_handoff(self) -> bool:
        """Whether this layer call times the CPU's handoff: a routed prompt with lookahead, for a backend whose
        split reads it (uses_handoff: hybrid)."""
        return self.uses_handoff and self._looking_ahead()

    @property
    def handoff(self) -> float:
        """Seconds a routed prompt's layer call leaves the CPU idle besides its runs (HandoffClock's estimate)."""
        return self.handoff_clock.seconds
