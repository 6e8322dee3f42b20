"""The serving core over the real model: batching, chunking, forced outputs, abort, prefix reuse.

Greedy output must never depend on batch composition, chunk size, or what the prefix cache served."""
import threading

import pytest
import torch

from engine.api import GenerateRequest, SamplingParams
from engine.cache.store import PrefixStore
from engine import runner as runner_mod
from engine.runner import ModelRunner, cpu_step_threads
from engine.serving import EngineCore


def run_all(core, reqs, timeout=60, then=None, events=None):
    """Submit every request (then call `then`, e.g. core.start for requests that arrive together) and wait;
    `events` (a dict) gets each request's every event under its id."""
    results = {r.request_id: [] for r in reqs}
    finals, done = {}, threading.Event()

    def sink_for(rid):
        def sink(ev):
            if events is not None:
                events.setdefault(rid, []).append(ev)
            results[rid].extend(ev.token_ids)
            if ev.final:
                finals[rid] = ev
                if len(finals) == len(reqs):
                    done.set()
        return sink

    for r in reqs:
        core.submit(r, sink_for(r.request_id))
    if then is not None:
        then()
    assert done.wait(timeout), "engine did not finish in time"
    return [results[r.request_id] for r in reqs], [finals[r.request_id] for r in reqs]


@pytest.fixture(params=["qwen3_5_moe", "qwen3_moe"])
def engine(request, engine_for):
    return engine_for(request.param)


def prompts(vocab, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist() for L in (5, 37, 90)[:n]]


def test_batched_chunked_serving_equals_one_at_a_time(engine):
    ps = prompts(engine.config.vocab_size)
    expected = [engine.generate(p, max_new_tokens=8) for p in ps]
    for step_tokens in (8, 512):
        runner = ModelRunner(engine.model)
        with EngineCore(runner, max_running=4, max_step_tokens=step_tokens) as core:
            got, finals = run_all(core, [GenerateRequest(p, 8) for p in ps])
        assert got == expected
        assert [f.usage.prefilled_tokens for f in finals] == [len(p) for p in ps]
        assert runner.stats()["live_states"] == 0


def test_forced_output_runs_the_model_but_emits_the_script(engine):
    p = prompts(engine.config.vocab_size, 1)[0]
    script = [3, 1, 4, 1, 5]
    with EngineCore(ModelRunner(engine.model)) as core:
        (got,), (final,) = run_all(core, [GenerateRequest(p, 50, forced_output_ids=script)])
    assert got == script and final.finish_reason == "stop" and final.usage.output_tokens == 5


def test_prefix_reuse_gives_the_cold_output_and_reports_reused_tokens(engine):
    base = prompts(engine.config.vocab_size, 3, seed=1)[2]
    turn1 = base[:60]
    cache = PrefixStore(engine.model, device_budget=64 << 20, host_budget=64 << 20)
    runner = ModelRunner(engine.model, cache=cache)
    with EngineCore(runner, max_step_tokens=16) as core:
        (out1,), (f1,) = run_all(core, [GenerateRequest(turn1, 6, checkpoint_positions=(20, 40))])
        turn2 = turn1 + out1 + base[60:]  # the agent's next turn: history + reply + new text
        (out2,), (f2,) = run_all(core, [GenerateRequest(turn2, 6)])
        edited = turn1[:30] + [7, 7, 7] + base[60:]  # an edit at 30: resume from the checkpoint at 20
        (out3,), (f3,) = run_all(core, [GenerateRequest(edited, 6)])
    assert f1.usage.reused_tokens == 0
    assert f2.usage.reused_tokens == len(turn1) + len(out1)  # the last reply token was fed at release
    assert f2.usage.prefilled_tokens == len(turn2) - f2.usage.reused_tokens
    # hybrid models resume at the deepest recurrent checkpoint (20); pure attention anywhere KV exists (30)
    hybrid = "linear_attention" in engine.config.layer_types
    assert f3.usage.reused_tokens == (20 if hybrid else 30) and f3.usage.cache_tier == "device"
    assert out2 == engine.generate(turn2, max_new_tokens=6)
    assert out3 == engine.generate(edited, max_new_tokens=6)


@pytest.mark.parametrize("share", [256, 0])
def test_requests_sharing_a_prefix_in_flight_prefill_it_once(engine, share):
    """Four requests with a 300-token prefix in common arrive together: the first prefills it, the others wait
    for its checkpoint where they part and prefill only their own 20 tokens; outputs as without a cache. Each is
    told its reuse once, before its first token, as settled after any wait (what its final usage says)."""
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, engine.config.vocab_size, (300,), generator=g).tolist()
    ps = [shared + [k + 1] + torch.randint(0, engine.config.vocab_size, (19,), generator=g).tolist()
          for k in range(4)]
    cache = PrefixStore(engine.model, device_budget=256 << 20, host_budget=256 << 20)
    core = EngineCore(ModelRunner(engine.model, cache=cache), max_running=4, max_step_tokens=64,
                      share_prefill_min=share)
    reqs, events = [GenerateRequest(p, 4) for p in ps], {}
    try:
        got, finals = run_all(core, reqs, then=core.start, events=events)
        stats = core.stats()
    finally:
        core.stop()
    assert got == [engine.generate(p, max_new_tokens=4) for p in ps]
    for req, final in zip(reqs, finals):
        evs = events[req.request_id]
        told = [k for k, ev in enumerate(evs) if ev.reused_tokens is not None]
        assert [evs[k].reused_tokens for k in told] == [final.usage.reused_tokens]
        assert told[0] < min(k for k, ev in enumerate(evs) if ev.token_ids)
    if share:
        assert [f.usage.reused_tokens for f in finals] == [0, 300, 300, 300]
        assert (stats["shared_prefill_waits"], stats["shared_prefill_tokens"]) == (3, 900)
        assert stats["prefilled_tokens"] == 300 + 4 * 20
    else:  # without waiting each prefills the whole prompt side by side
        assert [f.usage.reused_tokens for f in finals] == [0] * 4 and stats["shared_prefill_waits"] == 0
        assert stats["prefilled_tokens"] == 4 * 320


def test_usage_reports_where_the_cache_kept_checkpoints(engine):
    """Usage.checkpoints_kept: the asked positions the request prefilled past, its prompt end, its generation
    end; a position inside the reused prefix is not taken again, and without a prefix cache nothing is kept."""
    p = prompts(engine.config.vocab_size, 3, seed=1)[2][:60]
    cache = PrefixStore(engine.model, device_budget=64 << 20, host_budget=64 << 20)
    with EngineCore(ModelRunner(engine.model, cache=cache), max_step_tokens=16) as core:
        (out,), (first,) = run_all(core, [GenerateRequest(p, 6, checkpoint_positions=(20, 40))])
        follow = p + out + [1, 2, 3]
        _, (second,) = run_all(core, [GenerateRequest(follow, 2, checkpoint_positions=(30,))])
    assert first.usage.checkpoints_kept == (20, 40, len(p), len(p) + 6)
    assert second.usage.reused_tokens == len(p) + 6
    assert second.usage.checkpoints_kept == (len(follow), len(follow) + 2)
    with EngineCore(ModelRunner(engine.model)) as core:
        _, (plain,) = run_all(core, [GenerateRequest(p, 2, checkpoint_positions=(20,))])
    assert plain.usage.checkpoints_kept == ()


def test_sampled_output_is_reproducible_with_a_seed(engine):
    p = prompts(engine.config.vocab_size, 1)[0]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    with EngineCore(ModelRunner(engine.model)) as core:
        a, _ = run_all(core, [GenerateRequest(p, 10, sampling=params)])
        b, _ = run_all(core, [GenerateRequest(p, 10, sampling=params)])
    assert a == b


def test_out_of_vocab_prompt_is_rejected_at_submit(engine):
    with EngineCore(ModelRunner(engine.model)) as core:
        with pytest.raises(ValueError, match="token ids"):
            core.submit(GenerateRequest([engine.config.vocab_size + 5], 2), lambda e: None)


def test_long_session_under_small_budgets_uses_the_host_tier_and_stays_exact(engine_for):
    engine = engine_for("qwen3_5_moe")
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(5)
    cache = PrefixStore(engine.model, device_budget=96 << 10, host_budget=256 << 10)
    runner = ModelRunner(engine.model, cache=cache)
    history, tiers, peaks = torch.randint(0, vocab, (24,), generator=g).tolist(), [], []
    with EngineCore(runner, max_step_tokens=64) as core:
        for turn in range(6):
            # a side conversation between turns pushes the main session's nodes out of the device tier
            run_all(core, [GenerateRequest(torch.randint(0, vocab, (40,), generator=g).tolist(), 2)])
            (out,), (fin,) = run_all(core, [GenerateRequest(history, 3, session_key="main")])
            assert out == engine.generate(history, max_new_tokens=3)
            tiers.append(fin.usage.cache_tier)
            stats = core.stats()
            peaks.append((stats["cache_device_bytes"], stats["cache_host_bytes"]))
            history = history + out + torch.randint(0, vocab, (12,), generator=g).tolist()
    assert "host" in tiers[1:]
    assert all(d <= 96 << 10 and h <= 256 << 10 for d, h in peaks)
    assert stats["cache_demotions"] > 0


def test_a_session_state_too_big_for_both_tiers_is_dropped_without_failing_the_release(engine_for, caplog):
    """The end-of-generation insert may not fit anywhere (the node is gone at once): pinning it for the session
    must be skipped, not raise, and the admitted path must be unlocked so later budgets still hold."""
    engine = engine_for("qwen3_5_moe")
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(7)
    cache = PrefixStore(engine.model, device_budget=8 << 10, host_budget=8 << 10)
    runner = ModelRunner(engine.model, cache=cache)
    prompt = torch.randint(0, vocab, (60,), generator=g).tolist()
    with EngineCore(runner, max_step_tokens=64) as core:
        for _ in range(2):
            (out,), (fin,) = run_all(core, [GenerateRequest(prompt, 3, session_key="s")])
            assert out == engine.generate(prompt, max_new_tokens=3) and fin.finish_reason == "length"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert all(node.locks == 0 for node in cache.cache.tree.nodes())
    cache.cache.check()


def test_a_turn_ended_by_a_stop_id_is_cached_through_that_token(engine):
    """The next prompt repeats the stop token (`<|im_end|>`): reuse must reach past it, not stop one short."""
    vocab = engine.config.vocab_size
    turn1 = prompts(vocab, 3, seed=2)[1]
    stop = engine.generate(turn1, max_new_tokens=1)[0]  # greedy: the first sampled token is a stop id
    cache = PrefixStore(engine.model, device_budget=64 << 20, host_budget=64 << 20)
    with EngineCore(ModelRunner(engine.model, cache=cache)) as core:
        (out1,), (f1,) = run_all(core, [GenerateRequest(turn1, 5, stop_ids=frozenset({stop}))])
        turn2 = turn1 + [stop] + [5, 6, 7]
        (out2,), (f2,) = run_all(core, [GenerateRequest(turn2, 4)])
    assert out1 == [] and f1.finish_reason == "stop"
    assert f2.usage.reused_tokens == len(turn1) + 1 and f2.usage.prefilled_tokens == 3
    assert out2 == engine.generate(turn2, max_new_tokens=4)


def test_cpu_steps_take_one_thread_short_and_cpu_step_threads_long(engine_for, monkeypatch):
    eng = engine_for("qwen3_5_moe")
    monkeypatch.setattr(runner_mod, "cpu_step_threads", lambda: 3)
    seen, forward = [], eng.model.forward

    def counting(items, *args, **kwargs):
        seen.append((sum(len(t) for t, _ in items), torch.get_num_threads()))
        return forward(items, *args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", counting)
    prompt = prompts(eng.config.vocab_size, n=1)[0] * 40  # 200 tokens: one long step
    with EngineCore(ModelRunner(eng.model), max_running=1, max_step_tokens=512) as core:
        run_all(core, [GenerateRequest(prompt, 4)])
    assert seen[0] == (len(prompt), 3)
    assert seen[1:] and all(threads == 1 for tokens, threads in seen[1:] if tokens < runner_mod.SMALL_STEP)


def test_cpu_step_threads_leave_a_core_unless_the_user_set_omp_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_step_threads() == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert cpu_step_threads() == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_step_threads() == 1
