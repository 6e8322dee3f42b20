"""Token sampling: greedy, temperature, top-k, top-p, with an optional seeded generator.

    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1), device)
    token = sampler(logits)        # logits FloatTensor [V] -> int
    ids = sampler.sample(logits)   # the same draw as a 0-d tensor on logits' device, no wait for the device
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.api import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [V] with everything outside the top-k / top-p nucleus set to -inf (0 / 1.0 mean off)."""
    logits = logits.float().clone()  # masks, not boolean indexing: nothing here waits for the device
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the tokens before it already reach top_p; the first always stays
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits.masked_fill_(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams(), device="cpu"):
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        return int(self.sample(logits))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> the token as a 0-d int64 tensor on their device, queued without waiting for it (a
        decode step's token can feed the next step before the host reads it). A draw is the argmax of the
        probabilities over independent Exp(1) noise, which picks token i with probability p_i, as
        torch.multinomial does, without the wait for the device multinomial costs on CUDA."""
        p = self.params
        if p.greedy:
            return torch.argmax(logits)
        if self.plain:
            return race_temperature(logits[None], p.temperature)[0]
        return _race(filter_logits(logits / p.temperature, p.top_k, p.top_p).softmax(-1), self.generator)

    @property
    def plain(self) -> bool:
        """Temperature alone (no top-k / top-p, no seed): draws of several such rows can share launches."""
        p = self.params
        return not p.greedy and p.seed is None and p.top_k == 0 and p.top_p == 1.0


NOISE_MIN = 1e-20  # an Exp(1) draw of 0 would make p / 0 inf (or NaN where p = 0), which argmax would pick


def _race(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """The argmax over the last dim of probs / Exp(1) noise: index i with probability probs[i]."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(NOISE_MIN)
    return torch.argmax(probs / noise, dim=-1)


def race_temperature(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """rows [n, V] of logits -> int64 [n], each drawn from softmax(row / temperature), queued. On CUDA in two
    Triton launches (engine/kernels/sample_triton.py: the same race, Philox noise keyed by a seed drawn from
    torch's CPU generator, so torch.manual_seed still repeats a run); elsewhere torch's ops."""
    if rows.is_cuda:
        from engine.kernels.sample_triton import race_rows

        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        return race_rows(rows, temperature, seed=int(torch.randint(2**31 - 1, (1,))))
    return _race((rows.float() / temperature).softmax(-1))


def sample_rows(rows: list[torch.Tensor], samplers: list[Sampler]) -> torch.Tensor:
    """A token for each logits row [V] by its sampler -> int64 [n] on the rows' device, queued, nothing read
    back: the greedy rows in one argmax, the rows of temperature alone in one draw per temperature (what an
    agent's request asks when it sends no sampling fields: temperature 1), the others one draw each."""
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    if len(greedy) == len(rows):
        return _as_matrix(rows).argmax(-1)
    temperatures = {s.params.temperature for s in samplers}
    if len(temperatures) == 1 and all(s.plain for s in samplers):  # agents' requests: one draw, no regathering
        return race_temperature(_as_matrix(rows), temperatures.pop())
    picks: list[torch.Tensor | None] = [None] * len(rows)

    def put(members: list[int], tokens: torch.Tensor) -> None:
        for i, token in zip(members, tokens):
            picks[i] = token

    if greedy:
        put(greedy, _as_matrix([rows[i] for i in greedy]).argmax(-1))
    by_temperature: dict[float, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.plain:
            by_temperature.setdefault(s.params.temperature, []).append(i)
    for t, members in by_temperature.items():
        put(members, race_temperature(_as_matrix([rows[i] for i in members]), t))
    for i, (row, sampler) in enumerate(zip(rows, samplers)):
        if picks[i] is None:
            picks[i] = sampler.sample(row)
    return torch.stack(picks)


class Readback:
    """Device int64 vectors to host lists through page-locked buffers used in turn: a step's tokens travel
    while the host still reads the step before's, so up to `depth` steps may be queued and unread."""

    def __init__(self, depth: int = 2) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._turn = 0

    def start(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Queue the copy of ids [n]; -> a function that waits for it (GIL released) and returns the list."""
        if ids.device.type != "cuda":
            return ids.tolist
        n, k = ids.shape[0], self._turn
        self._turn = (k + 1) % len(self._buffers)
        if self._buffers[k] is None or self._buffers[k].shape[0] < n:
            self._buffers[k] = torch.empty(max(n, 64), dtype=ids.dtype, pin_memory=True)  # pinning: a syscall
        host = self._buffers[k][:n]
        host.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> list[int]:
            done.synchronize()
            return host.tolist()
        return read


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

