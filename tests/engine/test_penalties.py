"""Presence and frequency penalties: the batched pool equals the plain definition on random logits and
histories, mixed batches leave the rows without penalties bit for bit alone, and the serving core (one step
at a time and chained) writes what each request writes alone."""
from __future__ import annotations

import random

import pytest
import torch

from engine.api import GenerateRequest, SamplingParams
from engine.penalties import PenaltyPool, penalize, penalize_reference
from engine.runner import ModelRunner
from engine.serving import EngineCore
from tests.engine.test_runner import prompts, run_all

V = 50


def random_penalty(rng: random.Random) -> float:
    return rng.choice([0.0, rng.uniform(-2.0, 2.0)])


def test_penalize_equals_the_plain_definition_on_random_rows():
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 6)
        logits = torch.randn(n, V, generator=g) * 5
        histories = [[rng.randrange(V) for _ in range(rng.randint(0, 30))] for _ in range(n)]
        frequency = [random_penalty(rng) for _ in range(n)]
        presence = [random_penalty(rng) for _ in range(n)]
        counts = torch.zeros(n, V)
        for i, h in enumerate(histories):
            for t in h:
                counts[i, t] += 1
        got = penalize(logits, counts, torch.tensor(frequency), torch.tensor(presence))
        want = torch.tensor(penalize_reference(logits.tolist(), histories, frequency, presence))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for i in range(n):
            unseen = counts[i] == 0
            assert torch.equal(got[i][unseen], logits[i][unseen])  # tokens not generated keep their logit exactly
            if frequency[i] == presence[i] == 0.0:
                assert torch.equal(got[i], logits[i])


def test_pool_over_steps_equals_the_plain_definition_with_sequences_coming_and_going():
    """Random steps over a changing mixed batch: each step's rows equal the reference over each sequence's
    tokens so far, rows of sequences without penalties are the very tensors given, and freed rows start empty."""
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    pool = PenaltyPool(V)
    live: dict[str, SamplingParams] = {}
    history: dict[str, list[int]] = {}
    for step in range(60):
        if len(live) < 7 and rng.random() < 0.4:  # a sequence joins, with penalties or without
            rid = f"r{step}"
            live[rid] = SamplingParams(frequency_penalty=random_penalty(rng), presence_penalty=random_penalty(rng))
            history[rid] = []
            pool.add(rid, live[rid])
        if live and rng.random() < 0.2:
            rid = rng.choice(sorted(live))
            del live[rid]
            pool.drop(rid)
        ids = sorted(live, key=lambda _: rng.random())
        if not ids:
            continue
        rows = list(torch.randn(len(ids), V, generator=g) * 3)
        out, counted = pool.apply(ids, rows)
        want = penalize_reference([r.tolist() for r in rows], [history[r] for r in ids],
                                  [live[r].frequency_penalty for r in ids], [live[r].presence_penalty for r in ids])
        for rid, given, got, w in zip(ids, rows, out, want):
            if live[rid].penalized:
                torch.testing.assert_close(got, torch.tensor(w), rtol=0, atol=1e-5)
            else:
                assert got is given
        drawn = torch.randint(0, V, (len(ids),), generator=g)
        pool.count(counted, drawn)
        for rid, token in zip(ids, drawn.tolist()):
            history[rid].append(token)
    assert len(pool) == sum(p.penalized for p in live.values())


def test_zero_penalties_never_enter_the_pool():
    pool = PenaltyPool(V)
    pool.add("a", SamplingParams(temperature=0.7))
    rows = [torch.randn(V)]
    out, counted = pool.apply(["a"], rows)
    assert out is rows and counted is None and len(pool) == 0


def test_penalties_must_be_finite():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=float("nan"))
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("inf"))


def test_generate_with_penalties_equals_greedy_over_the_plain_definition(engine_for):
    """Engine.generate against a hand loop: score the tokens so far, penalise on the host, take the argmax."""
    eng = engine_for("qwen3_5_moe")
    ids = prompts(eng.config.vocab_size, 1, seed=13)[0]  # a prompt whose greedy answer repeats a token
    f, p, new = 1.5, 0.5, 10
    out: list[int] = []
    for _ in range(new):
        last = eng.score(ids + out)[-1].tolist()
        row = penalize_reference([last], [out], [f], [p])[0]
        out.append(max(range(len(row)), key=row.__getitem__))
    assert eng.generate(ids, max_new_tokens=new, frequency_penalty=f, presence_penalty=p) == out
    assert out != eng.generate(ids, max_new_tokens=new)  # the penalties change this greedy answer


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_batch_through_the_core_equals_each_request_alone(engine_for, overlap):
    eng = engine_for("qwen3_5_moe")
    ps = prompts(eng.config.vocab_size, 3, seed=12)
    settings = [dict(), dict(frequency_penalty=1.5, presence_penalty=0.5), dict(frequency_penalty=-0.5),
                dict(presence_penalty=-2.0)]
    ps.append(ps[0])  # the same prompt with and without penalties in one batch
    new = 10
    alone = [eng.generate(p, max_new_tokens=new, **s) for p, s in zip(ps, settings)]
    reqs = [GenerateRequest(p, new, sampling=SamplingParams(**s)) for p, s in zip(ps, settings)]
    runner = ModelRunner(eng.model, overlap=overlap)
    with EngineCore(runner, max_running=4) as core:
        got, _ = run_all(core, reqs)
    assert got == alone
    assert alone[3] != alone[0]  # a negative presence penalty makes the tiny model repeat itself
    assert len(runner._penalties) == 0 and runner.stats()["live_states"] == 0
