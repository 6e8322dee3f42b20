"""EngineCore threading, events, abort and error paths, with a pure-Python runner (next = last + 1).

The real model runner is exercised end to end in test_runner.py and the proxy tests."""
import asyncio
import gc
import threading
import time

import pytest

from engine.api import GenerateRequest, TokenEvent
from engine.serving import EngineCore


class CountingRunner:
    context_length = 64

    def __init__(self, fail_on=None, gate=None, delay=0.0):
        self.fail_on, self.gate, self.delay, self.live = fail_on, gate, delay, set()

    def validate(self, req):
        pass

    def admit(self, seq):
        self.live.add(seq.request_id)

    def step(self, work):
        if self.gate is not None:
            self.gate.wait(5)
        time.sleep(self.delay)
        out = []
        for w in work:
            if self.fail_on is not None and self.fail_on in w.seq.tokens[w.start:w.end]:
                raise RuntimeError("boom")
            out.append((w.seq.tokens[w.end - 1] + 1) % 100 if w.samples else None)
        return out

    def release(self, seq):
        self.live.discard(seq.request_id)

    def stats(self):
        return {"live_states": len(self.live)}


def collect(core, req, timeout=5):
    events, done = [], threading.Event()

    def sink(ev: TokenEvent):
        events.append(ev)
        if ev.final:
            done.set()

    core.submit(req, sink)
    assert done.wait(timeout)
    return events


def test_generates_streams_and_reports_usage():
    with EngineCore(CountingRunner(), max_step_tokens=4) as core:
        evs = collect(core, GenerateRequest([1, 2, 3, 4, 5, 6], 3, stop_ids=frozenset({99})))
    toks = [t for e in evs for t in e.token_ids]
    assert toks == [7, 8, 9]
    last = evs[-1]
    assert last.finish_reason == "length" and last.usage.output_tokens == 3
    assert last.usage.prompt_tokens == 6 and last.usage.prefilled_tokens == 6
    assert any(e.prefilled_so_far == 4 for e in evs)  # progress event during the chunked prefill


def test_stop_token_ends_without_being_emitted():
    with EngineCore(CountingRunner()) as core:
        evs = collect(core, GenerateRequest([97], 10, stop_ids=frozenset({99})))
    assert [t for e in evs for t in e.token_ids] == [98]
    assert evs[-1].finish_reason == "stop" and evs[-1].usage.output_tokens == 2


def test_error_in_a_step_fails_that_request_and_the_engine_keeps_serving():
    runner = CountingRunner(fail_on=42)
    with EngineCore(runner) as core:
        bad = collect(core, GenerateRequest([42], 2))
        good = collect(core, GenerateRequest([1], 2))
        assert core.stats()["active"] == 0 and runner.live == set()
    assert bad[-1].finish_reason == "error" and "boom" in bad[-1].error
    assert [t for e in good for t in e.token_ids] == [2, 3]


def test_too_long_and_queue_full_are_rejected_at_submit():
    gate = threading.Event()
    with EngineCore(CountingRunner(gate=gate), max_running=1, max_waiting=1) as core:
        with pytest.raises(ValueError, match="prompt is too long"):
            core.submit(GenerateRequest([1] * 60, 10), lambda e: None)
        core.submit(GenerateRequest([1], 50), lambda e: None)
        for _ in range(200):  # wait until the first request holds the only running slot
            if core.stats()["active"] == 1:
                break
            time.sleep(0.01)
        core.submit(GenerateRequest([1], 50), lambda e: None)
        with pytest.raises(OverflowError, match="queue full"):
            core.submit(GenerateRequest([1], 50), lambda e: None)
        gate.set()


async def test_stream_abort_on_early_exit_frees_the_request():
    runner = CountingRunner(delay=0.01)
    with EngineCore(runner) as core:
        req = GenerateRequest([1], 60)
        agen = core.stream(req)
        async for ev in agen:
            if ev.token_ids:
                break
        await agen.aclose()
        for _ in range(100):
            if core.stats()["active"] == 0:
                break
            await asyncio.sleep(0.02)
        assert core.stats()["active"] == 0 and core.stats()["aborted"] == 1 and runner.live == set()


def test_call_runs_on_the_engine_thread_and_propagates_errors():
    with EngineCore(CountingRunner()) as core:
        assert core.call(lambda: threading.current_thread().name) == "killick-engine"
        with pytest.raises(ZeroDivisionError):
            core.call(lambda: 1 / 0)


def test_decode_steps_are_timed_back_to_back_and_prefill_is_not():
    """totals count the steps one token past the prompt that follow another such step: their period end to
    end, and the runner's part of it (here its 2 ms sleep)."""
    with EngineCore(CountingRunner(delay=0.002), max_step_tokens=4) as core:
        collect(core, GenerateRequest(list(range(10)), 6))  # prefill 4 + 4 + 2, then 5 decode steps
        stats = core.stats()
    assert stats["decode_steps"] == 4  # the first decode step follows a prefill chunk: no period yet
    assert 4 * 0.002 <= stats["decode_runner_seconds"] <= stats["decode_step_seconds"]


class IdleRunner(CountingRunner):
    """Records what ran when: its idle work has `pieces` pieces after each step (each a few ms), or raises."""

    def __init__(self, pieces=3, fail=False):
        super().__init__()
        self.pieces, self.fail, self.left, self.log = pieces, fail, 0, []

    def step(self, work):
        self.log.append("step")
        self.left = self.pieces
        return super().step(work)

    def idle(self):
        self.log.append("idle")
        if self.fail:
            raise RuntimeError("idle boom")
        time.sleep(0.002)
        self.left -= 1
        return self.left > 0


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_idle_work_runs_between_requests_until_done_and_never_inside_one():
    """The runner's idle() (the expert cache's refresh) runs once nothing runs or waits, piece after piece
    until it says it is done, then not again before the next request; a request never waits for more than the
    piece under way, and its steps are never interleaved with idle pieces."""
    runner = IdleRunner(pieces=3)
    with EngineCore(runner, max_step_tokens=4) as core:
        time.sleep(0.05)
        assert runner.log == []  # nothing ran yet: nothing to do
        first = collect(core, GenerateRequest([1, 2, 3, 4, 5, 6], 3))
        assert _wait_for(lambda: runner.log.count("idle") == 3)
        time.sleep(0.05)
        assert runner.log.count("idle") == 3
        second = collect(core, GenerateRequest([7], 2))
        assert _wait_for(lambda: runner.log.count("idle") == 6)
    steps_of_first = runner.log.index("idle")
    assert runner.log[:steps_of_first] == ["step"] * steps_of_first
    assert runner.log[steps_of_first:steps_of_first + 3] == ["idle"] * 3
    assert [t for e in first for t in e.token_ids] == [7, 8, 9] and [t for e in second for t in e.token_ids] == [8, 9]


def test_failing_idle_work_is_logged_and_the_engine_keeps_serving(caplog):
    runner = IdleRunner(fail=True)
    with EngineCore(runner) as core:
        collect(core, GenerateRequest([1], 2))
        assert _wait_for(lambda: "idle" in runner.log)
        time.sleep(0.05)
        assert runner.log.count("idle") == 1  # not retried in a loop
        evs = collect(core, GenerateRequest([5], 2))
    assert [t for e in evs for t in e.token_ids] == [6, 7]
    assert any("idle work failed" in r.getMessage() for r in caplog.records)


def test_stop_closes_the_runner_once_its_thread_has_ended():
    """stop() ends the engine thread, then the runner's own workers (ModelRunner.close); a second stop closes
    again, which a runner takes as nothing to do."""
    class Closing(CountingRunner):
        def close(self):
            self.closed.append(core._thread.is_alive())

    runner = Closing()
    runner.closed = []
    core = EngineCore(runner).start()
    assert collect(core, GenerateRequest([1, 2], 3))[-1].finish_reason == "length"
    core.stop()
    core.stop()
    assert runner.closed == [False, False]


def test_start_freezes_what_exists_out_of_the_collectors_passes_and_stop_unfreezes():
    """A full garbage collection walks every object the collector tracks; after start() the engine's own (the
    model, modules, kernels) are frozen out of it, so a pass inside a step walks only what came since."""
    gc.unfreeze()
    core = EngineCore(CountingRunner())
    try:
        core.start()
        assert gc.get_freeze_count() > 0
        events = collect(core, GenerateRequest([1, 2, 3], 3))
        assert events[-1].final  # serving as before
    finally:
        core.stop()
    assert gc.get_freeze_count() == 0
