"""Helpers shared by the engine tests."""
from __future__ import annotations

import torch


def prompt(n: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers one-pass logits [T, V] for a prompt."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()
