"""Overlapped decode (EngineCore chains the next decode step from the last one's tokens on the device before
reading them): the same tokens, finish reasons, usage and cache entries as one step at a time, with stop
tokens, length limits, seeded sampling, forced outputs, aborts and engine calls landing between steps.

On the CPU a chained step runs at once, so these tests pin what overlap must not change, not its speed; the
fast path's half (decode steps fed by device-side ids) runs under Triton's interpreter in test_fast_path's way.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine import Engine
from engine.api import GenerateRequest, SamplingParams, ThinkingBudget
from engine.cache.store import PrefixStore
from engine.runner import ModelRunner
from engine.serving import EngineCore
from tests.engine.test_runner import prompts, run_all


class CountingChains(ModelRunner):
    """A ModelRunner that counts its chained steps (how many decode steps were queued ahead)."""

    chained = 0

    def chain(self, last, work):
        self.chained += 1
        return super().chain(last, work)


def serve(model, reqs, overlap: bool, cache: bool = True, **core_args):
    store = PrefixStore(model, device_budget=64 << 20, host_budget=64 << 20) if cache else None
    runner = CountingChains(model, cache=store, overlap=overlap)
    with EngineCore(runner, max_running=4, **core_args) as core:
        out, finals = run_all(core, reqs)
        stats = core.stats()
    return out, [(f.finish_reason, f.usage.output_tokens, f.usage.checkpoints_kept) for f in finals], runner, stats


@pytest.fixture(params=["qwen3_5_moe", "qwen3_moe"])
def engine(request, engine_for):
    return engine_for(request.param)


def mixed_requests(engine):
    """Four sequences decoding together that end on different steps, for different reasons: a stop token in
    the middle, a stop token that is also the last allowed token, a length limit, a seeded sampled one."""
    vocab = engine.config.vocab_size
    ps = prompts(vocab, 3, seed=3) + [prompts(vocab, 1, seed=8)[0]]
    greedy = [engine.generate(p, max_new_tokens=9) for p in ps]
    # a stop id that first appears at a later position (an earlier one would end the request sooner)
    mid = next(t for k, t in enumerate(greedy[0]) if k >= 3 and t not in greedy[0][:k])
    last = greedy[1][4]
    return [GenerateRequest(ps[0], 9, stop_ids=frozenset({mid})),
            GenerateRequest(ps[1], 5 if last not in greedy[1][:4] else 9, stop_ids=frozenset({last})),
            GenerateRequest(ps[2], 7),
            GenerateRequest(ps[3], 8, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=4))]


def test_overlapped_serving_equals_one_step_at_a_time(engine):
    reqs = mixed_requests(engine)
    again = [GenerateRequest(r.prompt_ids, r.max_new_tokens, sampling=r.sampling, stop_ids=r.stop_ids) for r in reqs]
    plain, plain_finals, _, _ = serve(engine.model, reqs, overlap=False)
    got, finals, runner, stats = serve(engine.model, again, overlap=True)
    assert got == plain and finals == plain_finals
    assert plain[0] == engine.generate(reqs[0].prompt_ids, 9, stop_ids=reqs[0].stop_ids)[:-1]  # stop not emitted
    assert runner.chained > 0  # the decode steps were queued ahead, not only allowed to be
    assert stats["live_states"] == 0 and stats["finished"] == len(reqs)
    assert stats["output_tokens"] == sum(n for _, n, _ in finals)


def test_forced_output_and_an_abort_beside_overlapped_decode(engine):
    vocab = engine.config.vocab_size
    ps = prompts(vocab, 3, seed=5)
    script = [3, 1, 4, 1, 5, 9]
    runner = CountingChains(engine.model, overlap=True)
    events, aborted = {}, threading.Event()

    def sink_for(rid, abort_after=None):
        def sink(ev):
            events.setdefault(rid, []).append(ev)
            if abort_after is not None and sum(len(e.token_ids) for e in events[rid]) >= abort_after:
                core.abort(rid)
            if ev.final and ev.finish_reason == "abort":
                aborted.set()
        return sink

    long = GenerateRequest(ps[2], 40)
    with EngineCore(runner, max_running=4) as core:
        core.submit(long, sink_for(long.request_id, abort_after=3))
        assert aborted.wait(60)
        (a, f), = zip(*run_all(core, [GenerateRequest(ps[0], 6)]))
        (b, g), = zip(*run_all(core, [GenerateRequest(ps[1], 50, forced_output_ids=script)]))
        stats = core.stats()
    assert a == engine.generate(ps[0], max_new_tokens=6) and f.finish_reason == "length"
    assert b == script and g.finish_reason == "stop"
    assert stats["aborted"] == 1 and stats["live_states"] == 0
    assert runner.chained > 0


def test_engine_calls_run_between_steps_with_nothing_in_flight(engine):
    """core.call (cache reconfiguration) while overlapped decode runs: the step queued ahead is read and
    published first, so the call never sees a step in flight, and the output is unchanged."""
    ps = prompts(engine.config.vocab_size, 2, seed=6)
    runner = CountingChains(engine.model, overlap=True)
    seen, first = [], threading.Event()
    core = EngineCore(runner, max_running=4)

    def sink(ev):
        if ev.token_ids:
            first.set()

    with core:
        reqs = [GenerateRequest(p, 24) for p in ps]
        core.submit(reqs[0], sink)
        assert first.wait(60)
        for _ in range(3):
            seen.append(core.call(lambda: core._ahead is None))
        out, _ = run_all(core, reqs[1:])
    assert seen == [True] * 3
    assert out[0] == engine.generate(ps[1], max_new_tokens=24)


def test_a_turn_stopped_during_overlap_is_cached_through_its_stop_token(engine):
    """The step queued ahead fed the stop token already: the turn's cache entry ends past it, as when the
    release feeds it (the next turn, which repeats it, reuses everything before its new text)."""
    vocab = engine.config.vocab_size
    turn1 = prompts(vocab, 3, seed=2)[2]
    greedy = engine.generate(turn1, max_new_tokens=8)
    k = next(k for k in range(2, 8) if greedy[k] not in greedy[:k])
    stop = greedy[k]
    cache = PrefixStore(engine.model, device_budget=64 << 20, host_budget=64 << 20)
    runner = CountingChains(engine.model, cache=cache, overlap=True)
    with EngineCore(runner) as core:
        (out1,), (f1,) = run_all(core, [GenerateRequest(turn1, 8, stop_ids=frozenset({stop}))])
        turn2 = turn1 + out1 + [stop] + [5, 6, 7]
        (out2,), (f2,) = run_all(core, [GenerateRequest(turn2, 4)])
    assert out1 == greedy[:k] and f1.finish_reason == "stop" and runner.chained > 0
    assert f2.usage.reused_tokens == len(turn1) + k + 1 and f2.usage.prefilled_tokens == 3
    assert out2 == engine.generate(turn2, max_new_tokens=4)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the fast path needs CUDA or TRITON_INTERPRET=1")
def test_fast_path_decode_fed_from_the_last_steps_ids(checkpoints):
    """The fast path's decode buckets take a chained step's ids as a tensor (copied on the device into the
    step's inputs): the same greedy tokens as one step at a time, batched and alone."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], device=dev, fast=False)
    eng.model.enable_fast(slots=3, capacity=64, graphs=dev == "cuda")
    ps = [p[:9] for p in prompts(eng.config.vocab_size, 2, seed=12)]
    expected = [eng.generate(p, max_new_tokens=5) for p in ps]
    for overlap in (False, True):
        runner = CountingChains(eng.model, overlap=overlap)
        with EngineCore(runner, max_running=2) as core:
            got, _ = run_all(core, [GenerateRequest(p, 5) for p in ps], timeout=600)
        assert got == expected
        assert (runner.chained > 0) == overlap


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the fast path needs CUDA or TRITON_INTERPRET=1")
def test_mapped_expert_cache_decode_overlapped(checkpoints):
    """Offload and hybrid mapped decode through EngineCore with overlap: the cache's bookkeeping between steps
    (routes taken in a step late, admissions, the location table) and the hybrid CPU share (whose begin waits
    for the step before; its share searched as it goes, so its table changes) keep the fused engine's greedy
    tokens for two sequences decoding together."""
    pytest.importorskip("triton")
    from engine.experts import cpu_runner
    from engine.experts.policy import BandwidthEstimate, ShareSearch
    from engine.experts.registry import experts_factory

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = checkpoints["qwen3_5_moe", "fused"]
    fused = Engine.from_pretrained(ckpt, device=dev, fast=False)
    fused.model.enable_fast(slots=3, capacity=64, graphs=dev == "cuda")
    ps = [p[:10] for p in prompts(fused.config.vocab_size, 2, seed=14)]
    expected = [fused.generate(p, max_new_tokens=12) for p in ps]
    for backend in ("offload", "hybrid") if cpu_runner.NATIVE else ("offload",):
        est = BandwidthEstimate(bp=1e9, bh=1e3, frozen=True)
        experts = experts_factory(backend, device=dev, slots=5, estimate=est, decode="mapped")
        eng = Engine.from_pretrained(ckpt, device=dev, fast=False, expert_device="cpu", experts=experts)
        eng.model.enable_fast(slots=3, capacity=64)
        cpu = eng.model.fast.mapped.cpu
        if cpu is not None:  # a short window: the share moves (and the thread's table with it) within the run
            cpu.share = 0.5
            cpu.searches[2] = ShareSearch(0.5, pairs=1)
            tables = []
            mark = cpu.mark
            cpu.mark = lambda table: tables.append(mark(table)) or tables[-1]
        runner = CountingChains(eng.model, overlap=True)
        with EngineCore(runner, max_running=2) as core:
            got, _ = run_all(core, [GenerateRequest(p, 12) for p in ps], timeout=900)
        assert got == expected, backend
        assert runner.chained > 0
        if cpu is not None:
            assert eng.model.experts.stats()["total"]["cpu_runs"] > 0
            assert len({t.tobytes() for t in tables}) > 1  # the CPU's share changed between steps
        eng.model.experts.close()


def test_a_full_batch_keeps_overlapping_while_requests_wait(engine):
    """With every running slot taken, waiting requests cannot be admitted before a sequence ends: decode
    steps go on overlapping, and each waiting request starts once a slot frees, with the output it would
    have had alone."""
    vocab = engine.config.vocab_size
    ps = prompts(vocab, 3, seed=9) + prompts(vocab, 1, seed=10)
    reqs = [GenerateRequest(p, n) for p, n in zip(ps, (6, 10, 4, 5))]
    runner = CountingChains(engine.model, overlap=True)
    with EngineCore(runner, max_running=2) as core:
        got, finals = run_all(core, reqs, then=None)
        stats = core.stats()
    assert got == [engine.generate(r.prompt_ids, max_new_tokens=r.max_new_tokens) for r in reqs]
    assert [f.finish_reason for f in finals] == ["length"] * 4 and stats["live_states"] == 0
    # the first pair decodes 4 steps with two requests waiting: those are queued ahead too (3 without them)
    assert runner.chained >= 8


def test_thinking_closed_at_its_budget_is_fed_to_the_model_with_or_without_overlap(engine):
    """Past its thinking budget the engine writes the think-end marker itself: the model reads it as its own
    token (the answer goes on as generation from the prompt, the thinking and the marker does), and no decode
    step queued ahead samples in its place."""
    p = prompts(engine.config.vocab_size, 1, seed=9)[0]
    greedy = engine.generate(p, max_new_tokens=4)
    close = next(t for t in range(engine.config.vocab_size) if t not in greedy)  # a marker it did not write
    budget = ThinkingBudget(4, close_ids=(close,))
    expected = greedy + [close] + engine.generate(p + greedy + [close], max_new_tokens=7)
    for overlap in (False, True):
        out, finals, runner, _ = serve(engine.model, [GenerateRequest(p, 12, thinking_budget=budget)], overlap)
        assert out == [expected] and finals[0][:2] == ("length", 12)
    assert runner.chained > 0  # before the budget ran low and after the marker
