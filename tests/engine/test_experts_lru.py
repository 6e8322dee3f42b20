"""SlotTable (torch-free): one-pass victim choice equals the k-scan reference for both policies; residency
invariants; lfu's heat halves every half-life and keeps popular experts LRU evicts."""
import subprocess
import sys

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.experts.lru import EMPTY, SlotTable, prompt_use_weights, victims_reference


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 20), st.booleans()), min_size=1, max_size=40), st.integers(0, 45))
def test_victims_equal_reference(slots, k):
    t = SlotTable(2, 4, len(slots))
    t.stamp[:] = [s for s, _ in slots]
    t.locked[:] = [lk for _, lk in slots]
    assert t.victims(k).tolist() == victims_reference(t.stamp.tolist(), t.locked.tolist(), k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 3), st.booleans()), min_size=1, max_size=40),
       st.integers(0, 45))
def test_lfu_victims_equal_reference(slots, k):
    """Heat ties (same value, free slots at -inf) break by stamp, then slot id, as the reference's scan."""
    t = SlotTable(2, 4, len(slots), policy="lfu")
    t.slot_heat[:] = [-np.inf if h < 0 else float(h) for h, _, _ in slots]
    t.stamp[:] = [s for _, s, _ in slots]
    t.locked[:] = [lk for _, _, lk in slots]
    want = victims_reference(t.stamp.tolist(), t.locked.tolist(), k, heat=t.slot_heat.tolist())
    assert t.victims(k).tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 3), st.booleans(),
                          st.sampled_from([0.0, 0.0, 0.5, 2.0, 7.0])), min_size=1, max_size=40),
       st.integers(0, 45), st.sampled_from(["lru", "lfu"]), st.integers(0, 3))
def test_victims_with_a_bonus_equal_reference(slots, k, policy, lo):
    """lfu adds each slot's bonus to its heat (in uses now: the table's increment), lru takes the slots with a
    bonus last; over a range [lo, hi) too; no bonus anywhere is no bonus at all."""
    t = SlotTable(2, 4, len(slots), policy=policy)
    for _ in range(5):
        t.tick()  # an increment other than 1: the bonus is in uses now
    t.slot_heat[:] = [-np.inf if h < 0 else float(h) for h, _, _, _ in slots]
    t.stamp[:] = [s for _, s, _, _ in slots]
    t.locked[:] = [lk for _, _, lk, _ in slots]
    bonus = np.array([b for _, _, _, b in slots])
    lo = min(lo, len(slots) - 1)
    heat = t.slot_heat[lo:].tolist() if policy == "lfu" else None
    want = victims_reference(t.stamp[lo:].tolist(), t.locked[lo:].tolist(), k, heat=heat,
                             bonus=(bonus[lo:] * t.moment()[1]).tolist())
    assert t.victims(k, lo=lo, bonus=bonus).tolist() == [w + lo for w in want]
    if not bonus.any():
        assert t.victims(k, lo=lo, bonus=bonus).tolist() == t.victims(k, lo=lo).tolist()


def test_lfu_heat_halves_every_half_life_and_survives_rescaling():
    t = SlotTable(2, 4, 2, policy="lfu", half_life=3)
    t.tick()
    t.note_use(0, [1])
    for _ in range(3 * 2):  # three tokens of two layer steps
        t.tick()
    t.note_use(0, [2])
    assert t.heat[0, 2] == pytest.approx(2 * t.heat[0, 1])  # the older use counts half
    t._inc = 2e200
    t.tick()  # rescaled: same order, finite values
    assert np.isfinite(t.heat).all() and t.heat[0, 2] == pytest.approx(2 * t.heat[0, 1])


def test_lfu_keeps_the_popular_expert_lru_evicts():
    """Layer-cyclic access, one expert of each layer popular: with one slot per layer plus one, LRU evicts the
    popular experts between their uses; lfu keeps them and churns only the extra slot."""
    hits = {}
    for policy in ("lru", "lfu"):
        t = SlotTable(3, 8, 4, policy=policy)
        n = 0
        for step in range(60):
            for layer in range(3):
                e = 0 if step % 3 else 1 + step % 7  # expert 0 two tokens in three, else a one-off
                t.tick()
                t.note_use(layer, [e])
                s = t.lookup(layer, [e])[0]
                if s == EMPTY:
                    s = int(t.victims(1)[0])
                    t.assign(s, layer, e)
                elif step >= 10:
                    n += 1
                t.touch([s])
        hits[policy] = n
    assert hits["lfu"] > 1.3 * hits["lru"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="lru, lfu"):
        SlotTable(1, 4, 2, policy="fifo")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=60), st.integers(1, 7))
def test_assign_keeps_table_consistent(uses, num_slots):
    t = SlotTable(3, 6, num_slots)
    for layer, e in uses:
        t.tick()
        s = t.lookup(layer, [e])[0]
        if s == EMPTY:
            s = int(t.victims(1)[0])
            t.assign(s, layer, e)
        t.touch([s])
        assert t.resident[layer, e] == s and t.owner[s] == layer * 6 + e
    res = t.resident[t.resident != EMPTY]
    assert len(set(res.tolist())) == len(res) <= num_slots
    # the most recent distinct uses are the residents (LRU)
    recent = list(dict.fromkeys(reversed(uses)))[:num_slots]
    assert all(t.resident[layer, e] != EMPTY for layer, e in recent)


def test_victims_prefer_free_then_oldest_and_skip_locked():
    t = SlotTable(1, 8, 4)
    for e in range(2):
        t.tick()
        t.assign(e, 0, e)
    t.lock([0])
    assert t.victims(3).tolist() == [2, 3, 1]
    assert t.victims(2, lo=1, hi=3).tolist() == [2, 1]


def test_resize_keeps_the_hottest_under_lfu():
    t = SlotTable(1, 8, 4, policy="lfu")
    for e in range(4):
        t.tick()
        t.note_use(0, [e])
        t.assign(e, 0, e)
    for e in (1, 1, 2):  # experts 1 and 2 are used most
        t.note_use(0, [e])
    t.apply_resize(2, t.plan_resize(2))
    assert sorted(np.flatnonzero(t.resident[0] != EMPTY).tolist()) == [1, 2]


def test_resize_keeps_most_recent():
    t = SlotTable(1, 8, 4)
    for e in range(4):
        t.tick()
        t.assign(e, 0, e)
    t.tick()
    t.touch([0])  # expert 0 is now the newest
    moves = t.plan_resize(2)
    t.apply_resize(2, moves)
    assert sorted(t.resident[0][t.resident[0] != EMPTY].tolist()) == [0, 1]
    assert t.resident[0, 0] != EMPTY and t.resident[0, 3] != EMPTY and t.resident[0, 1] == EMPTY


def test_policy_modules_import_no_torch():
    code = ("import sys, engine.experts.lru, engine.experts.policy, engine.experts.stats, "
            "engine.experts.prefill_stream, engine.experts.registry; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_use_counted_later_weighs_as_if_counted_when_it_ran():
    """A streamed prefill counts its layer calls after the forward (OffloadBackend.settle): with the moment()
    of each call, heat and stamps end where counting each call at once leaves them, across rescales too, and a
    slot filled after the call keeps its newer stamp."""
    rng = np.random.default_rng()
    now, later = SlotTable(2, 8, 6, "lfu", half_life=0.1), SlotTable(2, 8, 6, "lfu", half_life=0.1)
    for t in (now, later):
        t.assign(0, 0, 1)
        t.assign(1, 1, 2)
    pending = []
    for step in range(400):  # a half-life of 0.1 token rescales the increment every ~133 ticks
        layer, experts = int(rng.integers(2)), rng.choice(8, size=3, replace=False)
        for t in (now, later):
            t.tick()
        now.note_use(layer, experts)
        now.touch(now.resident[layer, experts][now.resident[layer, experts] >= 0])
        pending.append((layer, experts, later.moment()))
    assert len(later._rescales) >= 2  # the test crossed rescales
    for layer, experts, at in pending:
        later.note_use(layer, experts, at=at)
        slots = later.resident[layer, experts]
        later.touch(slots[slots >= 0], clock=at[0])
    np.testing.assert_allclose(later.heat, now.heat, rtol=1e-9)
    np.testing.assert_allclose(later.slot_heat, now.slot_heat, rtol=1e-9)
    assert (later.stamp == now.stamp).all()
    later.assign(2, 0, 5)
    later.touch([2], clock=1)
    assert later.stamp[2] == later.clock


def test_ticks_at_once_equal_ticks_one_by_one_and_a_long_prompt_does_not_overflow():
    one, many = (SlotTable(2, 4, 2, policy="lfu", half_life=0.5) for _ in range(2))
    for t in (one, many):
        t.note_use(0, [1])
    for _ in range(700):  # 350 tokens at a half-life of half a token: rescales on the way
        one.tick()
    many.tick(700)
    for t in (one, many):
        t.note_use(0, [2])
    assert one.clock == many.clock == 700
    assert many.heat[0, 2] / many.heat[0, 1] == pytest.approx(one.heat[0, 2] / one.heat[0, 1], rel=1e-6)
    huge = SlotTable(40, 256, 8, policy="lfu")
    huge.note_use(3, [7])
    huge.tokens_passed(10_000_000)  # 2^39062 in one product would be inf
    huge.note_use(3, [8])
    assert np.isfinite(huge.heat).all() and huge.heat[3, 8] > 0 and huge._inc < 1e200


def test_a_prompts_uses_weigh_each_token_as_a_decoded_one_would():
    """prompt_use_weights against the sum over the prompt's tokens one by one (token k before the end weighs
    2^(-k / half-life)), for tokens spread evenly over the call; a single token is one use."""
    hl, T = 64.0, 300
    counts = np.array([300, 30, 3, 0])
    got = prompt_use_weights(counts, T, half_life=hl)
    per_token = 2.0 ** (-np.arange(T) / hl)  # the prompt's last token first
    np.testing.assert_allclose(got, counts * per_token.mean(), rtol=1e-12)
    assert got[0] == pytest.approx(per_token.sum())  # an expert every token routes to: all of them
    np.testing.assert_array_equal(prompt_use_weights(counts, 1), counts)
    # a table that saw the prompt through tokens_passed and one tick a layer call ages the older heat alike
    t = SlotTable(1, 4, 2, policy="lfu", half_life=hl)
    t.note_use(0, [3])  # a decode use before the prompt
    t.tokens_passed(T - 1)
    t.tick()
    t.note_use(0, [0, 1, 2], weights=got[:3])
    assert t.heat[0, 3] / t._inc == pytest.approx(2.0 ** (-T / hl), rel=1e-9)
    assert t.heat[0, 0] / t._inc == pytest.approx(per_token.sum(), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=30),
       st.integers(0, 2), st.data())
def test_assign_many_equals_assigning_in_turn(num_slots, history, layer, data):
    """assign_many on any table (slots full, partly free, experts resident elsewhere or in the very slots they
    go to) leaves the table assign() one pair at a time leaves."""
    tables = [SlotTable(3, 6, num_slots, policy="lfu") for _ in range(2)]
    for t in tables:
        for i, (row, e) in enumerate(history):  # the same past on both
            t.tick()
            t.note_use(row, np.array([e]))
            if t.resident[row, e] == EMPTY:
                t.assign(i % num_slots, row, e)
    n = data.draw(st.integers(0, min(num_slots, 6)))
    slots = data.draw(st.permutations(range(num_slots)))[:n]
    experts = data.draw(st.permutations(range(6)))[:n]
    for s, e in zip(slots, experts):
        tables[0].assign(s, layer, e)
    tables[1].assign_many(slots, layer, experts)
    for name in ("resident", "owner", "stamp", "slot_heat"):
        np.testing.assert_array_equal(getattr(tables[0], name), getattr(tables[1], name), err_msg=name)
