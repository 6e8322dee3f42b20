"""A routed layer call's CPU job collected: its outputs placed into the call's rows by the engine thread once the
job is done (_collect_cpu), or joined on the device while the host goes on (_join_cpu, cpu_jobs.JOIN_ON_DEVICE:
the job's rate counted when it is collected later); either way the job's rate observed (_observe_cpu).

CpuCollect is the part of OffloadBackend that does it; it reads the backend's cpu_jobs, pool, estimate, observe,
stats_, handoff_clock, _timing_handoff, call_log and _log_joined_job.
"""
from __future__ import annotations

import time

import torch

from engine.experts.compute import Routing
from engine.experts.policy import sample_weight
from engine.experts.stats import NO_CPU, CpuWait

# a fill that landed before the tail clock looked, when it looked this soon after the CPU job's end, did not land
# late; and a device wait for the job this short is the wait kernel's own time
TAIL_LOOK_S = 5e-4
TAIL_WAIT_S = 2e-5


class CpuCollect:
    def _collect_cpu(self, layer: int, pending, y: torch.Tensor, routing: Routing, plan, routed_at: float) -> CpuWait:
        """The CPU job's outputs placed into y, its rate observed."""
        if pending is None:
            return NO_CPU
        waited = time.perf_counter()
        done = pending.result()
        woke = time.perf_counter()
        self.cpu_jobs.place(y, done)
        self._observe_cpu(layer, routing, plan, routed_at, None, done)
        return CpuWait(done.started, done.seconds, woke - waited, woke)

    def _join_cpu(self, layer: int, pending, y: torch.Tensor, routing: Routing, plan, routed_at: float,
                  probe=None) -> CpuWait:
        """The CPU job's outputs joined into y on the device (cpu_jobs.JOIN_ON_DEVICE) and the call returning at once;
        its rate observed when the job is collected (the next routed call's, or end_forward), which also fills in
        this call's log entry, written next. A prompt's last routed layer's (probe: its fills' end event) also
        times the device's wait for the job, for the tail clock (_time_tail)."""
        waits = self.cpu_jobs.join_on_device(y, timed=probe is not None)
        tail = (probe, waits) if probe is not None and waits is not None else None
        entry = len(self.call_log) if self.call_log is not None else None
        self.cpu_jobs.defer(pending, lambda done: self._observe_cpu(layer, routing, plan, routed_at, entry, done,
                                                                     tail))
        return CpuWait(None, None, 0.0, None, joined=True)

    def _observe_cpu(self, layer: int, routing: Routing, plan, routed_at: float, entry: int | None, done,
                     tail=None) -> None:
        """A CPU job's rate observed (the estimate's, the split's, the handoff's) and its run counted in the
        layer's cpu_seconds; a joined call's log entry (`entry`) given the job's start, run and when the engine
        thread had its result; tail: (its fills' end, the device's wait's events) of a last routed layer."""
        seconds, started = done.seconds, done.started
        self.stats_[layer].cpu_seconds += seconds
        nbytes = len(plan.on_cpu) * self.pool.expert_bytes
        self.estimate.observe_cpu(nbytes, seconds, sample_weight(nbytes, self.pool.expert_bytes))
        # alongside this layer's fills or the next one's copies ahead: the copy engine read host DRAM too
        copying = bool(plan.fills) or (plan.ahead is not None and len(plan.ahead[1]) > 0)
        self.observe("cpu", nbytes, seconds, together=copying, per=float(routing.counts[plan.on_cpu].mean()))
        if self._timing_handoff():
            self.handoff_clock.observe(started - routed_at)
        self._log_joined_job(entry, started, seconds)
        if tail is not None:
            lag = self._time_tail(*tail, started + seconds)
            if lag is not None:
                self.tail.observe(lag)
                self._log_tail(entry, lag)

    def _time_tail(self, fills_end, waits, cpu_end: float) -> float | None:
        """A prompt's last routed layer's fills against its CPU job, for the tail clock: when the fills are still
        in flight (the job is collected as it ends: end_forward waits for it), the seconds until they land; else
        minus the time the device waited for the job (its wait queued after the fills' kernels). A fill found
        landed on a late look with no wait says nothing (None)."""
        looked = time.perf_counter()
        if not fills_end.query():
            fills_end.synchronize()
            return time.perf_counter() - cpu_end
        waits[1].synchronize()
        wait = waits[0].elapsed_time(waits[1]) / 1e3
        if wait > TAIL_WAIT_S:
            return -wait
        return 0.0 if looked - cpu_end <= TAIL_LOOK_S else None
