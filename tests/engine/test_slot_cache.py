"""SlotCache's copies: coalesced runs against one copy per expert, on fresh random experts and victims."""
import random

import numpy as np
import pytest
import torch

from engine.experts.host_pool import pool_from_source
from engine.experts.aligned import pair_sorted
from engine.experts.slot_cache import NUMPY_RUNS, SlotCache, copy_backlog, copy_runs, copy_runs_loop, window_runs
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


def test_copy_runs_of_many_pairs_are_those_made_one_pair_at_a_time():
    """copy_runs' numpy way (NUMPY_RUNS pairs or more) against the loop, on fresh pairs: scattered, aligned runs
    (an expert to its own offset), a repeated expert, across the threshold."""
    rng = random.Random()
    for _ in range(200):
        n = rng.randint(NUMPY_RUNS - 2, 300)
        experts = rng.sample(range(512), n)
        kind = rng.random()
        if kind < 0.4:
            slots = rng.sample(range(1024), n)
        else:
            base = rng.choice([0, 256, 512])
            slots = [base + e if rng.random() < 0.9 else 2000 + i for i, e in enumerate(experts)]
        if kind > 0.9:
            experts[-1] = experts[0]  # (a caller's repeat: kept as its own run)
        assert copy_runs(experts, slots) == copy_runs_loop(experts, slots), (experts, slots)


def test_window_runs_counts_the_copy_runs_of_a_window():
    """stream_layer's decision counts runs without building them: as many as copy_runs builds for ascending
    experts copied to the same offsets of a window."""
    rng = random.Random()
    for _ in range(200):
        todo = np.array(sorted(rng.sample(range(64), rng.randint(0, 40))), dtype=np.int64)
        base = 64 * rng.randint(0, 3)
        assert window_runs(todo) == len(copy_runs(todo.tolist(), (base + todo).tolist()))
    assert window_runs(np.arange(64)) == 1 and window_runs(np.array([], dtype=np.int64)) == 0


def _cache(slots: int, E: int = 16, H: int = 8, I: int = 4, seed: int | None = None, layers: int = 2) -> SlotCache:
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    src = ExpertWeights({i: torch.randn(E, 2 * I, H, generator=g) for i in range(layers)},
                        {i: torch.randn(E, H, I, generator=g) for i in range(layers)})
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


def test_stream_layer_moves_the_whole_layer_into_its_window_and_keeps_everything_else():
    """stream_layer on a randomly filled table (both layers scattered over both windows and the slots past
    them, the streamed layer sometimes mostly in place already): the layer ends up resident, read from the
    window or from past the windows only, the bytes in every slot it names are its experts', every other
    layer's resident is either untouched (table and bytes) or gone, and the table stays one-to-one. The copy
    is one run of the whole layer, or (the layer mostly in place) only the experts not in place, in at most
    PARTIAL_RUNS runs, or nothing at all."""
    from engine.experts import slot_cache

    rng = random.Random()
    for _ in range(60):
        E = 16
        cache = _cache(slots=2 * E + rng.randint(0, 12), layers=3)
        for layer in (0, 1, 2):
            cache.admit(layer, rng.sample(range(E), rng.randint(0, E)))
            cache.table.unlock_all()
        layer, other = rng.sample((0, 1, 2), 2)
        window = rng.choice((0, 1))
        lo, hi = window * E, (window + 1) * E
        if rng.random() < 0.5:  # kept from a forward before: in place, but for a few slots
            cache.stream_layer(layer, window)
            cache.table.unlock_all()
            for s in rng.sample(range(lo, hi), rng.choice((0, 1, 3, 12))):
                cache.table.release([s])
        t = cache.table
        others = {(o, e): int(s) for o in (0, 1, 2) if o != layer
                  for e, s in enumerate(cache.lookup(o, range(E))) if s >= 0}
        kept = {k: cache.buf[s].clone() for k, s in others.items()}
        past = {e: int(s) for e, s in enumerate(cache.lookup(layer, range(E))) if s >= 2 * E}
        in_place = {e for e in range(E) if cache.lookup(layer, [e])[0] == lo + e}
        calls = []
        real = cache._copy
        cache._copy = lambda lay, experts, slots, *a: calls.append(slot_cache.copy_runs(experts, slots)) or \
            real(lay, experts, slots, *a)
        slots, copied, table, nbytes = cache.stream_layer(layer, window)
        todo = E - len(past) - len(in_place - set(past))
        assert copied == todo
        if not todo:
            assert calls == [] and nbytes == 0
        elif calls[0] == [(0, lo, E)]:
            assert nbytes == E * cache.pool.expert_bytes  # the whole layer, one run
        else:
            assert 1 <= len(calls[0]) <= slot_cache.PARTIAL_RUNS and nbytes == todo * cache.pool.expert_bytes
        assert len(calls) <= 1
        assert table.dtype == torch.int32 and table.tolist() == slots.tolist() + [-1]
        host = cache.pool.wait_layer(layer)
        for e, s in enumerate(slots.tolist()):
            assert (lo <= s < hi and s == lo + e) or past.get(e) == s
            assert torch.equal(cache.buf[s], host[e])
        for (o, e), s in others.items():
            now = cache.lookup(o, [e])[0]
            assert now < 0 or (now == s and torch.equal(cache.buf[s], kept[o, e]))
            if not lo <= s < hi:
                assert now == s
        used = t.resident[t.resident >= 0]
        assert len(set(used.tolist())) == len(used)
        assert all(t.resident[o // E, o % E] == s for s, o in enumerate(t.owner.tolist()) if o >= 0)


def test_stream_layer_refuses_a_window_in_use():
    cache = _cache(slots=32)
    cache.table.lock([20])
    with pytest.raises(ValueError, match="window 1"):
        cache.stream_layer(0, 1)
    with pytest.raises(ValueError, match="window 2"):
        cache.stream_layer(0, 2)
    cache.stream_layer(0, 0)


def test_copy_backlog_runs_the_batches_in_order_from_their_issue_times():
    """Bytes still to copy: each batch starts when issued or when the one before ends, at the rate given; every
    batch after the first is still to copy whatever the clock says (the first, not done, holds them)."""
    assert copy_backlog([(0.0, 100)], rate=100.0, now=0.5) == pytest.approx(50)
    assert copy_backlog([(0.0, 100)], rate=100.0, now=2.0) == 0  # done by the clock (its event not yet read)
    # the second waits for the first (ends at 1.0), not its own issue time: 150 bytes left at 0.5
    assert copy_backlog([(0.0, 100), (0.5, 100)], rate=100.0, now=0.5) == pytest.approx(150)
    # issued after an idle gap: it starts at its issue time, by the clock; the first's event says it runs still
    assert copy_backlog([(0.0, 100), (3.0, 100)], rate=100.0, now=3.5) == pytest.approx(100)
    assert copy_backlog([(0.0, 100), (0.0, 80)], rate=100.0, now=9.0) == 80  # a rate too high: the second at least
    assert copy_backlog([(0.0, 100), (0.0, 50)], rate=0.0, now=9.0) == 150  # no rate known: all of it
    assert copy_backlog([], rate=100.0, now=0.0) == 0
    rng = random.Random()
    for _ in range(200):  # never more than was issued, never less than zero, shrinking as time passes
        batches = sorted((rng.uniform(0, 1), rng.randint(1, 100)) for _ in range(rng.randint(1, 6)))
        now = rng.uniform(0, 3)
        left = copy_backlog(batches, 100.0, now)
        assert 0 <= left <= sum(n for _, n in batches) + 1e-9
        assert copy_backlog(batches, 100.0, now + 0.1) <= left + 1e-9


def test_a_cpu_device_times_its_last_copy_and_has_no_backlog():
    """On a CPU device copies run in line: the backend ran the last batch's experts after it (its run time is
    added to that one), so only the last batch is read back; nothing is ever still in flight."""
    cache = _cache(8)
    cache.admit(0, [1, 2])
    cache.admit(0, [3])
    timings = cache.take_fill_timings()
    assert len(timings) == 1 and timings[0].nbytes == cache.pool.expert_bytes and timings[0].seconds > 0
    assert cache.take_fill_timings() == [] and cache.copy_backlog(1e9) == 0


def test_copies_in_one_call_equal_a_copy_a_pair_and_follow_a_resized_buffer():
    """_copy_rows (one torch call, views of the slots and blocks made once) against one copy_ a pair, on fresh
    random experts and slots, runs and single pairs mixed; after a resize its copies land in the new buffer."""
    rng = random.Random()
    for _ in range(20):
        cache = _cache(slots=24)
        row, host = 1, cache.pool.wait_layer(1)
        for resize in (None, 32):
            if resize:
                cache.resize(resize)
            n = rng.randint(1, 16)
            experts = rng.sample(range(16), n)
            slots = pair_sorted(experts, rng.sample(range(cache.num_slots), n)) if rng.random() < 0.5 \
                else rng.sample(range(cache.num_slots), n)
            cache.buf.zero_()  # unfilled slots hold whatever memory held, NaN included, which equal() rejects
            want = cache.buf.clone()
            for e, s in zip(experts, slots):
                want[s].copy_(host[e])
            cache._copy_rows(row, host, experts, slots, non_blocking=False)
            assert torch.equal(cache.buf, want)
