"""Penalties on CUDA: the pool equals the plain definition there, and the fast path (decode steps as CUDA graphs,
the next step chained from the last one's tokens on the device) penalises as direct launches one step at a
time do. Penalties are applied to a step's logits after the graph's replay, so a graph never holds them."""
from __future__ import annotations

import random

import pytest
import torch

from engine.api import GenerateRequest, SamplingParams
from engine.models import load_model
from engine.penalties import PenaltyPool, penalize_reference
from engine.synth import synth_checkpoint
from tests.gpu.core_util import run_through_core

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("penalties") / "demo", arch="qwen3_5_moe", size="demo", seed=3)


def test_pool_on_cuda_equals_the_plain_definition():
    V, g, rng = 1000, torch.Generator(device="cuda").manual_seed(0), random.Random(0)
    pool = PenaltyPool(V, "cuda")
    params = [SamplingParams(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2)) if k % 3
              else SamplingParams() for k in range(6)]
    ids = [f"r{k}" for k in range(6)]
    for rid, p in zip(ids, params):
        pool.add(rid, p)
    history: list[list[int]] = [[] for _ in ids]
    for _ in range(20):
        rows = list(torch.randn(len(ids), V, device="cuda", generator=g) * 3)
        out, counted = pool.apply(ids, rows)
        want = penalize_reference([r.tolist() for r in rows], history, [p.frequency_penalty for p in params],
                                  [p.presence_penalty for p in params])
        for p, given, got, w in zip(params, rows, out, want):
            if p.penalized:
                torch.testing.assert_close(got.cpu(), torch.tensor(w), rtol=0, atol=1e-5)
            else:
                assert got is given
        drawn = torch.randint(0, 50, (len(ids),), device="cuda", generator=g)  # a small range: tokens repeat
        pool.count(counted, drawn)
        for h, t in zip(history, drawn.tolist()):
            h.append(t)


def test_graphed_chained_decode_penalises_as_direct_steps_do(demo_ckpt):
    settings = [{}, dict(frequency_penalty=1.5, presence_penalty=0.5), dict(presence_penalty=-2.0), {}]
    answers = {}
    for graphs in (True, False):
        model = load_model(demo_ckpt, device="cuda", dtype="float32")
        model.enable_fast(slots=4, capacity=512, graphs=graphs)
        vocab = model.config.vocab_size
        prompts = [torch.randint(0, vocab, (20 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(3)]
        prompts.append(prompts[2])  # the same prompt without its penalty, in the same batch
        reqs = [GenerateRequest(p, 24, sampling=SamplingParams(**s)) for p, s in zip(prompts, settings)]
        answers[graphs] = run_through_core(model, reqs, "float32", overlap=graphs)
        if graphs:
            assert model.decode_steps.replays > 0
    assert answers[True] == answers[False]
    assert answers[True][2] != answers[True][3]  # the penalty changed that greedy answer
