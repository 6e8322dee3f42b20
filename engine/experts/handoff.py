"""The CPU's handoff: how long a routed prompt's MoE layer call leaves the CPU idle besides its expert runs.

Torch-free. Between two MoE layers the CPU waits while the device runs the rest of the layer (attention or
DeltaNet, the router) and the host reads the routing back and plans the split; with copies ahead the copy
engine works on through it. HandoffClock keeps that time per layer call as the median of recent samples: the
device's part from a pair of timing events around the gap between two consecutive MoE layers (CUDA), the host's as
measured. The device's gaps are timed around a routed prompt's wholly resident layer calls too: when a long
estimate has the copy engine take every miss ahead, every layer runs resident, and the estimate must still hear
of the shorter gaps (H200 box, profile_decode: an estimate of 325 ms, most likely from the process's first extend,
which compiles its kernels, held through every later extend; each then ran every miss through the copy engine,
155 ms against ~100 in bench model). hybrid's split and its copies ahead give the copy engine that much more
(policy.SplitPolicy's cpu_extra). CallTiming is the part of OffloadBackend that runs the clock and keeps the call
log (stats.LayerCall) around each layer call; it reads the backend's handoff_clock, uses_handoff, call_log, pool
and _looking_ahead.
"""
from __future__ import annotations

import functools
import time
from collections import deque
from statistics import median
from typing import Callable

from engine.experts.stats import LayerCall

# samples each part of the estimate keeps: their median, so one outlier (a kernel compiled or a graph captured
# between two MoE layers: 325 ms once, H200 box) moves nothing, and a new regime takes over in half a window
HANDOFF_WINDOW = 9
# a device gap is left out where the host took longer than this between the two MoE layer calls: the device then
# waited for the host (kernels compiled, autotuned or captured between them), which no later forward repeats. An
# extend's whole first forward did (H100 box, profile_decode: an estimate of 21-27 ms from the untimed extend
# before, which had the next extend copy 133-229 experts ahead where 73-80 went in the others, and its CPU idle
# 37-56 ms); the host's own time between two MoE calls is ~1-1.5 ms there
HOST_STALL_S = 0.010


class HandoffClock:
    """`seconds`: the handoff's running estimate, the sum of two parts, each the median of its last HANDOFF_WINDOW
    samples: the device's time between two consecutive MoE layer calls, from a pair of timing events around it
    (every such pair, whether the calls were routed or ran wholly resident, unless the host held the device up
    between them: HOST_STALL_S), and the host's time from a routed call's routing to its CPU job. event: () -> a
    timing event recorded now on the device's stream (query() whether it is done, elapsed_time(later) in ms, as
    torch.cuda.Event), None where the device's work is in line with the host's (a CPU device: nothing to time);
    now: the host's clock (seconds)."""

    def __init__(self, event: Callable[[], object] | None = None, now: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.event, self.now = event, now
        self.seconds = 0.0
        self._device: deque[float] = deque(maxlen=HANDOFF_WINDOW)
        self._host: deque[float] = deque(maxlen=HANDOFF_WINDOW)
        self._last_exit = None  # (pool row, event after that MoE layer call, host time then) in this forward
        self._gaps: list = []  # (event, event): the device's time between two MoE layer calls, not yet read

    def begin(self) -> None:
        """A new forward: its first MoE layer has no gap before it."""
        self._last_exit = None

    def enter(self, row: int) -> None:
        """The MoE layer call of pool row `row` begins: the device's time since row - 1's call ended is a gap,
        unless the host took longer than HOST_STALL_S between the two."""
        if self.event is None:
            return
        last, self._last_exit = self._last_exit, None
        if last is not None and last[0] == row - 1 and self.now() - last[2] <= HOST_STALL_S:
            self._gaps.append((last[1], self.event()))

    def exit(self, row: int) -> None:
        if self.event is not None:
            self._last_exit = (row, self.event(), self.now())

    def read_gaps(self) -> None:
        """Take in the gaps whose events are done (after a read-back that waited for the device, all of them)."""
        read = False
        while self._gaps and self._gaps[0][1].query():
            a, b = self._gaps.pop(0)
            self._device.append(a.elapsed_time(b) / 1e3)
            read = True
        if read:
            self._update()

    def observe(self, host_s: float) -> None:
        """One routed layer call's host time from the routing's return to the CPU job's start."""
        self._host.append(max(0.0, host_s))
        self._update()

    def _update(self) -> None:
        self.seconds = (median(self._host) if self._host else 0.0) + (median(self._device) if self._device else 0.0)



def _ms_after(t0: float, t: float | None) -> float:
    """perf_counter t in ms after t0, as the call log keeps times (-1: none)."""
    return (t - t0) * 1e3 if t is not None else -1.0


class CallTiming:
    """Around each layer call: the handoff clock's marks and the call log's entry (OffloadBackend's part)."""

    def _log_call(self, layer: int, kind: str, t_in: float, hits: int, misses: int, fills: int, cpu: int,
                  ahead: int, behind: int, routed_at: float | None = None, started: float | None = None,
                  seconds: float | None = None, waited: float | None = None, planned: float | None = None,
                  woke: float | None = None, ran: float | None = None, queued: float | None = None) -> None:
        ms = functools.partial(_ms_after, t_in)
        self.call_log.append(LayerCall(layer, kind, hits, misses, fills, cpu, ahead, behind, self.handoff * 1e3,
                                       t_in, ms(routed_at), ms(started), (seconds or 0.0) * 1e3,
                                       (waited or 0.0) * 1e3, ms(time.perf_counter()), ms(planned), ms(woke),
                                       ms(ran), ms(queued), copies=self.cache.copy_calls - self._copies_in))

    def _log_joined_job(self, entry: int | None, started: float, seconds: float) -> None:
        """Call log entry `entry` (a joined call's, written as it returned; None: no log) given its CPU job's start
        and run, and when the engine thread collected it (now)."""
        if entry is None or self.call_log is None or entry >= len(self.call_log):
            return
        call = self.call_log[entry]
        self.call_log[entry] = call._replace(cpu_start_ms=_ms_after(call.at, started), cpu_ms=seconds * 1e3,
                                             woke_ms=_ms_after(call.at, time.perf_counter()))

    def _log_tail(self, entry: int | None, lag: float) -> None:
        """Call log entry `entry` given the tail clock's measured lag (seconds) of its fills behind its CPU job."""
        if entry is not None and self.call_log is not None and entry < len(self.call_log):
            self.call_log[entry] = self.call_log[entry]._replace(tail_ms=lag * 1e3)

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
