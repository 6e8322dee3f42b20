"""Two-tier memory policy for the prefix cache: device budget, host budget, LRU, locks, pins.

Units: a node (radix.py) is the unit of placement and eviction; its KV and its checkpoint always live in
the same tier. Per tier the bytes of its nodes never exceed that tier's budget after any public call.

LRU order: every use touches a whole path, deepest node first and the root's child last, so an ancestor is
never older than its descendants and eviction naturally eats leaves first.

Users: the sessions pinning a node (`pinned_by`) are its users; a node with two or more is shared (a
harness's system prompt and tools, the history subagents start from). A node's users include every user of
its descendants, so an ancestor is never less shared than what hangs below it. Eviction takes nodes with
fewer users first and the oldest among those: five ordered sets hold the evictable nodes, oldest first,
device (private, shared) and host (unpinned, one user, shared). Eviction pops the oldest entry of the first
non-empty set (plus the payload copy); nothing scans the tree (engine/cache/reference.py has the slow scan it
must agree with; `check` compares them). A node keeps its age when it changes set (a pin, an unpin, a lock).

- Device over budget: the oldest unlocked private device node is demoted to host (`to_host()`), a shared
  one only when no private one is left; if the host tier cannot take it, it is dropped instead.
- Host over budget: the oldest unpinned host node is dropped; only when none is left are pinned nodes
  dropped, those of one session before shared ones, oldest first (counted in `pinned_drops`). Choice: a pin
  is advice from the proxy while the agent runs its tools; the budget is a promise about RAM, so the budget
  wins. The session's pin stays in place for the nodes that survive. A prefix many sessions share outlives
  the most recent session's own tail: the next conversation of the harness starts from it.
- Dropping a node drops its whole subtree: a child's KV is useless without its ancestors' KV.
- Locked nodes (on the path of a live request: `acquire` .. `release`) are neither moved nor dropped; a
  locked node's ancestors are locked too, so dropping an unlocked node never takes a locked one with it.
- Pins cover the given nodes and all their ancestors; pinned nodes may move to host.
- A checkpoint inserted at a locked node that does not fit on the device (everything else already evicted)
  is released again (`shed_checkpoints`); the KV stays.
- A hit in the host tier is promoted by `acquire`: the path's host nodes are copied back to the device
  (`to_device()`), demoting other unlocked nodes to make room; if the device cannot hold them even then,
  the match is cut back to the deepest resume point above the first node that did not fit.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from engine.cache.radix import KVSource, Match, Node, RadixTree, Tier
from engine.cache.reference import reference_victim

TIERS: tuple[Tier, Tier] = ("device", "host")


def default_host_budget(fraction: float = 0.5, meminfo: str = "/proc/meminfo") -> int:
    """Bytes for the host tier: `fraction` of MemAvailable in /proc/meminfo."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"host budget fraction must be in (0, 1], got {fraction}")
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * fraction)  # the file counts kB
    except OSError:
        pass
    raise ValueError(f"cannot read MemAvailable from {meminfo}: pass host_budget (bytes) explicitly")


SHARED_USERS = 2  # sessions pinning a node from which it counts as shared
# The ordered sets of evictable nodes per tier, in eviction order (see _home).
EVICTION_ORDER: dict[Tier, tuple[str, ...]] = {"device": ("device", "device_shared"),
                                               "host": ("host", "pinned", "pinned_shared")}


class _Lru:
    """Ordered set of nodes by age (`stamp`, lowest first), with their byte total. A use stamps the node from
    the clock all sets share (`touch`: O(1), it becomes the newest); a node moved from another set keeps its
    age (`put`: a bisect, O(n) memmove at worst, only on pins, unpins and unlocks)."""

    def __init__(self, clock: Iterator[int]) -> None:
        self.stamps: list[int] = []  # ascending
        self.nodes: dict[int, Node] = {}  # stamp -> node
        self.sizes: dict[Node, int] = {}
        self.nbytes = 0
        self.clock = clock

    def put(self, node: Node) -> None:  # keeps the position of a node already present
        if node not in self.sizes:
            bisect.insort(self.stamps, node.stamp)
            self.nodes[node.stamp] = node
        self.nbytes += node.nbytes - self.sizes.get(node, 0)
        self.sizes[node] = node.nbytes

    def discard(self, node: Node) -> None:
        if node in self.sizes:
            self.nbytes -= self.sizes.pop(node)
            del self.stamps[bisect.bisect_left(self.stamps, node.stamp)]
            del self.nodes[node.stamp]

    def touch(self, node: Node) -> None:
        self.discard(node)
        node.stamp = next(self.clock)
        self.put(node)

    def oldest(self) -> Node | None:
        return self.nodes[self.stamps[0]] if self.stamps else None


class PrefixCache:
    """The engine's prefix cache: RadixTree + device/host tiers. Not thread-safe: the scheduler owns it."""

    def __init__(self, device_budget: int, host_budget: int | None = None, require_checkpoint: bool = True):
        self.budget = {"device": _check_budget(device_budget), "host": _check_budget(
            default_host_budget() if host_budget is None else host_budget)}
        self.tree = RadixTree(require_checkpoint, listener=self)
        self.bytes = {"device": 0, "host": 0}
        self.nodes = {"device": 0, "host": 0}
        clock = itertools.count(1)
        self._lru = {name: _Lru(clock) for names in EVICTION_ORDER.values() for name in names}
        self._where: dict[Node, _Lru] = {}
        self._sessions: dict[str, set[Node]] = {}
        self._grown: list[Node] = []  # locked nodes that gained a checkpoint during the current insert
        self.counters = {"hits_device": 0, "hits_host": 0, "misses": 0, "reused_tokens": 0, "demotions": 0,
                         "promotions": 0, "dropped_nodes": 0, "pinned_drops": 0, "shared_evictions": 0,
                         "cut_matches": 0, "shed_checkpoints": 0}

    # -- lookups ---------------------------------------------------------------------------------------

    def match(self, ids: Sequence[int], max_position: int | None = None) -> Match:
        """Read-only lookup: nothing is locked, moved or counted."""
        return self.tree.match(ids, max_position)

    def acquire(self, ids: Sequence[int], max_position: int | None = None) -> Match:
        """Match, lock the path for a live request and copy host hits back to the device. The returned
        match's nodes all live on the device; its tier says where the hit came from. Pair with release()."""
        m = self.tree.match(ids, max_position)
        if m.node is not None:
            self._lock(m.node)
            m = self._promote(m)
        if m.node is None:
            self.counters["misses"] += 1
        else:
            self.counters[f"hits_{m.tier}"] += 1
            self.counters["reused_tokens"] += m.position
        return m

    def release(self, m: Match) -> None:
        """Unlock the path of a match from acquire(); the nodes become evictable (as most recently used)."""
        node = m.node
        while node is not None and node.parent is not None:
            if node.locks <= 0:
                raise ValueError("release() of a match that is not held: each acquire() pairs with one release()")
            node.locks -= 1
            if node.locks == 0:
                self._relist(node, touch=True)
            node = node.parent

    # -- updates ---------------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], upto: int, kv: KVSource,
               checkpoints: Mapping[int, Any] | None = None) -> Node:
        """Cache ids[:upto] (see RadixTree.insert), mark the path most recently used, then evict to budget.
        The returned node may already be gone if it did not fit anywhere (check `.alive`)."""
        node = self.tree.insert(ids, upto, kv, checkpoints)
        self._touch_path(node)
        self._enforce()
        return node

    def pin(self, session_key: str, nodes: Iterable[Node]) -> None:
        """Keep these nodes (and their ancestors) from being dropped while the session's agent runs tools;
        replaces the session's previous pin. Pinned nodes may still move to the host tier."""
        self.unpin(session_key)
        pinned: set[Node] = set()
        for node in nodes:
            if not node.alive:
                raise ValueError("pin() got a node that was already evicted: match again and pin the new path")
            pinned.update(node.path())
        self._sessions[session_key] = pinned
        for node in pinned:
            node.pinned_by.add(session_key)
            self._relist(node)

    def unpin(self, session_key: str) -> None:
        for node in self._sessions.pop(session_key, ()):
            node.pinned_by.discard(session_key)
            if node.alive:
                self._relist(node)

    def invalidate(self, ids: Sequence[int], length: int = 0) -> int:
        """Drop everything cached beyond ids[:length] (all of it for length 0). Returns nodes dropped."""
        if not 0 <= length <= len(ids):
            raise ValueError(f"invalidate length {length} must be in 0..len(ids)={len(ids)}")
        node = self.tree.boundary(ids, length)
        if node is None:
            return 0
        children = list(node.children.values())
        if any(child.locks for child in children):
            raise ValueError("cannot invalidate a prefix a live request is using: release() it first")
        return sum(self._drop(child) for child in children)

    def set_budgets(self, device: int | None = None, host: int | None = None) -> None:
        """Change the budgets (e.g. under memory pressure) and evict down to them."""
        locked = self.bytes["device"] - self._evictable_bytes("device")
        if device is not None and device < locked:
            raise ValueError(f"live requests hold {locked} bytes of the device tier: release them before "
                             f"lowering its budget to {device}")
        if device is not None:
            self.budget["device"] = _check_budget(device)
        if host is not None:
            self.budget["host"] = _check_budget(host)
        self._enforce()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{t}_{k}": v for t in TIERS for k, v in
                               (("bytes", self.bytes[t]), ("budget", self.budget[t]), ("nodes", self.nodes[t]))}
        nodes = list(self.tree.nodes())
        out["checkpoints"] = sum(1 for n in nodes if n.ckpt is not None)
        out["pinned_sessions"] = len(self._sessions)
        out["shared_nodes"] = sum(1 for n in nodes if len(n.pinned_by) >= SHARED_USERS)
        out["shared_tokens"] = sum(len(n.key) for n in nodes if len(n.pinned_by) >= SHARED_USERS)
        out.update(self.counters)
        return out

    # -- radix-tree listener ---------------------------------------------------------------------------

    def node_added(self, node: Node) -> None:
        self.bytes[node.tier] += node.nbytes
        self.nodes[node.tier] += 1
        for key in node.pinned_by:
            self._sessions[key].add(node)
        self._relist(node, touch=True)

    def node_resized(self, node: Node, old_nbytes: int) -> None:
        self.bytes[node.tier] += node.nbytes - old_nbytes
        if node.locks and node.nbytes > old_nbytes:  # cannot be evicted: _enforce may shed it again
            self._grown.append(node)
        self._relist(node)

    def node_removed(self, node: Node) -> None:
        self.bytes[node.tier] -= node.nbytes
        self.nodes[node.tier] -= 1
        self.counters["dropped_nodes"] += 1
        lru = self._where.pop(node, None)
        if lru is not None:
            lru.discard(node)
        for key in node.pinned_by:
            self._sessions[key].discard(node)

    # -- policy ----------------------------------------------------------------------------------------

    def _home(self, node: Node) -> _Lru | None:
        if node.locks:
            return None
        shared = len(node.pinned_by) >= SHARED_USERS
        if node.tier == "device":
            return self._lru["device_shared" if shared else "device"]
        return self._lru["pinned_shared" if shared else "pinned" if node.pinned_by else "host"]

    def victim(self, tier: Tier) -> Node | None:
        """The node eviction takes next from `tier`: fewest users, then oldest (None: only locked nodes)."""
        return next((n for name in EVICTION_ORDER[tier] for n in (self._lru[name].oldest(),) if n), None)

    def _evictable_bytes(self, tier: Tier) -> int:
        return sum(self._lru[name].nbytes for name in EVICTION_ORDER[tier])

    def _relist(self, node: Node, touch: bool = False) -> None:
        """Put node in the ordered set its state calls for; keeps its age unless it moves or touch is set."""
        old, new = self._where.get(node), self._home(node)
        if old is not None and old is not new:
            old.discard(node)
            del self._where[node]
        if new is not None:
            new.put(node)
            self._where[node] = new
            if touch:
                new.touch(node)

    def _touch_path(self, node: Node) -> None:
        while node.parent is not None:  # deepest first: ancestors end up the most recent
            lru = self._where.get(node)
            if lru is not None:
                lru.touch(node)
            node = node.parent

    def _lock(self, node: Node) -> None:
        for n in node.path():
            n.locks += 1
            if n.locks == 1:
                self._relist(n)

    def _enforce(self) -> None:
        grown, self._grown = self._grown, []
        while not self._fit("device", 0) and grown:  # only locked nodes left: shed their new checkpoints
            self._shed_checkpoint(grown.pop())
        if not self._fit("device", 0) or not self._fit("host", 0):
            raise RuntimeError("prefix cache: locked nodes alone exceed a budget (split grew a payload?)")

    def _shed_checkpoint(self, node: Node) -> None:
        if node.alive and node.ckpt is not None:
            old = node.nbytes
            node.ckpt.release()
            node.ckpt = None
            self.node_resized(node, old)
            self.counters["shed_checkpoints"] += 1

    def _fit(self, tier: Tier, need: int) -> bool:
        """Evict from `tier` until `need` more bytes fit; False if nothing evictable is left."""
        while self.bytes[tier] + need > self.budget[tier]:
            victim = self.victim(tier)
            if victim is None:
                return False
            if len(victim.pinned_by) >= SHARED_USERS:
                self.counters["shared_evictions"] += 1
            if tier == "device":
                self._demote(victim)
            else:
                self._drop(victim)
        return True

    def _demote(self, node: Node) -> None:
        size = node.nbytes
        fits = size <= self.budget["host"] and self._fit("host", size)
        if not node.alive:  # making room on the host dropped one of its ancestors
            return
        if not fits:
            self._drop(node)
            return
        self._move(node, "host")
        self.counters["demotions"] += 1

    def _drop(self, node: Node) -> int:
        if node.pinned_by:
            self.counters["pinned_drops"] += 1
        return self.tree.remove_subtree(node)

    def _move(self, node: Node, tier: Tier) -> None:
        old_tier, size = node.tier, node.nbytes
        for attr in ("kv", "ckpt"):
            payload = getattr(node, attr)
            if payload is not None:
                setattr(node, attr, payload.to_host() if tier == "host" else payload.to_device())
                payload.release()
        node.tier = tier
        self.bytes[old_tier] -= size
        self.nodes[old_tier] -= 1
        self.bytes[tier] += node.nbytes
        self.nodes[tier] += 1
        self._relist(node, touch=True)

    def _promote(self, m: Match) -> Match:
        """Copy the host nodes of a locked match to the device, top-down; cut the match where one cannot fit."""
        promoted = False
        for node in m.node_path:
            if node.tier == "device":
                continue
            size = node.nbytes
            locked = self.bytes["device"] - self._evictable_bytes("device")
            if locked + size > self.budget["device"] or not self._fit("device", size):
                return self._cut(m, node, promoted)
            self._move(node, "device")
            self.counters["promotions"] += 1
            promoted = True
        return Match(m.position, m.node, "host" if promoted else m.tier)

    def _cut(self, m: Match, failed: Node, promoted: bool) -> Match:
        """Resume above `failed` instead: unlock what lies below the new deepest node."""
        self.counters["cut_matches"] += 1
        keep: Node | None = failed.parent
        if self.tree.require_checkpoint:
            while keep is not None and keep.parent is not None and keep.ckpt is None:
                keep = keep.parent
        if keep is not None and keep.parent is None:
            keep = None
        node = m.node
        while node is not keep and node.parent is not None:
            node.locks -= 1
            if node.locks == 0:
                self._relist(node, touch=True)
            node = node.parent
        if keep is None:
            return Match(0, None, "none")
        return Match(keep.end, keep, "host" if promoted else "device")

    def check(self) -> None:
        """Verify the bookkeeping against the tree (tests call this after every operation)."""
        seen = {"device": [0, 0], "host": [0, 0]}
        for node in self.tree.nodes():
            seen[node.tier][0] += node.nbytes
            seen[node.tier][1] += 1
            _require(node.kv is not None and node.kv.tier == node.tier, f"{node}: KV missing or in wrong tier")
            _require(node.ckpt is None or node.ckpt.tier == node.tier, f"{node}: checkpoint in wrong tier")
            _require(node.locks <= node.parent.locks or node.parent.parent is None, f"{node}: lock not on path")
            _require(self._where.get(node) is self._home(node), f"{node}: in the wrong LRU set")
            _require(all(node in self._sessions[k] for k in node.pinned_by), f"{node}: pin not recorded")
        for tier in TIERS:
            _require((self.bytes[tier], self.nodes[tier]) == tuple(seen[tier]), f"{tier}: byte/node count drift")
            _require(self.bytes[tier] <= self.budget[tier], f"{tier}: {self.bytes[tier]} > {self.budget[tier]}")
        _require(all(n.alive for n in self._where), "a dropped node is still listed for eviction")
        for tier in TIERS:
            _require(self.victim(tier) is reference_victim(self.tree, tier), f"{tier}: eviction order drifted")


def _check_budget(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"a cache budget must be >= 0 bytes, got {nbytes}")
    return int(nbytes)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"prefix cache invariant broken: {what}")
