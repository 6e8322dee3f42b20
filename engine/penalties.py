"""Presence and frequency penalties, OpenAI's: before each draw a sequence's logits lose
frequency * c[j] + presence * (c[j] > 0), where c[j] counts token j among the tokens it generated so far (the
prompt does not count). Applied to the logits of a step outside the model (and so outside its CUDA graphs),
batched on the device: the counts live there, one row per penalised sequence, updated from the drawn ids
without reading them back.

    pool = PenaltyPool(vocab_size, device)
    pool.add(request_id, sampling)                  # a sequence whose SamplingParams ask for penalties
    rows, counted = pool.apply(request_ids, rows)   # rows [V] of logits; the penalised ones replaced
    ids = sample_rows(rows, samplers)
    pool.count(counted, ids)                        # the drawn ids [n] join their sequences' counts
    pool.drop(request_id)

Sequences without penalties never enter the pool: their rows pass through untouched, so their logits and
tokens are bit for bit what they are without this module.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from engine.api import SamplingParams


def penalize(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
             presence: torch.Tensor) -> torch.Tensor:
    """logits [n, V], counts [n, V] (fp32, tokens generated so far), frequency / presence [n] -> the penalised
    logits [n, V] fp32, a new tensor (a decode step's logits may be a CUDA graph's output buffer). A row whose
    penalties are 0 keeps its values exactly: x - 0 is x."""
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)  # [n, V]
    return logits.float() - penalty


def penalize_reference(logits: list[list[float]], histories: list[list[int]], frequency: list[float],
                       presence: list[float]) -> list[list[float]]:
    """The plain definition, one row and one generated token at a time: what penalize must equal."""
    out = []
    for row, history, f, p in zip(logits, histories, frequency, presence):
        row = list(row)
        for token, c in Counter(history).items():
            row[token] -= f * c + p * (c > 0)
        out.append(row)
    return out


class Counted(NamedTuple):
    """What apply() penalised, for count(): the positions among the rows it was given and their pool rows."""

    positions: list[int]  # indices into apply's rows (and the drawn ids), ascending
    index: torch.Tensor  # [m] int64 on the device: each position's row of the pool


class _Row(NamedTuple):
    number: int
    index: torch.Tensor  # the number as a 0-d int64 on the device: stacked into Counted.index without a copy


class PenaltyPool:
    """Token counts [rows, V] fp32 on the device, one row per live sequence with penalties, and each row's
    frequency / presence. Rows are reused once dropped; the pool doubles when all are taken (a copy, at
    admission, never inside a step)."""

    def __init__(self, vocab_size: int, device="cpu") -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=self.device)
        self.frequency = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.presence = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, request_id: str, sampling: SamplingParams) -> None:
        """A row for a sequence that asks for penalties, its counts at zero; nothing for one that does not."""
        if not sampling.penalized or request_id in self._rows:
            return
        if not self._free:
            self._grow()
        number = self._free.pop()
        self.counts[number].zero_()
        self.frequency[number] = sampling.frequency_penalty
        self.presence[number] = sampling.presence_penalty
        index = torch.full((), number, dtype=torch.int64, device=self.device)  # a fill: no host-to-device copy
        self._rows[request_id] = _Row(number, index)

    def drop(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.number)

    def apply(self, request_ids: list[str], rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], Counted | None]:
        """rows [V] of logits, one per request id -> the rows with those of penalised sequences penalised (in
        one batch), and what count() needs afterwards (None: no row was penalised; rows come back as given)."""
        positions = [k for k, rid in enumerate(request_ids) if rid in self._rows]
        if not positions:
            return rows, None
        index = torch.stack([self._rows[request_ids[k]].index for k in positions])  # [m]
        picked = torch.stack([rows[k] for k in positions])  # [m, V]
        penalised = penalize(picked, self.counts.index_select(0, index), self.frequency.index_select(0, index),
                             self.presence.index_select(0, index))
        out = list(rows)
        for n, k in enumerate(positions):
            out[k] = penalised[n]
        return out, Counted(positions, index)

    def count(self, counted: Counted | None, ids: torch.Tensor) -> None:
        """ids [n] int64 on the device, drawn from apply's rows: the penalised sequences' tokens join their
        counts, queued on the device (one scatter; nothing is read back)."""
        if counted is None:
            return
        positions, index = counted
        tokens = ids if len(positions) == ids.shape[0] else torch.stack([ids[k] for k in positions])  # [m]
        ones = torch.ones(len(positions), dtype=self.counts.dtype, device=self.device)
        self.counts.index_put_((index, tokens), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        counts[:old] = self.counts
        frequency = torch.zeros(new, dtype=torch.float32, device=self.device)
        frequency[:old] = self.frequency
        presence = torch.zeros(new, dtype=torch.float32, device=self.device)
        presence[:old] = self.presence
        self.counts, self.frequency, self.presence = counts, frequency, presence
        self._free.extend(range(new - 1, old - 1, -1))
