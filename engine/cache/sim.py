"""Byte-counting payloads for the prefix cache: they carry token ids instead of tensors.

Used by the tests and for simulating the cache policy on recorded traffic without a model. They implement the
payload interface of docs/CONTRACTS.md ("engine prefix cache") and record ownership in a Ledger, so a test
can check that the cache releases every payload exactly once and keeps no released one.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.cache.radix import Tier


class Ledger:
    """The payloads currently owned by someone (created and not yet released or split)."""

    def __init__(self) -> None:
        self.live: set[object] = set()
        self.copies = {"host": 0, "device": 0}

    def adopt(self, payload: object) -> None:
        self.live.add(payload)

    def retire(self, payload: object) -> None:
        if payload not in self.live:
            raise RuntimeError(f"{payload!r} released twice or after being split")
        self.live.remove(payload)


class SimKV:
    """KV of positions [start, start + len(tokens)); nbytes = bytes_per_token per token."""

    def __init__(self, tokens: Sequence[int], start: int, ledger: Ledger, tier: Tier = "device",
                 bytes_per_token: int = 1) -> None:
        self.tokens, self.start, self.ledger, self.tier = tuple(tokens), start, ledger, tier
        self.bytes_per_token = bytes_per_token
        self.nbytes = len(self.tokens) * bytes_per_token
        ledger.adopt(self)

    def _like(self, tokens: Sequence[int], start: int, tier: Tier) -> SimKV:
        return SimKV(tokens, start, self.ledger, tier, self.bytes_per_token)

    def split(self, n: int) -> tuple[SimKV, SimKV]:
        self.ledger.retire(self)  # ownership passes to the halves
        t = self.tokens
        return self._like(t[:n], self.start, self.tier), self._like(t[n:], self.start + n, self.tier)

    def to_host(self) -> SimKV:
        self.ledger.copies["host"] += 1
        return self._like(self.tokens, self.start, "host")

    def to_device(self) -> SimKV:
        self.ledger.copies["device"] += 1
        return self._like(self.tokens, self.start, "device")

    def release(self) -> None:
        self.ledger.retire(self)

    def __repr__(self) -> str:
        return f"SimKV[{self.start}:{self.start + len(self.tokens)}]@{self.tier}"


class SimCheckpoint:
    """Recurrent state at `position` of the sequence with prefix `prefix`."""

    def __init__(self, prefix: Sequence[int], ledger: Ledger, tier: Tier = "device", nbytes: int = 1) -> None:
        self.prefix, self.ledger, self.tier, self.nbytes = tuple(prefix), ledger, tier, nbytes
        ledger.adopt(self)

    def to_host(self) -> SimCheckpoint:
        self.ledger.copies["host"] += 1
        return SimCheckpoint(self.prefix, self.ledger, "host", self.nbytes)

    def to_device(self) -> SimCheckpoint:
        self.ledger.copies["device"] += 1
        return SimCheckpoint(self.prefix, self.ledger, "device", self.nbytes)

    def release(self) -> None:
        self.ledger.retire(self)

    def __repr__(self) -> str:
        return f"SimCheckpoint@{len(self.prefix)}/{self.tier}"


def sim_kv_source(ids: Sequence[int], ledger: Ledger, bytes_per_token: int = 1):
    """kv(start, end) for PrefixCache.insert: slices the sequence being inserted."""
    return lambda start, end: SimKV(ids[start:end], start, ledger, "device", bytes_per_token)


def sim_checkpoints(ids: Sequence[int], positions: Sequence[int], ledger: Ledger, nbytes: int = 1):
    """{position: checkpoint} for PrefixCache.insert."""
    return {p: SimCheckpoint(ids[:p], ledger, "device", nbytes) for p in positions}
