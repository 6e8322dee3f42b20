"""Slow reference for the prefix cache's matching: a flat set of cached prefixes, O(n^2) memory.

With unlimited budgets the radix tree must resume every sequence exactly where this reference does; with
budgets it may only resume earlier (it forgets, it never invents). Tests compare the two.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


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
