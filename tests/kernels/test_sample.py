"""The sampling race kernel (engine/kernels/sample_triton.py) against the distribution it draws from:
softmax(logits / T), over blocks of the vocabulary, on fresh random logits."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.sample_triton import race_rows
from tests.kernels.conftest import CUDA

DRAWS = 20000 if CUDA else 300  # Triton's interpreter runs a program in ~10 ms (Philox in numpy)


def _frequencies(logits: torch.Tensor, t: float, draws: int, block: int, seed: int) -> torch.Tensor:
    rows = logits.expand(draws, -1).contiguous()  # every row an independent draw (Philox offsets differ)
    ids = race_rows(rows, t, seed=seed, block=block).cpu()
    assert ids.dtype == torch.int64 and ids.shape == (draws,)
    return torch.bincount(ids, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize("t", [1.0, 0.6])
def test_race_draws_follow_the_softmax_across_blocks(dev, t):
    g = torch.Generator().manual_seed(int(t * 10))
    V, block, draws = 100, 64, DRAWS  # two blocks, the last one partial
    logits = torch.full((V,), -30.0)
    hot = torch.tensor([3, 63, 64, 99])  # tokens in both blocks, at their edges, the vocabulary's last among them
    logits[hot] = torch.randn(4, generator=g)
    logits[5] = float("-inf")  # masked: never drawn
    p = torch.softmax(logits.double() / t, -1)
    freq = _frequencies(logits.to(dev), t, draws, block, seed=123)
    sigma = (p * (1 - p) / draws).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-3).all(), (freq[hot], p[hot])
    assert freq[5] == 0


def test_race_is_keyed_by_its_seed_and_picks_a_dominant_token(dev):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 300, generator=g).to(dev)
    a, b = race_rows(logits, 1.0, seed=5, block=128), race_rows(logits, 1.0, seed=5, block=128)
    assert torch.equal(a, b)
    assert not torch.equal(a, race_rows(logits, 1.0, seed=6, block=128))
    peaked = logits.clone()
    peaked[torch.arange(16), torch.arange(16) * 17] = 80.0  # each row's own dominant token, in any block
    assert race_rows(peaked, 0.5, seed=1, block=128).tolist() == (torch.arange(16) * 17).tolist()


def test_race_rejects_what_it_cannot_draw_from(dev):
    with pytest.raises(ValueError, match="unit stride"):
        race_rows(torch.zeros(4, 8, device=dev).t(), 1.0, seed=0)
    with pytest.raises(ValueError, match="temperature"):
        race_rows(torch.zeros(2, 8, device=dev), 0.0, seed=0)
