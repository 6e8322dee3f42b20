"""Slow references for the prefix cache: matching as a flat set of cached prefixes (O(n^2) memory), and the
eviction choice as a scan of the whole tree.

With unlimited budgets the radix tree must resume every sequence exactly where this reference does; with
budgets it may only resume earlier (it forgets, it never invents). Tests compare the two; PrefixCache.check
compares its O(1) eviction choice with `reference_victim`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def reference_victim(tree: Any, tier: str) -> Any:
    """The node the memory policy (tiers.py) must evict next from `tier`: of the unlocked nodes there, the
    one with the fewest users (sessions pinning it; on the device one user counts as none: private, or
    shared by two or more; on the host: unpinned, one session, shared), then the oldest (lowest stamp)."""
    def rank(node) -> int:
        users = len(node.pinned_by)
        return int(users >= 2) if tier == "device" else min(users, 2)

    nodes = [n for n in tree.nodes() if n.tier == tier and n.locks == 0]
    return min(nodes, key=lambda n: (rank(n), n.stamp), default=None)


class ReferencePrefixCache:
    def __init__(self, require_checkpoint: bool = True) -> None:
        self.require_checkpoint = require_checkpoint
        self.kv: set[tuple[int, ...]] = set()  # every prefix whose KV is cached
        self.ckpt: set[tuple[int, ...]] = set()  # every prefix with a checkpoint at its end

    def insert(self, ids: Sequence[int], upto: int, checkpoints: Iterable[int] = ()) -> None:
        self.kv.update(tuple(ids[:p]) for p in range(1, upto + 1))
        self.ckpt.update(tuple(ids[:p]) for p in checkpoints)

    def match(self, ids: Sequence[int], max_position: int | None = None) -> int:
        limit = len(ids) if max_position is None else max(0, min(max_position, len(ids)))
        for p in range(limit, 0, -1):
            prefix = tuple(ids[:p])
            if prefix in self.kv and (not self.require_checkpoint or prefix in self.ckpt):
                return p
        return 0

    def invalidate(self, ids: Sequence[int], length: int = 0) -> None:
        head = tuple(ids[:length])

        def keep(prefix: tuple[int, ...]) -> bool:
            return len(prefix) <= length or prefix[:length] != head

        self.kv = {p for p in self.kv if keep(p)}
        self.ckpt = {p for p in self.ckpt if keep(p)}
