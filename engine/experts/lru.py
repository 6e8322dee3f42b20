"""Slot bookkeeping for the expert cache: who lives where, who was used last, who may be evicted.

Torch-free (numpy only). L = MoE layers (rows of the host pool), E = experts per layer, S = slots.
A slot is free when it holds nothing; free slots are always chosen before occupied ones.

Two eviction policies over the same table:
- `lru`: the least recently used unlocked slot goes first.
- `lfu`: the slot whose expert is least used lately goes first, recency breaking ties. "Lately": every routed
  (layer, expert) adds to its heat, and heat halves every `half_life` tokens (kept as a growing increment,
  so a use costs one add). At batch 1 a decode walks the layers in a cycle, so LRU keeps only the experts of
  the last token or two and a popular expert is evicted between its uses; heat keeps it.
"""
from __future__ import annotations

import numpy as np

from engine.experts.aligned import Tiered, tier_bounds

EMPTY = -1
_FREE_STAMP = -1  # older than any real use: free slots are evicted first


POLICIES = ("lru", "lfu")
HALF_LIFE = 256  # tokens: how fast lfu forgets (bench routing sweeps it)
_RESCALE = 1e200  # heat is divided down before the increment overflows


class SlotTable:
    """Residency table [L, E] -> slot, owner per slot, LRU stamp per slot, heat per expert, per-step locks."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, policy: str = "lru",
                 half_life: float = HALF_LIFE) -> None:
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(f"the expert cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if half_life <= 0:
            raise ValueError(f"the lfu half-life must be positive, got {half_life} tokens")
        self.num_layers, self.num_experts, self.policy, self.half_life = num_layers, num_experts, policy, half_life
        self.resident = np.full((num_layers, num_experts), EMPTY, dtype=np.int64)  # [L, E] -> slot
        self.heat = np.zeros((num_layers, num_experts))  # [L, E] uses, each weighted by the increment then
        self._inc = 1.0
        self._rescales: list[float] = []  # the increment at each rescale (a deferred use's weight, moment())
        self._growth = 2.0 ** (1.0 / (half_life * num_layers))  # a tick is one layer step: L ticks a token
        self._most_ticks = max(1, int(300 * half_life * num_layers))  # ticks whose growth stays under 2^300
        self.clock = 0
        self._alloc(num_slots)

    def _alloc(self, num_slots: int) -> None:
        self.owner = np.full(num_slots, EMPTY, dtype=np.int64)  # [S] -> layer * E + expert
        self.stamp = np.full(num_slots, _FREE_STAMP, dtype=np.int64)  # [S] last use
        self.slot_heat = np.full(num_slots, -np.inf)  # [S] heat of each slot's expert; -inf: free, goes first
        self.locked = np.zeros(num_slots, dtype=bool)  # [S] in use by the current step

    @property
    def num_slots(self) -> int:
        return len(self.owner)

    def lookup(self, layer: int, experts) -> np.ndarray:
        """Slot of each expert of `layer`, EMPTY where not resident."""
        return self.resident[layer, np.asarray(experts, dtype=np.int64)]

    def tick(self, n: int = 1) -> int:
        """n layer steps pass (a prompt of T tokens: T per layer, tokens_passed)."""
        self.clock += n
        while n > 0:  # a long prompt's growth in one product would overflow: at most 2^300 a step (the
            step = min(n, self._most_ticks)  # increment stays under 1e200 between steps)
            self._inc *= self._growth if step == 1 else self._growth ** step
            if self._inc > _RESCALE:
                self.heat /= self._inc
                self.slot_heat /= self._inc
                self._rescales.append(self._inc)
                self._inc = 1.0
            n -= step
        return self.clock

    def tokens_passed(self, tokens: int) -> None:
        """A forward's tokens before its last one passed at once (the layer calls that follow tick once each):
        older heat fades by the prompt's length, as if its tokens had been decoded one by one."""
        if tokens > 0:
            self.tick(tokens * self.num_layers)

    def moment(self) -> tuple[int, float, int]:
        """(clock, heat increment, rescales so far): a use counted later weighs as if counted now."""
        return self.clock, self._inc, len(self._rescales)

    def note_use(self, layer: int, experts, at: tuple[int, float, int] | None = None, weights=None) -> None:
        """The experts a layer step routes to, resident or not (their heat for lfu); at: the moment() the
        step ran, when it is counted later; weights: uses per expert (default one each; a prompt's layer call
        weighs each by its tokens, prompt_use_weights)."""
        experts = np.asarray(experts, dtype=np.int64)
        inc = self._inc
        if at is not None:
            inc = at[1]
            for f in self._rescales[at[2]:]:  # the rescales since, one at a time (their product overflows)
                inc /= f
        self.heat[layer, experts] += inc if weights is None else inc * np.asarray(weights, dtype=np.float64)
        slots = self.resident[layer, experts]
        on = slots >= 0
        self.slot_heat[slots[on]] = self.heat[layer, experts[on]]

    def touch(self, slots, clock: int | None = None) -> None:
        """Used now, or at `clock` (a use counted later: a slot filled since keeps its newer stamp)."""
        slots = np.asarray(slots, dtype=np.int64)
        if clock is None:
            self.stamp[slots] = self.clock
        else:
            self.stamp[slots] = np.maximum(self.stamp[slots], clock)

    def lock(self, slots) -> None:
        self.locked[np.asarray(slots, dtype=np.int64)] = True

    def unlock_all(self) -> None:
        self.locked[:] = False

    def victims(self, k: int, lo: int = 0, hi: int | None = None, bonus: np.ndarray | None = None) -> np.ndarray:
        """The k unlocked slots in [lo, hi) the policy evicts first, in that order, in one pass: lru the
        least recently used; lfu the coldest (free slots first, then by heat, recency breaking ties).
        bonus [S] (uses, >= 0): heat a slot's expert is still to gain (a prompt's layers still to run will read
        it, OffloadBackend.keep_bonus); lfu adds it to the slot's heat, lru takes the slots with a bonus last.

        Returns fewer than k when fewer are unlocked. Ties break towards the lower slot id."""
        hi = self.num_slots if hi is None else hi
        cand = np.flatnonzero(~self.locked[lo:hi])
        if bonus is None:
            return self._first(cand, k, lo, hi)
        if self.policy == "lfu":
            return self._first(cand, k, lo, hi, bonus[lo:hi][cand] * self._inc)
        kept = bonus[lo:hi][cand] > 0
        out = self._first(cand[~kept], k, lo, hi)
        return np.concatenate([out, self._first(cand[kept], k - len(out), lo, hi)]) if len(out) < k else out

    def victim_tier(self, k: int, lo: int = 0, hi: int | None = None, bonus: np.ndarray | None = None) -> Tiered:
        """victims(k), and under lfu every other unlocked slot in [lo, hi) about as cold as the k-th (heat plus
        bonus within its aligned.worth_range), ranked: the slots colder than that tier are `must`, the
        tier's are interchangeable. lru ranks by recency alone: its k victims, all must."""
        hi = self.num_slots if hi is None else hi
        unlocked = int((~self.locked[lo:hi]).sum())
        k = min(k, unlocked)
        if self.policy != "lfu" or k <= 0:
            out = self.victims(k, lo, hi, bonus)
            return Tiered(out, len(out))
        order = self.victims(unlocked, lo, hi, bonus)  # every unlocked slot, in the order victims() evicts them
        heat = self.slot_heat[order] if bonus is None else self.slot_heat[order] + bonus[order] * self._inc
        must, end = tier_bounds(heat, k, self._inc)
        return Tiered(order[:end], must)

    def _first(self, cand: np.ndarray, k: int, lo: int, hi: int, extra: np.ndarray | None = None) -> np.ndarray:
        """The k of cand (slot ids less lo) the policy evicts first, in order, as slot ids; extra: heat added
        to each candidate's (lfu)."""
        k = min(k, len(cand))
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        # stamp * S + slot orders by age then id and makes every key distinct
        keys = self.stamp[lo:hi][cand] * (hi - lo + 1) + cand
        if self.policy == "lfu":
            heat = self.slot_heat[lo:hi][cand]
            if extra is not None:
                heat = heat + extra  # (free slots stay at -inf)
            if k < len(cand):  # the k coldest and everything tied with the k-th, in one pass
                keep = heat <= np.partition(heat, k - 1)[k - 1]
                cand, keys, heat = cand[keep], keys[keep], heat[keep]
            return cand[np.lexsort((keys, heat))[:k]] + lo  # heat first, then the lru key
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
        self.slot_heat[slot] = self.heat[layer, expert]

    def assign_many(self, slots, layer: int, experts) -> None:
        """assign(slots[i], layer, experts[i]) for each i (distinct slots, distinct experts), at once: what the
        slots held stops being resident, then any other slot holding one of the experts is freed. The same table
        as assigning them in turn (test_experts_lru.py), without a Python call per expert: placing an extend's
        first copies ahead (~124 experts, inside its first layer call, before the next layer is queued) took the
        engine thread 0.27 ms one at a time, 0.05 ms at once (the 2-core dev box)."""
        slots = np.asarray(slots, dtype=np.int64).ravel()
        experts = np.asarray(experts, dtype=np.int64).ravel()
        if not len(slots):
            return
        prev = self.owner[slots]
        held = prev[prev != EMPTY]
        self.resident[held // self.num_experts, held % self.num_experts] = EMPTY
        old = self.resident[layer, experts]
        old = old[old != EMPTY]  # (none of them is one of `slots`: those were just cleared)
        self.owner[old], self.stamp[old], self.slot_heat[old] = EMPTY, _FREE_STAMP, -np.inf
        self.resident[layer, experts] = slots
        self.owner[slots] = layer * self.num_experts + experts
        self.stamp[slots] = self.clock
        self.slot_heat[slots] = self.heat[layer, experts]

    def release(self, slots) -> None:
        """The slots hold nothing from now on (their experts stop being resident)."""
        for s in np.asarray(slots, dtype=np.int64).ravel():
            self._evict(int(s))

    def _evict(self, slot: int) -> None:
        prev = self.owner[slot]
        if prev != EMPTY:
            self.resident[prev // self.num_experts, prev % self.num_experts] = EMPTY
        self.owner[slot] = EMPTY
        self.stamp[slot] = _FREE_STAMP
        self.slot_heat[slot] = -np.inf

    def resident_count(self, layer: int) -> int:
        return int((self.resident[layer] != EMPTY).sum())

    def plan_resize(self, num_slots: int) -> list[tuple[int, int]]:
        """Moves (old slot -> new slot) that keep the most recently used residents when resizing.

        Pure: nothing changes until `apply_resize`, so a caller can reject before freeing anything."""
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {num_slots}")
        used = np.flatnonzero(self.owner != EMPTY)
        rank = self.slot_heat[used] if self.policy == "lfu" else self.stamp[used]
        keep = used[np.argsort(-rank, kind="stable")][:num_slots]  # the ones the policy would evict last
        return [(int(s), i) for i, s in enumerate(sorted(keep.tolist()))]

    def apply_resize(self, num_slots: int, moves: list[tuple[int, int]]) -> None:
        owner, stamp, heat = self.owner.copy(), self.stamp.copy(), self.slot_heat.copy()
        self.resident[:] = EMPTY
        self._alloc(num_slots)
        for old, new in moves:
            self.owner[new], self.stamp[new], self.slot_heat[new] = owner[old], stamp[old], heat[old]
            o = owner[old]
            self.resident[o // self.num_experts, o % self.num_experts] = new


def prompt_use_weights(counts, tokens: int, half_life: float = HALF_LIFE) -> np.ndarray:
    """Uses per expert of a prompt's layer call, in decode tokens' units: counts [n] tokens routed to each
    expert, spread evenly over a prompt of `tokens` tokens (every piece of a layer-major prompt weighs by the
    whole prompt). A token k tokens before the prompt's end weighs 2^(-k / half_life), as it would have in a
    decode, so the weights are counts x the mean weight of the prompt's tokens: one token is one use; an 8k
    prompt's routing outweighs older decode history. Counting a prompt's layer call as one use per distinct
    expert instead left the heat flat after a long prompt, and the popular experts had to earn their slots
    back token by token."""
    counts = np.asarray(counts, dtype=np.float64)
    if tokens <= 1:
        return counts
    r = 2.0 ** (-1.0 / half_life)
    return counts * ((1.0 - r ** tokens) / (1.0 - r) / tokens)


def victims_reference(stamp, locked, k: int, heat=None, bonus=None) -> list[int]:
    """Slow reference for `SlotTable.victims`: k scans, each taking the unlocked slot left with the lowest
    (heat + bonus, stamp) — for lru (heat None) (has a bonus, stamp); bonus in the heat's units."""
    taken: list[int] = []
    for _ in range(k):
        best = best_key = None
        for s in range(len(stamp)):
            if locked[s] or s in taken:
                continue
            b = bonus[s] if bonus is not None else 0.0
            key = (b > 0, stamp[s]) if heat is None else (heat[s] + b, stamp[s])
            if best is None or key < best_key:
                best, best_key = s, key
        if best is None:
            break
        taken.append(best)
    return taken
