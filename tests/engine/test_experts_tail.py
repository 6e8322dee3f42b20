"""hybrid.TailClock in the engine: a held prompt's last routed layer (every later layer wholly resident) splits by
the clock's lag, and its fills' end and the device's wait for its joined CPU job feed the clock (on a CPU device,
under Triton's interpreter, with stand-ins for the CUDA events)."""
import time

import pytest
import torch

from engine.experts import cpu_jobs, lookahead
from engine.experts.hybrid import TAIL_GAIN, HybridBackend
from engine.experts.policy import BandwidthEstimate

from tests.engine.backends_util import E, check_prompt, check_table, deep_pool, routing


class Event:
    """A CUDA event's stand-in: done or not (synchronize() sleeps `lands` seconds, then it is), and the ms to
    another's."""

    def __init__(self, done=True, lands=0.0, at_ms=0.0):
        self.done, self.lands, self.at_ms = done, lands, at_ms

    def query(self):
        return self.done

    def synchronize(self):
        if not self.done:
            time.sleep(self.lands)
            self.done = True

    def elapsed_time(self, later):
        return later.at_ms - self.at_ms


def test_the_last_routed_layer_splits_by_the_tail_clock_and_times_its_fills_against_its_job(monkeypatch):
    """Layers 2 and 3 hold all their experts, so of layers 0-1 (routed, every expert touched) the last routed
    one is the tail: its split alone is asked with tail=True, and HybridBackend.split then counts the clock's lag.
    Its fills' end still in flight when the job is collected: the clock measures how long they took to land
    (here >= 3 ms); landed, with the device's wait for the job 2 ms: -2 ms; landed, no wait, looked at once: 0.
    Outputs equal the reference's throughout; a frozen estimate asks for no timing."""
    pytest.importorskip("triton")
    monkeypatch.setattr(cpu_jobs, "JOIN_ON_DEVICE", True)
    monkeypatch.setattr(lookahead, "TOP_UP_S", 0.0)  # no layer made whole by its copies ahead
    src, deep = deep_pool(layers=4)
    seed = int(torch.randint(1 << 30, ()))
    x, ids, w = routing(40, seed=seed)  # 120 picks of 8 experts: every expert is routed to

    def backend(frozen, clock, fills_end, wait_ms, asked, joins):
        b = HybridBackend(deep, 4 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=1e9, frozen=frozen),
                          stream_prefill="off", slot_policy="lfu", lookahead="on", grouped=True)
        b.tail = clock if clock is not None else b.tail
        b.call_log = []
        for layer in (2, 3):
            b.cache.admit(layer, list(range(E)))
            b.cache.table.unlock_all()

        def split(m, busy=0, per=1.0, tail=False):
            asked.append(tail)
            return max(1, m // 2) if m > 1 else m  # fills beside a CPU job wherever there are two misses

        join, time_tail = b.cpu_jobs.join_on_device, b._time_tail

        def timed_join(y, timed=False):
            join(y)
            joins.append(timed)
            return (Event(at_ms=0.0), Event(at_ms=wait_ms)) if timed else None

        monkeypatch.setattr(b, "split", split)
        monkeypatch.setattr(b, "ahead_fills", lambda expected, likely, *a, **k: min(2, likely))  # two copied ahead
        monkeypatch.setattr(b.cache, "last_copy_end", lambda: fills_end)
        monkeypatch.setattr(b.cpu_jobs, "join_on_device", timed_join)
        # the job taken to end as it is collected (end_forward waits for it; the interpreter's layers 2-3 ran first)
        monkeypatch.setattr(b, "_time_tail", lambda ends, waits, cpu_end: time_tail(ends, waits, time.perf_counter()))
        return b

    clock = None
    cases = ((Event(done=False, lands=0.003), 0.0, 0.003), (Event(), 2.0, -0.002), (Event(), 0.0, 0.0))
    for frozen in (False, True):
        for fills_end, wait_ms, lag in cases[: 1 if frozen else 3]:
            asked, joins = [], []
            b = backend(frozen, clock, fills_end, wait_ms, asked, joins)
            clock, before = b.tail, (b.tail.lag, b.tail.samples)
            with torch.inference_mode():
                check_prompt(b, src, range(4), x, ids, w, msg=f"seed {seed}")
            assert [c.kind for c in b.call_log][1:] == ["joined", "unread", "unread"]
            assert asked == [False] * (len(asked) - 1) + [True]  # the tail's split alone
            assert joins == [False] * (len(joins) - 1) + [not frozen]  # the tail's join alone timed
            check_table(b)
            if frozen:
                assert (b.tail.lag, b.tail.samples) == before
            else:
                assert b.tail.samples == before[1] + 1
                if lag > 0:
                    assert lag <= b.tail.last < lag + 0.02
                else:
                    assert b.tail.last == pytest.approx(lag)
                assert b.tail.lag == pytest.approx(before[0] + TAIL_GAIN * b.tail.last)
                assert b.call_log[1].tail_ms == pytest.approx(b.tail.last * 1e3)  # in the call log too
            untimed = [c for i, c in enumerate(b.call_log) if frozen or i != 1]
            assert all(c.tail_ms != c.tail_ms for c in untimed)  # (nan: not measured)
            b.close()
    b = HybridBackend(deep, 4 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=1e9))
    b.policy.explore_first, b.policy.explore_every = 0, 1 << 30  # the fastest choice, no exploring
    b.tail.lag = 0.004
    lagged = b.policy.best(40, 3, b.handoff, 8.0, fill_lag=0.004)
    assert b.split(40, 3, 8.0, tail=True) == lagged.q
    assert b.split(40, 3, 8.0) == b.policy.best(40, 3, b.handoff, 8.0).q >= lagged.q
    assert b.stats()["split"]["tail"] == {"lag_ms": pytest.approx(4.0), "last_ms": 0.0, "samples": 0}
    b.close()


def test_a_joined_job_is_observed_once_the_next_calls_job_is_under_way(monkeypatch):
    """A held prompt's routed calls, each with a CPU job joined on the device: a call takes the last job's result
    before its plan and observes its rates only after posting its own job; the last job is observed at
    end_forward. Every job observed once, in order, and the outputs equal the reference's."""
    pytest.importorskip("triton")
    monkeypatch.setattr(cpu_jobs, "JOIN_ON_DEVICE", True)
    src, deep = deep_pool(layers=4)
    x, ids, w = routing(40, seed=int(torch.randint(1 << 30, ())))
    b = HybridBackend(deep, 4 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=1e9, frozen=True),
                      stream_prefill="off", slot_policy="lfu", lookahead="off", grouped=True)
    b.call_log = []
    events = []
    start, observe = b.cpu_jobs.start, b._observe_cpu
    monkeypatch.setattr(b, "split", lambda m, busy=0, per=1.0, tail=False: m // 2)  # half of the misses on the CPU
    monkeypatch.setattr(b.cpu_jobs, "start", lambda layer, *a, **k: (events.append(("start", layer)),
                                                                     start(layer, *a, **k))[1])
    monkeypatch.setattr(b, "_observe_cpu", lambda layer, *a, **k: (events.append(("observe", layer)),
                                                                   observe(layer, *a, **k))[1])
    with torch.inference_mode():
        check_prompt(b, src, range(4), x, ids, w)
    assert [c.kind for c in b.call_log] == ["joined"] * 4
    assert events == [("start", 0), ("start", 1), ("observe", 0), ("start", 2), ("observe", 1), ("start", 3),
                      ("observe", 2), ("observe", 3)]
    assert all(c.woke_ms >= 0 and c.cpu_start_ms >= 0 for c in b.call_log)
    check_table(b)
    b.close()
