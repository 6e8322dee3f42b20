"""SlotCache's copies: coalesced runs against one copy per expert, on fresh random experts and victims."""
import random

import torch

from engine.experts.host_pool import pool_from_source
from engine.experts.slot_cache import SlotCache, copy_runs, pair_sorted
from engine.experts.source import ExpertWeights


def test_pair_sorted_gives_every_victim_once_in_experts_order():
    rng = random.Random()
    for _ in range(200):
        n = rng.randint(1, 40)
        experts = rng.sample(range(64), n)
        victims = rng.sample(range(100), n)
        slots = pair_sorted(experts, victims)
        assert sorted(slots) == sorted(victims)
        by_expert = sorted(zip(experts, slots))
        assert [s for _, s in by_expert] == sorted(victims)  # the i-th smallest expert, the i-th smallest slot


def test_copy_runs_cover_each_pair_once_and_merge_only_where_both_step_by_one():
    rng = random.Random()
    for _ in range(200):
        n = rng.randint(1, 40)
        experts = rng.sample(range(64), n)
        slots = pair_sorted(experts, rng.sample(range(100), n)) if rng.random() < 0.5 else rng.sample(range(100), n)
        runs = copy_runs(experts, slots)
        covered = [(e + i, s + i) for e, s, c in runs for i in range(c)]
        assert sorted(covered) == sorted(zip(experts, slots))
        for (e0, s0, c0), (e1, s1, _) in zip(runs, runs[1:]):
            assert not (e0 + c0 == e1 and s0 + c0 == s1)  # a mergeable neighbour would have been merged
    assert copy_runs(list(range(10, 20)), list(range(5, 15))) == [(10, 5, 10)]


def _cache(slots: int, E: int = 16, H: int = 8, I: int = 4, seed: int | None = None) -> SlotCache:
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    src = ExpertWeights({0: torch.randn(E, 2 * I, H, generator=g), 1: torch.randn(E, 2 * I, H, generator=g)},
                        {0: torch.randn(E, H, I, generator=g), 1: torch.randn(E, H, I, generator=g)})
    return SlotCache(pool_from_source(src), slots, "cpu", "lfu")


def test_admit_puts_each_expert_in_its_returned_slot_coalesced_or_not():
    rng = random.Random()
    for coalesce in (False, True):
        for _ in range(20):
            cache = _cache(slots=24)
            for layer in (0, 1, 0):
                want = rng.sample(range(16), rng.randint(1, 12))
                found = cache.lookup(layer, want)
                missing = [e for e, s in zip(want, found) if s < 0]
                slots = cache.admit(layer, missing, coalesce=coalesce)
                host = cache.pool.wait_layer(layer)
                for e, s in zip(missing, slots):
                    assert torch.equal(cache.buf[s], host[e])
                    assert cache.lookup(layer, [e])[0] == s
                cache.table.unlock_all()


def test_a_streamed_layer_copies_in_one_run_per_layer(monkeypatch):
    """A whole layer streamed into free slots, then into the slots of the layer before: one copy each."""
    from engine.experts import slot_cache

    cache, runs = _cache(slots=32), []
    monkeypatch.setattr(slot_cache, "copy_runs", lambda e, s: runs.append(copy_runs(e, s)) or runs[-1])
    for layer in (0, 1, 0):
        cache.admit(layer, list(range(16)), coalesce=True)
        cache.table.unlock_all()
    assert [len(r) for r in runs] == [1, 1, 1]
