"""Copies ahead: while a routed prompt's MoE layer runs, the next layer's likely misses copy into the slots.

Without them PCIe waits for each layer's routing to come back before it starts on that layer's fills. The
experts copied are those the prompt's tokens touch with probability AHEAD_TOUCHED or more by the slot table's
heat (prefill_stream.pick_probability, made per forward in OffloadBackend.begin_forward), as many as the
backend's ahead_fills asks for (offload: all, hybrid: the fill share of the next layer's expected misses, scaled
by TouchRatio, with the copies still in flight ahead of them counted), or every expert the next layer lacks when
the rest take under TOP_UP_S to copy (a backend that fills, `tops_up`), into slots holding experts no later layer
will likely read (_kept). Which of the near-certain experts about as likely as the last one planned go, and into
which of the slots about as cold as the last victim, is chosen for few copy runs (_ahead_tier, aligned.py). A
layer's own fills place by keep_bonus.

CopiesAhead is the part of OffloadBackend that plans them; it reads the backend's cache, pool, stats_,
lookahead, ahead_fills, touch_ratio and _behind, and the forward's _touch, _pick, _ahead, _looked, _seen, _tokens,
_top_k and _held.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.experts import aligned
from engine.experts.aligned import Tiered
from engine.experts.prefill_stream import KEEP_RATIO, LIKELY_READ, touch_of
from engine.experts.slot_cache import COALESCE_FILLS

# a routed prompt forward copies the next MoE layer's likely misses while a layer runs (`lookahead`): the
# experts its tokens touch with at least this probability by the slot table's heat
AHEAD_TOUCHED = 0.9
# ... and all of its missing experts when the ones beyond those copy in within this many seconds at the fill rate:
# then the layer runs wholly resident, its routing never read back (DeviceRuns._forward_unread). A routed
# layer call with a miss or a few cost 2-3 ms more than a resident one: an extend's layer 6 of 8, routed for 1 and
# for 6 misses, took 3.8 ms (H200 box) and 4.8 ms (H100 box), its resident layer 7 1.6 ms (docs/PERF.md,
# thirty-third session)
TOP_UP_S = 0.002
# The heat predicts each expert's share of a layer's routing, not how the tokens of one prompt cluster: similar
# tokens pick similar experts, so fewer distinct experts are touched than independent picks would touch (the
# synthetic Zipf 1.0 checkpoint, 256 tokens: ~215 of 256 where independent picks by the heat say ~234-252, and hybrid's
# copies ahead, planned for misses that never came, left the CPU idle half of each layer: H100 box, docs/PERF.md
# thirty-sixth session). Among the experts a call's tokens touch with less than TOUCH_CERTAIN probability by the
# heat, the distinct ones they touched over the predicted number (TouchRatio) scales the next layers' expected
# misses of that kind; the near-certain ones are touched whatever the clustering (and a uniform heat makes every
# expert near-certain from ~150 tokens of top 8 of 256 on: no ratio is learned, none applied).
TOUCH_CERTAIN = 0.99
TOUCH_ALPHA = 0.25  # the ratio's EMA weight per routed prompt call
TOUCH_RANGE = (0.25, 1.5)
LOOKAHEAD_MODES = ("auto", "on", "off")


class CopiesAhead:
    def keep_bonus(self, layer: int) -> np.ndarray | None:
        """[S] uses to add to each slot's heat for the fills' victims (SlotTable.victims) in a routed prompt
        forward: a resident of a layer after `layer` (or of `layer` itself, for its later pieces in a held
        forward) counts as KEEP_RATIO x its heat at the forward's end (what the prompt's tokens will add, and
        the refill its eviction would cost: REFILL_USES). So a layer's fills land where the layers before it
        worked, unless a resident there is several times hotter than what a later layer will read. The slots of
        a later layer holding every one of its experts (_whole_later) go after all others, the farthest such
        layer's first. None outside a routed prompt forward."""
        if self._ahead is None:
            return None
        t, e = self.cache.table, self.pool.num_experts
        owner = t.owner
        rows, row = owner // e, self.pool.row[layer]
        later = (owner >= 0) & ((rows > row) | ((rows == row) & self._held))
        out = np.zeros(len(owner))
        uses = t.slot_heat / t.moment()[1]  # each slot's heat in uses now
        # victims adds the heat back: KEEP_RATIO x (heat + ahead)
        out[later] = (KEEP_RATIO - 1) * uses[later] + KEEP_RATIO * self._ahead[rows[later], owner[later] % e]
        whole = self._whole_later(later)
        if whole.any():  # above every other slot's heat and bonus: each such layer one step higher, the nearest top
            floor = float(uses[np.isfinite(uses)].max(initial=0.0)) + float(out.max()) + 1.0
            out[whole] += floor * (len(self.pool.layers) - rows[whole])
        return out

    def _whole_later(self, later: np.ndarray) -> np.ndarray:
        """[S] of the slots `later` (those of layers still to run), the ones whose layer holds every one of its
        experts. Such a layer runs unread (DeviceRuns._forward_unread); one expert taken from it, and it reads its
        routing back and handles the miss, 2-3 ms more (TOP_UP_S) than the refill of the expert taken alone. An
        extend's layer 6 of 8 ran routed with 5-10 misses in every profiled extend although layer 5 had copied
        none ahead for it (none were missing when it planned): its fills had taken them (H100 and H200 boxes,
        docs/PERF.md forty-fifth and forty-sixth sessions)."""
        t = self.cache.table
        whole = (t.resident >= 0).all(1)
        return later & whole[t.owner // self.pool.num_experts]

    def _ahead_plan(self, layer: int, behind: int, inputs: "AheadInputs | None" = None):
        """For a routed prompt forward with `lookahead`: (the next MoE layer, its likely misses to copy in
        while this layer runs, most likely first, the slots they and this layer's fills may take: unlocked and
        not _kept) or None. behind: experts' worth of copies still in flight, that these queue behind; inputs:
        the next row's _ahead_inputs, made earlier in the call."""
        return self._plan_row(self.pool.row[layer] + 1, behind, inputs) if self._looking_ahead() else None

    def _ahead_inputs(self, layer: int) -> "AheadInputs | None":
        """What _ahead_plan reads of the layer after `layer` that this layer's routing leaves as it is (None
        outside a routed prompt forward with `lookahead`, or at the last MoE layer): made while the host waits
        for the routing's read-back (OffloadBackend.forward), not in the CPU's idle time between two jobs of an
        extend, where it took ~0.09 ms a layer call on the dev box and ~0.15 ms on the H100 box. The copies still
        in flight and the split's rates are read after the read-back: earlier, they counted copies that end
        before these queue (docs/PERF.md, thirty-eighth session)."""
        i = self.pool.row[layer] + 1
        return self._row_inputs(i) if self._looking_ahead() and i < len(self.pool.layers) and not self._whole(i) \
            else None

    def _row_inputs(self, i: int) -> "AheadInputs":
        """Pool row i's AheadInputs, as the slot table and the forward's touch probabilities stand now."""
        t, p = self.cache.table, self._touch[i]
        missing = t.resident[i] < 0
        likely = np.flatnonzero(missing & (p >= AHEAD_TOUCHED))
        # the running row's own slots count: the copies may take them once its kernels have read them (_copy_ahead)
        spare = int(((~t.locked | self._running_slots(i - 1)) & ~self._kept(i - 1)).sum())
        unsure = missing & (p < TOUCH_CERTAIN)
        expected = float(p[missing & ~unsure].sum()) + float(p[unsure].sum()) * self.touch_ratio.of(self._tokens)
        order = likely[np.lexsort((-t.heat[i][likely], -p[likely]))]
        return AheadInputs(i, missing, order, spare, expected, self._cpu_pairs(i, missing))

    def _plan_row(self, i: int, behind: int, inputs: "AheadInputs | None" = None):
        """_ahead_plan for pool row i, the rows before it run (none: i = 0, copied before the forward's first
        layer), from its _row_inputs (made now unless given)."""
        if i == len(self.pool.layers) or self._whole(i):
            return None
        if inputs is None or inputs.row != i:
            inputs = self._row_inputs(i)
        _, missing, order, spare, expected, pairs = inputs
        want = self.ahead_fills(expected, len(order), pairs, behind)
        if 0 < want < len(order):  # the CPU's share is what the copies leave: under skew, its colder experts
            rest = missing.copy()
            rest[order[:want]] = False
            want = self.ahead_fills(expected, len(order), self._cpu_pairs(i, rest), behind)
        want = min(want, spare)
        absent = np.flatnonzero(missing)
        if self.tops_up and want < len(absent) <= spare \
                and (len(absent) - want) * self.pool.expert_bytes <= TOP_UP_S * self.fill_rate():
            heat, p = self.cache.table.heat[i], self._touch[i]
            return self.pool.layers[i], absent[np.lexsort((-heat[absent], -p[absent]))], spare
        if want <= 0:
            return None
        return self.pool.layers[i], order[:want], spare

    def _whole(self, i: int) -> bool:
        """Whether pool row i holds every one of its experts: nothing to copy ahead, so no plan and no inputs for
        one (_row_inputs took ~0.26 ms of the engine thread on the dev box, ~0.5 on the box; an extend's
        resident last layers are queued after its last CPU job, the device waiting for them)."""
        return bool((self.cache.table.resident[i] >= 0).all())

    def _cpu_pairs(self, i: int, experts: np.ndarray) -> float:
        """The (token, expert) pairs a CPU job of pool row i's `experts` (a mask) is expected to run per expert
        it touches: the job's rate follows them (policy.PER_BUCKETS). Under skew the experts the copies leave
        to the CPU are the cold ones (256 tokens, a Zipf 1.0 heat: ~4 pairs each where the layer's touched
        experts average ~8-9), which run at the rate of fewer pairs."""
        touched = float(self._touch[i][experts].sum())
        return self._tokens * float(self._pick[i][experts].sum()) / touched if touched > 0 else 1.0

    def _running_slots(self, row: int) -> np.ndarray:
        """[S] slots holding pool row `row`'s experts (none for row -1)."""
        owner = self.cache.table.owner
        return (owner >= 0) & (owner // self.pool.num_experts == row) if row >= 0 else np.zeros(len(owner), bool)

    def _kept(self, running: int) -> np.ndarray:
        """[S] slots a copy ahead leaves alone while pool row `running` runs: those holding an expert that a
        layer still to run (or this one, when more of its pieces follow) will likely read (touched with p >=
        LIKELY_READ), or any expert of such a layer that holds all of its own (_whole_later). A cold resident of
        any other later layer goes for a likely miss of the next."""
        owner, e = self.cache.table.owner, self.pool.num_experts
        rows = owner // e
        later = (owner >= 0) & ((rows > running) | ((rows == running) & self._more_pieces(running)))
        out = self._whole_later(later)
        out[later] |= self._touch[rows[later], owner[later] % e] >= LIKELY_READ
        return out

    def _more_pieces(self, row: int) -> bool:
        """Whether the held forward runs more pieces of pool row `row` after the one running (its tokens so far
        fall short of the forward's)."""
        return self._held and self._seen.get(row, 0) < self._tokens

    def _copy_ahead(self, layer: int, experts: np.ndarray, *, with_cpu: bool, after, then: bool = True) -> None:
        """Copy `experts` of `layer` (the next MoE layer) into unlocked slots _kept leaves, on the copy stream
        behind this layer's fills (after `after`: the last reader of those slots is queued before it); then, with
        `then`, the rest into the running layer's own slots, unlocked for it, after an event recorded now (its
        kernels, queued before this, read them first). Without the second batch the copy engine idled through a
        layer's CPU share whenever the layers still to run held every other slot (H200 box, 8 layers, 37.5% in
        slots: the first layer's copies waited for the second's routing). Counted as fills of `layer` and as
        `ahead` (a wrong guess shows as ahead - ahead_used)."""
        t = self.cache.table
        bonus = np.where(self._kept(self.pool.row[layer] - 1), np.inf, 0.0)  # never taken
        cand = self._ahead_tier(layer, experts)
        looked: list[int] = []
        for batch in range(2 if then else 1):
            if batch:
                t.locked[self._running_slots(self.pool.row[layer] - 1)] = False
                after = self.cache.mark()
            n = min(len(experts) - len(looked), int((~t.locked & (bonus == 0)).sum()))
            if n <= 0:
                continue
            if n > COALESCE_FILLS:
                got = self.cache.admit_tiered(layer, cand, n, with_cpu=with_cpu, after=after, bonus=bonus)[0]
            else:
                got = cand.items[:n].tolist()
                got = got[: len(self.cache.admit(layer, got, with_cpu=with_cpu, after=after, bonus=bonus))]
            looked += got
            cand = cand.without(got)
            if len(looked) == len(experts):
                break
        placed = len(looked)
        if not placed:
            return
        self._looked[layer] = np.asarray(looked)
        st = self.stats_[layer]
        st.fills += placed
        st.ahead += placed
        st.bytes_moved += placed * self.pool.expert_bytes

    def _ahead_tier(self, layer: int, experts: np.ndarray) -> Tiered:
        """The copies ahead `experts` planned for `layer` (most likely first), with the experts they may give way to:
        when the last of them is near-certain to be read (TOUCH_CERTAIN), every missing expert of the layer as
        near-certain whose heat is within that one's aligned.worth_range is as much worth copying, the planned ones
        above that range first (aligned.pick_aligned then chooses among the rest for runs)."""
        experts = np.asarray(experts, dtype=np.int64)
        row, t = self.pool.row[layer], self.cache.table
        p, heat = self._touch[row], t.heat[row]
        if not len(experts) or p[experts[-1]] < TOUCH_CERTAIN:
            return Tiered(experts, len(experts))
        lo, hi = aligned.worth_range(float(heat[experts[-1]]), t.moment()[1])
        mates = (t.resident[row] < 0) & (p >= TOUCH_CERTAIN) & (heat >= lo) & (heat <= hi)
        above = ~mates[experts]
        mates[experts] = False
        return Tiered(np.concatenate([experts[above], experts[~above], np.flatnonzero(mates)]), int(above.sum()))

    def _observe_touch(self, layer: int, experts: np.ndarray, tokens: int) -> None:
        """A routed prompt call of `tokens` tokens to `experts` (distinct) of `layer`: how many of those the heat
        gave under TOUCH_CERTAIN it touched, against the heat's prediction (touch_ratio)."""
        if tokens > 1 and self._pick is not None:
            p = touch_of(self._pick[self.pool.row[layer]], tokens)
            unsure = p < TOUCH_CERTAIN
            if unsure.any():
                self.touch_ratio.observe(tokens, int(unsure[experts].sum()), float(p[unsure].sum()))

    def _count_looked(self, layer: int, experts: np.ndarray) -> None:
        """The copies ahead into `layer` that its routing used (experts: the distinct experts it routed to)."""
        looked = self._looked.pop(layer, None)
        if looked is not None:
            routed = np.zeros(self.pool.num_experts, dtype=bool)
            routed[experts] = True
            self.stats_[layer].ahead_used += int(routed[looked].sum())

    def _looking_ahead(self) -> bool:
        """A routed prompt forward runs with `lookahead` (its touch probabilities known)."""
        return self.lookahead and self._touch is not None


class AheadInputs(NamedTuple):
    """Pool row i's part of its copies-ahead plan that the running layer's routing leaves as it is
    (CopiesAhead._row_inputs)."""

    row: int
    missing: np.ndarray  # [E] bool: not in a slot
    order: np.ndarray  # the missing experts touched with p >= AHEAD_TOUCHED, most likely first, then hottest
    spare: int  # slots the copies may take
    expected: float  # misses the heat predicts, scaled by TouchRatio
    pairs: float  # _cpu_pairs of every missing expert


class TouchRatio:
    """Per power of two of a routed prompt call's tokens, the distinct experts such calls touched over the number
    the heat predicted, both among the experts it gave under TOUCH_CERTAIN (TOUCH_ALPHA's EMA, kept in
    TOUCH_RANGE): clustering shows most in short prompts. A size never seen takes the nearest size's; 1 until a
    call is seen."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}  # 2^k -> ratio of calls of 2^k to 2^(k+1) - 1 tokens

    def of(self, tokens: int) -> float:
        if not self.values:
            return 1.0
        k = _size(tokens)
        return self.values[min(self.values, key=lambda size: (abs(size.bit_length() - k.bit_length()), -size))]

    def observe(self, tokens: int, touched: int, predicted: float) -> None:
        if predicted > 0:
            ratio = min(TOUCH_RANGE[1], max(TOUCH_RANGE[0], touched / predicted))
            k = _size(tokens)
            value = self.values.get(k, self.of(tokens))
            self.values[k] = value + TOUCH_ALPHA * (ratio - value)


def _size(tokens: int) -> int:
    return 1 << (max(1, tokens).bit_length() - 1)
