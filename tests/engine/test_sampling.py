"""Sampling: greedy, temperature, top-k, top-p, seeds."""
from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.sampling import Sampler, filter_logits
from tests.engine.util import prompt


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert Sampler(SamplingParams())(logits) == 1


def test_top_k_keeps_exactly_the_k_best():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -5.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [True, False, False, False]


def test_sampling_never_leaves_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=3))
    assert {sampler(logits) for _ in range(200)} == {0, 1}


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5, seed=7)

    def draw() -> list[int]:
        sampler = Sampler(params)
        return [sampler(logits) for _ in range(20)]

    first, again = draw(), draw()
    assert first == again and len(set(first)) > 3


def test_generate_seeded_reproducible_and_top_k_1_is_greedy(engine_for):
    eng = engine_for("qwen3_5_moe")
    ids = prompt(10, seed=50)
    sampled = eng.generate(ids, max_new_tokens=8, temperature=1.0, seed=123)
    assert sampled == eng.generate(ids, max_new_tokens=8, temperature=1.0, seed=123)
    greedy = eng.generate(ids, max_new_tokens=8)
    assert eng.generate(ids, max_new_tokens=8, temperature=1.0, top_k=1, seed=5) == greedy
    different = {tuple(eng.generate(ids, max_new_tokens=8, temperature=2.0, seed=s)) for s in range(4)}
    assert len(different) > 1


def test_sample_rows_reads_consecutive_rows_in_place_and_others_by_copy():
    from engine.sampling import _as_matrix, sample_rows

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50, generator=g)
    rows = list(logits.split(1))
    rows = [r[-1] for r in rows]  # what the runner passes: the last row of each item's [1, V]
    greedy = [Sampler(SamplingParams())] * 4
    assert _as_matrix(rows).data_ptr() == logits.data_ptr()  # no copy
    assert sample_rows(rows, greedy).tolist() == logits.argmax(-1).tolist()
    shuffled = [rows[2], rows[0], rows[3]]  # not consecutive: stacked, same answer
    assert _as_matrix(shuffled).data_ptr() != logits.data_ptr()
    assert sample_rows(shuffled, greedy[:3]).tolist() == [int(r.argmax()) for r in shuffled]
    other = torch.randn(50, generator=g)
    assert sample_rows([rows[0], other], greedy[:2]).tolist() == [int(rows[0].argmax()), int(other.argmax())]


def test_sample_rows_mixes_greedy_and_seeded_rows_as_each_sampler_alone():
    from engine.sampling import sample_rows

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    rows = [r[-1] for r in logits.split(1)]
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=21)
    samplers = [Sampler(SamplingParams()), Sampler(params), Sampler(SamplingParams())]
    alone = Sampler(params)
    for _ in range(5):
        got = sample_rows(rows, samplers).tolist()
        assert got[0] == int(rows[0].argmax()) and got[2] == int(rows[2].argmax())
        assert got[1] == alone(rows[1])


def test_draws_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    n = 6000
    counts = torch.bincount(torch.stack([sampler.sample(probs.log()) for _ in range(n)]), minlength=4)
    assert torch.allclose(counts / n, probs, atol=0.025), counts


def test_rows_of_temperature_alone_draw_together_and_follow_their_probabilities():
    """Rows whose sampler has a temperature and nothing else (an agent's default) share one draw per
    temperature; each row still picks token i with its own probability, and the rows around them (greedy,
    seeded, top-p) keep theirs, in order."""
    from engine.sampling import sample_rows

    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    logits = probs.clamp_min(1e-30).log()
    rows = [r[-1] for r in logits.split(1)]
    plain = Sampler(SamplingParams(temperature=1.0))
    assert plain.plain and not Sampler(SamplingParams(temperature=1.0, seed=3)).plain
    assert not Sampler(SamplingParams(temperature=1.0, top_p=0.5)).plain and not Sampler(SamplingParams()).plain
    torch.manual_seed(0)
    n = 4000
    draws = torch.stack([sample_rows(rows, [plain] * 3) for _ in range(n)])  # [n, 3]
    for r in range(3):
        freq = torch.bincount(draws[:, r], minlength=4) / n
        assert torch.allclose(freq, probs[r], atol=0.03), (r, freq)
    seeded = SamplingParams(temperature=1.0, seed=9)
    mixed = [Sampler(SamplingParams()), plain, Sampler(seeded), Sampler(SamplingParams(temperature=1.0, top_p=0.5))]
    alone = Sampler(seeded)
    got = sample_rows([rows[0], rows[1], rows[2], rows[1]], mixed).tolist()
    assert got[0] == 0 and got[3] == 3  # greedy; the top-p 0.5 nucleus of row 1 is token 3 alone
    assert got[2] == alone(rows[2])
