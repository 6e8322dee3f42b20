"""Bulk placements in few copies: where the candidates leave a choice, an expert lands in a slot at its own offset
(slot % E == expert), so that consecutive experts in consecutive slots copy as one run (slot_cache.copy_runs).

A routed prompt's copies ahead and bulk fills move ~50-150 experts a layer call. Placed by rank alone (the most
likely expert to the coldest slot, pair_sorted) they copied in about one run per expert: a 256-token extend issued
~370-460 copies (H100 and H200 boxes, docs/PERF.md), ~7-13 us of engine-thread time each, the first layer's before
the layer after it is queued. Often the choice is free: under uniform routing every missing expert of a later layer
is near-certain to be read and about as hot as the next, and the slots of the layer that just ran are about as cold
as each other. Candidates about as worth placing or evicting as the boundary one (the last expert the plan would
copy, the last slot the policy would evict) are taken as interchangeable (worth_range); those outside keep their rank.

Torch-free (numpy only).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Candidates whose heat (an expert's, or a slot's with its bonus) is within this factor of the boundary candidate's,
# or within NOISE_Z standard deviations of its uses counted as a Poisson count, whichever is wider, count as equally
# worth placing or evicting. Heat from a prompt or two is a few uses an expert (256 tokens, top 8 of 256: ~8 +- 3),
# so under uniform routing a factor alone split equal experts by noise; under skew the hot ones' heat is hundreds of
# uses and the factor decides.
TIER = 1.25
NOISE_Z = 2.0


class Tiered(NamedTuple):
    """Ranked candidates, best first: the first `must` are taken in any case (within what is asked for), the others
    are interchangeable."""

    items: np.ndarray
    must: int

    def without(self, taken) -> "Tiered":
        """The candidates left once `taken` are placed (the must count shrinks by the must ones among them)."""
        taken = np.asarray(taken, dtype=np.int64)
        if not len(taken) or not len(self.items):
            return self
        gone = np.zeros(int(max(self.items.max(), taken.max())) + 1, dtype=bool)  # (ids are >= 0)
        gone[taken] = True
        keep = ~gone[self.items]
        return Tiered(self.items[keep], int(keep[: self.must].sum()))


def pair_sorted(experts, victims) -> list[int]:
    """Slots for `experts` (in their order): the i-th smallest expert gets the i-th smallest victim (of as many
    as there are experts; past the victims, slot 0). Any victim may take any expert; pairing both in order lets
    consecutive experts land in consecutive slots, so they copy in a few long runs (copy_runs)."""
    order = np.argsort(np.asarray(experts, dtype=np.int64), kind="stable")
    ranked = np.sort(np.asarray(victims, dtype=np.int64))[: len(order)]
    slots = np.zeros(len(order), dtype=np.int64)
    slots[order[: len(ranked)]] = ranked
    return slots.tolist()


def worth_range(v: float, unit: float) -> tuple[float, float]:
    """The heat values as worth as heat v, a use weighing `unit`: within TIER of v, or within NOISE_Z standard
    deviations of its uses (sqrt of the count), whichever is wider; v alone when v is 0, -inf (a free slot) or inf."""
    if not 0 < v < np.inf:
        return v, v
    spread = NOISE_Z * float(np.sqrt(v / unit)) * unit
    return min(v / TIER, v - spread), max(v * TIER, v + spread)


def tier_bounds(values: np.ndarray, k: int, unit: float) -> tuple[int, int]:
    """values ascending (heat, coldest first, a use weighing `unit`), k >= 1 of them wanted: (how many come before the
    k-th's tier, how many up to its end); the tier is worth_range of the k-th value."""
    lo, hi = worth_range(float(values[k - 1]), unit)
    return int(np.searchsorted(values, lo, "left")), int(np.searchsorted(values, hi, "right"))


def pick_aligned(experts: Tiered, slots: Tiered, n: int, num_experts: int) -> tuple[list[int], list[int]]:
    """n experts and n slots (fewer when either list is shorter), paired. The slots: the must ones and, of the
    tier's, those whose own expert (slot % E) is a candidate, chosen by fill_blocks so the set falls in as few
    blocks of consecutive slots as it can (others only when those run short). The experts: the must ones, then the
    chosen slots' own experts from the tier, then the rest of the tier by rank. Each expert goes to its own slot
    where that was chosen; the rest pair in sorted order (pair_sorted's pairing). -> (experts, their slots)."""
    n = min(n, len(experts.items), len(slots.items))
    e_items, s_items = np.asarray(experts.items, dtype=np.int64), np.asarray(slots.items, dtype=np.int64)
    must_e, must_s = min(experts.must, n), min(slots.must, n)
    wanted = np.zeros(num_experts, dtype=bool)
    wanted[e_items] = True
    in_tier = wanted.copy()
    in_tier[e_items[:must_e]] = False
    tier = s_items[must_s:]
    homed = wanted[tier % num_experts]
    pick = fill_blocks(s_items[:must_s], tier[homed], n - must_s)
    picked = np.sort(np.concatenate([s_items[:must_s], pick, tier[~homed][: n - must_s - len(pick)]]))
    home = picked % num_experts
    own = _first_each(home[in_tier[home]])[: n - must_e]  # the picked slots' own experts, from the tier
    rest = in_tier.copy()
    rest[own] = False
    chosen = np.concatenate([e_items[:must_e], own, e_items[must_e:][rest[e_items[must_e:]]][: n - must_e - len(own)]])
    is_chosen = np.zeros(num_experts, dtype=bool)
    is_chosen[chosen] = True
    at = np.flatnonzero(is_chosen[home])
    at = at[np.unique(home[at], return_index=True)[1]]  # each chosen expert's first own slot among the picked
    slot_of = np.full(num_experts, -1, dtype=np.int64)
    slot_of[home[at]] = picked[at]
    left = chosen[slot_of[chosen] < 0]
    spare = np.ones(len(picked), dtype=bool)
    spare[at] = False
    slot_of[left] = pair_sorted(left, picked[spare])
    return chosen.tolist(), slot_of[chosen].tolist()


def _first_each(values: np.ndarray) -> np.ndarray:
    """values without repeats, each where it first occurs."""
    return values[np.sort(np.unique(values, return_index=True)[1])]


def fill_blocks(must: np.ndarray, free: np.ndarray, q: int) -> np.ndarray:
    """q of the slots `free` (or all, when fewer) that, with the slots `must`, fall in as few blocks of consecutive
    slots as the greedy finds: the smallest gaps between must blocks filled first, then slots grown outward from
    the blocks (nearest first), then new blocks from the longest stretches of free slots."""
    if q >= len(free):
        return np.asarray(free, dtype=np.int64)
    if q <= 0:
        return np.empty(0, dtype=np.int64)
    cand = np.sort(np.concatenate([must, free]))
    mark = np.zeros(int(cand[-1]) + 1, dtype=bool)
    mark[must] = True
    is_must = mark[cand]
    seg = np.zeros(len(cand), dtype=np.int64)  # the stretch of consecutive slots each belongs to
    np.cumsum(cand[1:] - cand[:-1] != 1, out=seg[1:])
    idx = np.flatnonzero(is_must)
    a, b = idx[:-1], idx[1:]
    inner = (seg[a] == seg[b]) & (b - a > 1)
    a, b = a[inner], b[inner]
    order = np.argsort(b - a, kind="stable")
    fits = order[np.cumsum((b - a - 1)[order]) <= q]  # each gap filled joins two blocks: the smallest first
    edge = np.zeros(len(cand) + 1, dtype=np.int64)
    edge[a[fits] + 1] += 1  # (gaps are disjoint: no index repeats)
    edge[b[fits]] -= 1
    chosen = is_must | (np.cumsum(edge[:-1]) > 0)
    left = q - int((chosen & ~is_must).sum())
    if left:
        left -= _grow(chosen, seg, left)
    if left:  # new blocks, the longest stretches first (those with a chosen slot were grown whole)
        starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        lengths = np.diff(np.r_[starts, len(cand)])
        for i in np.argsort(-lengths, kind="stable"):
            if chosen[starts[i]]:
                continue
            take = min(left, int(lengths[i]))
            chosen[starts[i]: starts[i] + take] = True
            left -= take
            if not left:
                break
    return cand[chosen & ~is_must]


def _grow(chosen: np.ndarray, seg: np.ndarray, q: int) -> int:
    """Mark up to q unchosen positions that lie in a stretch with a chosen one, nearest to a chosen one first (so
    no new block starts). -> how many were marked."""
    at = np.flatnonzero(chosen)
    if not len(at):
        return 0
    pos = np.arange(len(chosen))
    r = np.searchsorted(at, pos)
    dist = np.full(len(chosen), len(chosen))  # (past any real distance: not reachable)
    for near in (at[np.maximum(r - 1, 0)], at[np.minimum(r, len(at) - 1)]):
        dist = np.where(seg[near] == seg, np.minimum(dist, np.abs(near - pos)), dist)
    grow = np.flatnonzero(~chosen & (dist < len(chosen)))
    grow = grow[np.argsort(dist[grow], kind="stable")][:q]
    chosen[grow] = True
    return len(grow)
