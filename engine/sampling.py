"""Token sampling: greedy, temperature, top-k, top-p, with an optional seeded generator.

    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1), device)
    token = sampler(logits)        # logits FloatTensor [V] -> int
"""
from __future__ import annotations

import torch

from engine.api import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [V] with everything outside the top-k / top-p nucleus set to -inf (0 / 1.0 mean off)."""
    logits = logits.float().clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the tokens before it already reach top_p; the first always stays
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams(), device="cpu"):
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        filtered = filter_logits(logits / p.temperature, p.top_k, p.top_p)
        probs = filtered.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def wait_for_device(device: torch.device) -> None:
    """Block until the device has finished the work queued so far, without holding the GIL (CUDA)."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


def argmax_rows(rows: list[torch.Tensor]) -> list[int]:
    """Greedy tokens of several logits rows [V] at once: one argmax, one copy to the host."""
    ids = _as_matrix(rows).argmax(-1)
    if ids.device.type != "cuda":
        return ids.tolist()
    n = ids.shape[0]
    if _PINNED.get("ids") is None or _PINNED["ids"].shape[0] < n:
        _PINNED["ids"] = torch.empty(max(n, 64), dtype=ids.dtype, pin_memory=True)  # pinning costs a syscall
    host = _PINNED["ids"][:n]
    host.copy_(ids, non_blocking=True)
    wait_for_device(ids.device)
    return host.tolist()


def _as_matrix(rows: list[torch.Tensor]) -> torch.Tensor:
    """rows as one [n, V] tensor; without a copy when they are consecutive rows of one (a decode step's
    logits are), which spares a launch and a pass over n * V floats every step."""
    first = rows[0]
    if first.dim() == 1 and first.stride(0) == 1:
        step = first.shape[0]
        base = first.untyped_storage().data_ptr()
        if all(r.dim() == 1 and r.stride(0) == 1 and r.dtype == first.dtype and r.shape[0] == step
               and r.untyped_storage().data_ptr() == base and r.storage_offset() == first.storage_offset() + i * step
               for i, r in enumerate(rows)):
            return first.as_strided((len(rows), step), (step, 1))
    return torch.stack(rows)


_PINNED: dict[str, torch.Tensor] = {}  # the engine thread's reusable pinned buffer
