"""Radix tree over token ids: the structure of the prefix cache, without any memory policy.

Every node but the root owns one edge: a run of token ids `key` covering positions [start, end) of every
sequence that passes through it, plus
- `kv`: an opaque payload holding the attention KV of exactly those positions (always present), and
- `ckpt`: optionally, a recurrent-state checkpoint taken at position `end` (conv + delta-rule state of every
  linear-attention layer).
A sequence can resume at position p when the KV of every edge above p exists (true for every node in the
tree: a node never outlives its ancestors) and - in hybrid mode (`require_checkpoint=True`) - a checkpoint
exists at p. Pure-attention models (`require_checkpoint=False`) resume wherever KV exists, including in the
middle of an edge: the caller then uses the first `position - node.start` tokens of the last node's KV.
Position 0 (the root) is always a valid resume point: a fresh state.

Payloads are opaque (docs/CONTRACTS.md, "engine prefix cache"): the tree reads `nbytes` and `tier`, calls
`split(n)` on KV payloads when an edge splits, `to_host()` / `to_device()` to move a checkpoint into its
node's tier, and `release()` exactly once when it stops owning a payload (dropped, or replaced by a copy;
never after `split`, whose halves take over ownership).

Memory policy (budgets, LRU, locks, pins) lives in tiers.py; it follows the tree through a listener with
`node_added(node)`, `node_resized(node, old_nbytes)` and `node_removed(node)`.

Cost: `match` and `insert` walk one dict lookup per edge and compare token runs slice-wise, so they are
O(prefix length); `remove_subtree` is O(nodes removed).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from engine.common_prefix import common_prefix_len

Tier = Literal["device", "host"]
MatchTier = Literal["none", "device", "host"]


class Payload(Protocol):
    nbytes: int
    tier: Tier

    def to_host(self) -> Payload: ...

    def to_device(self) -> Payload: ...

    def release(self) -> None: ...


class KVPayload(Payload, Protocol):
    def split(self, n: int) -> tuple[KVPayload, KVPayload]: ...


# kv(start, end) -> payload holding the KV of positions [start, end) of the sequence being inserted
KVSource = Callable[[int, int], Any]


class Node:
    __slots__ = ("key", "start", "parent", "children", "kv", "ckpt", "tier", "locks", "pinned_by", "alive", "stamp")

    def __init__(self, key: tuple[int, ...], start: int, parent: Node | None, kv: Any = None) -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's edge -> child
        self.kv = kv
        self.ckpt: Any = None
        self.tier: Tier = kv.tier if kv is not None else "device"
        self.locks = 0  # live requests whose path runs through this node
        self.pinned_by: set[str] = set()  # session keys pinning this node: its users
        self.alive = True
        self.stamp = 0  # when the memory policy last listed or used it (its LRU age)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def nbytes(self) -> int:
        return (self.kv.nbytes if self.kv is not None else 0) + (self.ckpt.nbytes if self.ckpt is not None else 0)

    def path(self) -> list[Node]:
        """Nodes from the root's child down to this one (empty for the root)."""
        out = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def __repr__(self) -> str:
        return f"Node[{self.start}:{self.end}] {self.tier} ckpt={self.ckpt is not None} locks={self.locks}"


@dataclass(frozen=True)
class Match:
    """Where a sequence can resume: `position` tokens are served from the cache.

    `node` is the deepest node used (None at position 0); its edge may extend past `position` (pure-attention
    mode only). `tier` is where the hit lives: "none" (miss), "device", or "host" if any node on the path is
    in host memory. The path is read through `node_path` at use time, so a later split of an edge on it (which
    inserts a node) is seen."""

    position: int
    node: Node | None
    tier: MatchTier

    @property
    def node_path(self) -> list[Node]:
        return self.node.path() if self.node is not None else []


class RadixTree:
    def __init__(self, require_checkpoint: bool = True, listener: Any = None) -> None:
        self.require_checkpoint = require_checkpoint
        self.listener = listener
        self.root = Node((), 0, None)

    def match(self, ids: Sequence[int], max_position: int | None = None) -> Match:
        """Deepest resumable position <= max_position (default len(ids)) along ids. Read-only."""
        limit = len(ids) if max_position is None else max(0, min(max_position, len(ids)))
        node, pos, on_host = self.root, 0, False
        best = Match(0, None, "none")
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _matched(child.key, ids, pos, limit)
            on_host = on_host or child.tier == "host"
            tier: MatchTier = "host" if on_host else "device"
            if n < len(child.key):
                if not self.require_checkpoint:
                    best = Match(pos + n, child, tier)
                break
            node, pos = child, pos + n
            if not self.require_checkpoint or child.ckpt is not None:
                best = Match(pos, child, tier)
        return best

    def insert(
        self, ids: Sequence[int], upto: int, kv: KVSource, checkpoints: Mapping[int, Any] | None = None
    ) -> Node:
        """Cache ids[:upto]: asks `kv(start, end)` only for ranges not cached yet, attaches each checkpoint
        (position -> payload, 1 <= position <= upto) at a node ending there, splitting edges as needed.
        Takes ownership of every checkpoint payload (a duplicate of an existing one is released).
        Returns the node ending at `upto`."""
        checkpoints = dict(checkpoints or {})
        _check_insert(ids, upto, checkpoints)
        bounds = sorted(set(checkpoints) | {upto})
        node, pos, b = self.root, 0, 0
        while pos < upto:
            while bounds[b] <= pos:
                b += 1
            stop = bounds[b]
            child = node.children.get(ids[pos])
            if child is None:
                child = self._add_child(node, ids, pos, stop, kv)
            else:
                n = _matched(child.key, ids, pos, stop)
                if n < len(child.key):
                    child = self.split(child, n)
            node, pos = child, child.end
            if pos in checkpoints:
                self._attach_ckpt(node, checkpoints.pop(pos))
        return node

    def split(self, node: Node, n: int) -> Node:
        """Cut node's edge after n tokens; returns the new upper node (the lower one keeps its identity,
        checkpoint and children). The upper node inherits locks and pins: it lies on the same paths."""
        if not 0 < n < len(node.key):
            raise ValueError(f"split offset {n} must fall inside the edge (1..{len(node.key) - 1})")
        parent, old = node.parent, node.nbytes
        kv_bytes = node.kv.nbytes
        head_kv, tail_kv = node.kv.split(n)
        if head_kv.nbytes + tail_kv.nbytes > kv_bytes or head_kv.tier != node.tier or tail_kv.tier != node.tier:
            raise ValueError("a KV payload's split(n) must keep its tier and not grow: head+tail <= nbytes")
        head = Node(node.key[:n], node.start, parent, head_kv)
        head.locks, head.pinned_by = node.locks, set(node.pinned_by)
        parent.children[node.key[0]] = head
        node.key, node.start, node.parent, node.kv = node.key[n:], node.start + n, head, tail_kv
        head.children[node.key[0]] = node
        self._notify("node_resized", node, old)
        self._notify("node_added", head)
        return head

    def boundary(self, ids: Sequence[int], length: int) -> Node | None:
        """The node ending exactly at `length` along ids (splitting an edge if needed); the root for 0;
        None if ids[:length] is not fully cached."""
        node, pos = self.root, 0
        while pos < length:
            child = node.children.get(ids[pos])
            if child is None:
                return None
            n = _matched(child.key, ids, pos, length)
            if n < len(child.key):
                if pos + n < length:
                    return None
                child = self.split(child, n)
            node, pos = child, child.end
        return node

    def remove_subtree(self, node: Node) -> int:
        """Drop a node, its payloads and every descendant (their KV is useless without this edge's KV).
        Returns the number of nodes removed."""
        if node.parent is None:
            raise ValueError("the root cannot be removed")
        del node.parent.children[node.key[0]]
        stack, count = [node], 0
        while stack:
            cur = stack.pop()
            stack.extend(cur.children.values())
            self._notify("node_removed", cur)
            for payload in (cur.kv, cur.ckpt):
                if payload is not None:
                    payload.release()
            cur.kv = cur.ckpt = None
            cur.alive, cur.children = False, {}
            count += 1
        return count

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _add_child(self, parent: Node, ids: Sequence[int], start: int, end: int, kv: KVSource) -> Node:
        payload = kv(start, end)
        if payload is None:
            raise ValueError(f"the kv source returned no payload for positions [{start}, {end})")
        child = Node(tuple(ids[start:end]), start, parent, payload)
        parent.children[child.key[0]] = child
        self._notify("node_added", child)
        return child

    def _attach_ckpt(self, node: Node, ckpt: Any) -> None:
        if node.ckpt is not None:
            ckpt.release()
            return
        if ckpt.tier != node.tier:
            moved = ckpt.to_host() if node.tier == "host" else ckpt.to_device()
            ckpt.release()
            ckpt = moved
        old = node.nbytes
        node.ckpt = ckpt
        self._notify("node_resized", node, old)

    def _notify(self, event: str, *args: Any) -> None:
        if self.listener is not None:
            getattr(self.listener, event)(*args)


def _matched(key: tuple[int, ...], ids: Sequence[int], pos: int, stop: int) -> int:
    """How many tokens of an edge's key agree with ids[pos:stop]."""
    return common_prefix_len(key, tuple(ids[pos:min(stop, pos + len(key))]))


def _check_insert(ids: Sequence[int], upto: int, checkpoints: Mapping[int, Any]) -> None:
    if not 0 < upto <= len(ids):
        raise ValueError(f"upto={upto} must be in 1..len(ids)={len(ids)}")
    bad = sorted(p for p in checkpoints if not 0 < p <= upto)
    if bad:
        raise ValueError(f"checkpoint positions {bad} fall outside the inserted range 1..{upto}")
