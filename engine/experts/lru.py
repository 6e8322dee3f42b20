"""Slot bookkeeping for the expert cache: who lives where, who was used last, who may be evicted.

Torch-free (numpy only). L = MoE layers (rows of the host pool), E = experts per layer, S = slots.
A slot is free when it holds nothing; free slots are always chosen before occupied ones.
"""
from __future__ import annotations

import numpy as np

EMPTY = -1
_FREE_STAMP = -1  # older than any real use: free slots are evicted first


class SlotTable:
    """Residency table [L, E] -> slot, owner per slot, LRU stamp per slot, and per-step locks."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {num_slots}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.resident = np.full((num_layers, num_experts), EMPTY, dtype=np.int64)  # [L, E] -> slot
        self.clock = 0
        self._alloc(num_slots)

    def _alloc(self, num_slots: int) -> None:
        self.owner = np.full(num_slots, EMPTY, dtype=np.int64)  # [S] -> layer * E + expert
        self.stamp = np.full(num_slots, _FREE_STAMP, dtype=np.int64)  # [S] last use
        self.locked = np.zeros(num_slots, dtype=bool)  # [S] in use by the current step

    @property
    def num_slots(self) -> int:
        return len(self.owner)

    def lookup(self, layer: int, experts) -> np.ndarray:
        """Slot of each expert of `layer`, EMPTY where not resident."""
        return self.resident[layer, np.asarray(experts, dtype=np.int64)]

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, slots) -> None:
        self.stamp[np.asarray(slots, dtype=np.int64)] = self.clock

    def lock(self, slots) -> None:
        self.locked[np.asarray(slots, dtype=np.int64)] = True

    def unlock_all(self) -> None:
        self.locked[:] = False

    def victims(self, k: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The k least recently used unlocked slots in [lo, hi), oldest first, in one pass.

        Returns fewer than k when fewer are unlocked. Ties break towards the lower slot id."""
        hi = self.num_slots if hi is None else hi
        stamps = self.stamp[lo:hi]
        cand = np.flatnonzero(~self.locked[lo:hi])
        k = min(k, len(cand))
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        # stamp * S + slot orders by age then id and makes every key distinct
        keys = stamps[cand] * (hi - lo + 1) + cand
        if k < len(cand):
            part = np.argpartition(keys, k - 1)[:k]
            cand, keys = cand[part], keys[part]
        return cand[np.argsort(keys, kind="stable")] + lo

    def assign(self, slot: int, layer: int, expert: int) -> None:
        """Slot now holds (layer, expert): the previous owner and any other copy stop being resident."""
        self._evict(slot)
        old = self.resident[layer, expert]
        if old != EMPTY:
            self._evict(int(old))
        self.resident[layer, expert] = slot
        self.owner[slot] = layer * self.num_experts + expert
        self.stamp[slot] = self.clock

    def _evict(self, slot: int) -> None:
        prev = self.owner[slot]
        if prev != EMPTY:
            self.resident[prev // self.num_experts, prev % self.num_experts] = EMPTY
        self.owner[slot] = EMPTY
        self.stamp[slot] = _FREE_STAMP

    def resident_count(self, layer: int) -> int:
        return int((self.resident[layer] != EMPTY).sum())

    def plan_resize(self, num_slots: int) -> list[tuple[int, int]]:
        """Moves (old slot -> new slot) that keep the most recently used residents when resizing.

        Pure: nothing changes until `apply_resize`, so a caller can reject before freeing anything."""
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {num_slots}")
        used = np.flatnonzero(self.owner != EMPTY)
        keep = used[np.argsort(-self.stamp[used], kind="stable")][:num_slots]
        return [(int(s), i) for i, s in enumerate(sorted(keep.tolist()))]

    def apply_resize(self, num_slots: int, moves: list[tuple[int, int]]) -> None:
        owner, stamp = self.owner.copy(), self.stamp.copy()
        self.resident[:] = EMPTY
        self._alloc(num_slots)
        for old, new in moves:
            self.owner[new], self.stamp[new] = owner[old], stamp[old]
            o = owner[old]
            self.resident[o // self.num_experts, o % self.num_experts] = new


def victims_reference(stamp, locked, k: int) -> list[int]:
    """Slow reference for `SlotTable.victims`: k scans, each taking the oldest unlocked slot left."""
    taken: list[int] = []
    for _ in range(k):
        best = None
        for s in range(len(stamp)):
            if locked[s] or s in taken:
                continue
            if best is None or stamp[s] < stamp[best]:
                best = s
        if best is None:
            break
        taken.append(best)
    return taken
