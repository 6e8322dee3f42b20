"""Bulk placements in few copies (aligned.py): the choice among interchangeable experts and slots, checked on fresh
random candidates against its rules and a brute force, and in a held prompt forward through a slot backend."""
import itertools
import random

import numpy as np
import torch

from engine.experts import aligned, lookahead
from engine.experts import slot_cache as slot_cache_mod
from engine.experts.aligned import Tiered, fill_blocks, pick_aligned, tier_bounds
from engine.experts.compute import expert_mlp
from engine.experts.host_pool import pool_from_source
from engine.experts.hybrid import HybridBackend
from engine.experts.lru import SlotTable
from engine.experts.policy import BandwidthEstimate
from engine.experts.source import ExpertWeights


def blocks(slots) -> int:
    s = np.sort(np.asarray(list(slots), dtype=np.int64))
    return int(len(s) > 0) + int((np.diff(s) != 1).sum())


def test_pick_aligned_takes_the_must_ones_and_pairs_distinct_candidates():
    """On fresh random candidate lists (any sizes, any must counts, n above and below them): as many pairs as the
    shorter list and n allow, distinct experts and slots from the candidates, every must one (up to n) taken; an
    expert whose own slot (slot % E) was taken sits in it unless another expert of the same offset does."""
    rng = np.random.default_rng()
    for _ in range(3000):
        e_count = int(rng.integers(2, 40))
        experts = rng.permutation(e_count)[: rng.integers(0, e_count + 1)]
        slots = rng.permutation(int(rng.integers(1, 4 * e_count)))
        slots = slots[: rng.integers(0, len(slots) + 1)]
        must_e, must_s = int(rng.integers(0, len(experts) + 1)), int(rng.integers(0, len(slots) + 1))
        n = int(rng.integers(0, e_count + 2))
        got_e, got_s = pick_aligned(Tiered(experts, must_e), Tiered(slots, must_s), n, e_count)
        m = min(n, len(experts), len(slots))
        assert len(got_e) == len(got_s) == m == len(set(got_e)) == len(set(got_s))
        assert set(got_e) <= set(experts.tolist()) and set(got_s) <= set(slots.tolist())
        assert set(experts[: min(must_e, m)].tolist()) <= set(got_e)
        assert set(slots[: min(must_s, m)].tolist()) <= set(got_s)
        home = dict(zip(got_e, got_s))
        for s in got_s:
            e = s % e_count
            if e in home:
                assert home[e] % e_count == e  # its own offset, if not this slot then another one
    assert pick_aligned(Tiered(np.arange(8), 0), Tiered(np.arange(16, 24)[::-1].copy(), 0), 5, 8) == \
        ([0, 1, 2, 3, 4], [16, 17, 18, 19, 20])


def test_tiered_without_keeps_what_was_not_taken_in_rank():
    """On fresh random candidates and takings (ids beyond the candidates', repeats, none): the candidates not taken,
    in their order, the must count less the must ones taken, as a set difference does it."""
    rng = np.random.default_rng()
    for _ in range(2000):
        items = rng.permutation(int(rng.integers(1, 300)))[: int(rng.integers(0, 40))]
        tiered = Tiered(items, int(rng.integers(0, len(items) + 1)))
        taken = rng.integers(0, 320, int(rng.integers(0, 30))).tolist()
        if len(items) and rng.random() < 0.5:
            taken += rng.choice(items, int(rng.integers(1, len(items) + 1))).tolist()
        left = tiered.without(taken)
        kept = [i for i in items.tolist() if i not in set(taken)]
        assert left.items.tolist() == kept
        assert left.must == sum(1 for i in items[: tiered.must].tolist() if i not in set(taken))


def test_fill_blocks_finds_the_fewest_blocks_a_brute_force_finds():
    """Against every choice of q free slots, on small random slot sets: the greedy's set (must slots and its
    choice) falls in as few blocks of consecutive slots as the best choice's."""
    rng = random.Random()
    for _ in range(400):
        cand = rng.sample(range(14), rng.randint(1, 10))
        must = cand[: rng.randint(0, len(cand))]
        free = cand[len(must):]
        q = rng.randint(0, len(free) + 1)
        got = fill_blocks(np.array(must, dtype=np.int64), np.array(free, dtype=np.int64), q)
        assert len(got) == min(q, len(free)) and set(got.tolist()) <= set(free)
        best = min(blocks(must + list(c)) for c in itertools.combinations(free, min(q, len(free))))
        assert blocks(must + got.tolist()) == best


def test_the_victim_tier_holds_the_victims_and_the_slots_as_cold_as_the_last():
    """lfu: victims(k) are among the tier's slots, the must ones are colder than the tier, every tier slot's heat
    (with its bonus) within the k-th victim's worth_range; lru: exactly victims(k), all must. Within [lo, hi) when
    given."""
    rng = np.random.default_rng()
    for policy in ("lfu", "lru"):
        for _ in range(200):
            t = SlotTable(3, 16, 40, policy)
            for _ in range(4):
                layer = int(rng.integers(3))
                t.note_use(layer, rng.choice(16, 6, replace=False), weights=rng.integers(1, 9, 6))
                free = np.flatnonzero(t.owner < 0)
                missing = np.flatnonzero(t.resident[layer] < 0)
                n = min(len(free), len(missing), 5)
                t.assign_many(rng.choice(free, n, replace=False), layer, rng.choice(missing, n, replace=False))
                t.tick(int(rng.integers(1, 50)))
            t.lock(rng.choice(40, 5, replace=False))
            bonus = np.where(rng.random(40) < 0.2, rng.random(40) * 5, 0.0)
            lo = int(rng.integers(0, 8)) if rng.random() < 0.5 else 0
            hi = int(rng.integers(32, 41)) if rng.random() < 0.5 else None
            k = int(rng.integers(1, 36))
            tier = t.victim_tier(k, lo, hi, bonus=bonus)
            want = t.victims(k, lo, hi, bonus=bonus)
            assert ((tier.items >= lo) & (tier.items < (hi or 40))).all()
            if policy == "lru":
                assert tier.items.tolist() == want.tolist() and tier.must == len(want)
                continue
            assert set(want.tolist()) <= set(tier.items.tolist()) and tier.must < len(want) <= len(tier.items)
            value = t.slot_heat + bonus * t.moment()[1]
            low, high = aligned.worth_range(value[want[-1]], t.moment()[1])
            inside = value[tier.items[tier.must:]]
            assert (value[tier.items[: tier.must]] < low).all() and ((inside >= low) & (inside <= high)).all()
    # heat 100 uses: the factor decides ([80, 125]); 4 uses: two standard deviations of the count do ([0, 8])
    assert tier_bounds(np.array([-np.inf, -np.inf, 70.0, 81.0, 100.0, 124.0, 126.0]), 5, 1.0) == (3, 6)
    assert tier_bounds(np.array([-np.inf, 0.5, 2.0, 4.0, 7.9, 8.1]), 4, 1.0) == (1, 5)
    assert tier_bounds(np.array([-np.inf, -np.inf, 0.0, 3.0]), 2, 1.0) == (0, 2)
    assert aligned.worth_range(0.0, 1.0) == (0.0, 0.0) and aligned.worth_range(-np.inf, 1.0) == (-np.inf, -np.inf)


def _deep(layers: int, e_count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = ExpertWeights({i: torch.randn(e_count, 24, 16, generator=g) * 0.3 for i in range(layers)},
                        {i: torch.randn(e_count, 16, 12, generator=g) * 0.3 for i in range(layers)})
    return src, pool_from_source(src)


def test_a_held_prompts_copies_ahead_copy_in_few_runs_and_keep_the_outputs(monkeypatch):
    """As after a streamed prompt: 6 layers of 64 experts, 3 windows of slots holding layers 0, 4 and 5 whole, every
    expert with heat from uniform random routing; a held 256-token forward copies ~60% of layers 1-3 ahead, into
    the slots of the layers done. With the choice among the interchangeable experts and slots (aligned.worth_range) the
    copies ahead go in far fewer runs than with rank alone (a tier of exact ties), and the outputs equal the
    per-expert reference either way. The call log counts each layer call's copy calls."""
    monkeypatch.setattr(lookahead, "TOP_UP_S", 0.0)
    layers, e_count, k, seed = 6, 64, 4, int(torch.randint(1 << 30, ()))
    src, deep = _deep(layers, e_count, seed)
    runs: list[int] = []
    real = slot_cache_mod.copy_runs
    monkeypatch.setattr(slot_cache_mod, "copy_runs", lambda e, s: (lambda r: runs.append(len(r)) or r)(real(e, s)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    ids = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(256)])
    w = torch.softmax(torch.randn(256, k, generator=g), -1)
    uses = np.random.default_rng(seed).poisson(64, (layers, e_count)) + 1
    count = {}
    for tier, z in ((1.0, 0.0), (aligned.TIER, aligned.NOISE_Z)):
        monkeypatch.setattr(aligned, "TIER", tier)
        monkeypatch.setattr(aligned, "NOISE_Z", z)
        b = HybridBackend(deep, 3 * e_count, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=1e9, frozen=True),
                          stream_prefill="off", slot_policy="lfu", lookahead="on")
        monkeypatch.setattr(b, "split", lambda m, busy=0, per=1.0, tail=False: 0)
        monkeypatch.setattr(b, "ahead_fills", lambda expected, likely, *a: int(0.6 * expected))
        for layer in range(layers):
            b.cache.table.note_use(layer, np.arange(e_count), weights=uses[layer])
        for layer in (0, 4, 5):
            b.cache.admit(layer, list(range(e_count)), coalesce=True)
            b.cache.table.unlock_all()
        runs.clear()
        b.call_log = []
        b.begin_forward(256, k, hold=True, span=256)
        for layer in range(layers):
            y = b.forward(layer, x, ids, w)
            want = torch.zeros_like(x)
            for e in range(e_count):
                we = (w * (ids == e)).sum(1, keepdim=True)
                want += we * expert_mlp(x, src.gate_up(layer, e), src.down(layer, e))
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        b.end_forward()
        assert int(b.stats()["total"]["ahead"]) >= 3 * 30
        count[tier] = sum(runs)
        assert sum(c.copies for c in b.call_log) == count[tier]  # each layer call's copies in the call log
    assert count[aligned.TIER] * 2 <= count[1.0], count  # (2.7-3.0x on the dev box)
