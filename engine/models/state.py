"""Per-sequence model state: KV per attention layer, conv + delta state per DeltaNet layer, and checkpoints.

A SequenceState belongs to one sequence and advances as model.forward runs its tokens. A StateCheckpoint is
an independent, resumable copy at `length` (what the prefix cache stores): recurrent states of every linear
layer and KV[:length] of every attention layer. kv = KV heads, D = head dim, C = conv channels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class KVCache:
    """Keys and values of one attention layer for one sequence, in buffers grown geometrically."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 64):
        self.k = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device)  # [kv, cap, D]
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv, D]."""
        end = self.length + k.shape[0]
        if end > self.k.shape[1]:
            self._grow(max(end, 2 * self.k.shape[1]))
        self.k[:, self.length : end] = k.transpose(0, 1)
        self.v[:, self.length : end] = v.transpose(0, 1)
        self.length = end

    def _grow(self, capacity: int) -> None:
        k = self.k.new_empty(self.k.shape[0], capacity, self.k.shape[2])
        v = torch.empty_like(k)
        k[:, : self.length], v[:, : self.length] = self.keys(), self.values()
        self.k, self.v = k, v

    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return self.keys().clone(), self.values().clone()

    @classmethod
    def from_snapshot(cls, k: torch.Tensor, v: torch.Tensor, dtype, device) -> "KVCache":
        cache = cls(k.shape[0], k.shape[2], dtype, device, capacity=max(64, 2 * k.shape[1]))
        cache.append(k.transpose(0, 1).to(device, dtype), v.transpose(0, 1).to(device, dtype))
        return cache


class LinearState:
    """One DeltaNet layer: the last K-1 conv inputs [C, K-1] and the delta-rule state [Hv, dk, dv] (fp32).

    `checkpoints` holds copies taken inside a chunk at the checkpoint positions the forward was given
    (position -> (conv, recurrent)), until the runner hands them to the cache (SequenceState.at /
    drop_checkpoints)."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent
        self.checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return self.conv.clone(), self.recurrent.clone()

    @classmethod
    def from_snapshot(cls, conv: torch.Tensor, recurrent: torch.Tensor, dtype, device) -> "LinearState":
        return cls(conv.to(device, dtype, copy=True), recurrent.to(device, torch.float32, copy=True))


@dataclass(frozen=True)
class StateCheckpoint:
    length: int
    layers: tuple[tuple[torch.Tensor, ...], ...]  # per layer: (k, v) [kv, length, D] or (conv, recurrent)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    def to(self, device) -> "StateCheckpoint":
        layers = tuple(tuple(t.to(device) for t in layer) for layer in self.layers)
        return StateCheckpoint(self.length, layers)


class SequenceState:
    def __init__(self, layers: list, length: int = 0):
        self.layers = layers  # KVCache or LinearState, one per decoder layer
        self.length = length  # tokens this state has seen
        # checkpoint positions strictly inside the next chunk: the forward snapshots them (set by the runner)
        self.checkpoint_positions: tuple[int, ...] = ()

    def at(self, position: int) -> "SequenceState":
        """This state as it was at a checkpoint position of the last forward: the recurrent copies taken there,
        views of KV[:position] (the KV before it is unchanged). Read-only; valid until the next forward."""
        layers = [_Saved(*layer.checkpoints[position]) if isinstance(layer, LinearState) else _KVPrefix(layer, position)
                  for layer in self.layers]
        return SequenceState(layers, position)

    def drop_checkpoints(self) -> None:
        self.checkpoint_positions = ()
        for layer in self.layers:
            if isinstance(layer, LinearState):
                layer.checkpoints.clear()

    def checkpoint(self) -> StateCheckpoint:
        return StateCheckpoint(self.length, tuple(layer.snapshot() for layer in self.layers))


class _Saved:
    """A LinearState's copy at a checkpoint position, as SequenceState.at hands it out (snapshot() only)."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.recurrent  # already private copies


class _KVPrefix:
    """The first `length` entries of a KVCache, as SequenceState.at hands them out."""

    def __init__(self, kv: KVCache, length: int):
        self.kv, self.length = kv, length

    def keys(self) -> torch.Tensor:
        return self.kv.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.kv.v[:, : self.length]

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return self.keys().clone(), self.values().clone()


class Span(NamedTuple):
    """One sequence of a forward batch as a layer sees it."""

    offset: int  # first row of its tokens in the batch
    length: int  # its tokens in this forward
    position: int  # tokens its state had seen before them
    state: object  # its per-layer state: KVCache / LinearState (or their slot versions)
    checkpoint_positions: tuple[int, ...]  # absolute positions inside the chunk to snapshot
