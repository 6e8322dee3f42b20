"""Tier policy of the prefix cache: budgets, LRU demotion and drops, promotion, locks, pins, descendant
invalidation, and the budget invariants under random operation sequences."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import PrefixCache, default_host_budget
from engine.cache.reference import ReferencePrefixCache
from engine.cache.sim import Ledger, SimCheckpoint, sim_checkpoints, sim_kv_source


def put(cache, ledger, ids, ckpts=None, bpt=1, ckpt_bytes=1, upto=None):
    """Insert ids with checkpoints (default: at the end); every token costs bpt bytes."""
    upto = len(ids) if upto is None else upto
    ckpts = [upto] if ckpts is None else ckpts
    return cache.insert(ids, upto, sim_kv_source(ids, ledger, bpt), sim_checkpoints(ids, ckpts, ledger, ckpt_bytes))


def held_payloads(cache):
    return {p for n in cache.tree.nodes() for p in (n.kv, n.ckpt) if p is not None}


def tier_of(cache, ids):
    m = cache.match(ids)
    return m.tier if m.position == len(ids) else "gone"


A, B, C, D, E, F = ([k, 1, 1, 1] for k in range(10, 70, 10))  # 4 tokens + 1-byte checkpoint = 5 bytes each


def test_default_host_budget_reads_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  4000 kB\nMemAvailable:    1000 kB\n")
    assert default_host_budget(0.5, str(meminfo)) == 512_000
    with pytest.raises(ValueError, match="fraction"):
        default_host_budget(0.0, str(meminfo))
    with pytest.raises(ValueError, match="host_budget"):
        default_host_budget(0.5, str(tmp_path / "missing"))
    assert PrefixCache(device_budget=10).budget["host"] > 0  # this box has /proc/meminfo


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(device_budget=-1, host_budget=0)


def test_lru_demotes_to_host_then_drops_the_oldest():
    cache, ledger = PrefixCache(10, 10), Ledger()
    for ids in (A, B, C, D):
        put(cache, ledger, ids)
        cache.check()
    assert [tier_of(cache, x) for x in (A, B, C, D)] == ["host", "host", "device", "device"]
    put(cache, ledger, E)  # C goes to host, which drops its oldest: A
    assert [tier_of(cache, x) for x in (A, B, C, D, E)] == ["gone", "host", "host", "device", "device"]
    s = cache.stats()
    assert (s["device_bytes"], s["host_bytes"], s["demotions"], s["dropped_nodes"]) == (10, 10, 3, 1)
    assert ledger.live == held_payloads(cache)


def test_a_use_refreshes_recency():
    cache, ledger = PrefixCache(10, 10), Ledger()
    put(cache, ledger, A)
    put(cache, ledger, B)
    cache.release(cache.acquire(A))
    put(cache, ledger, C)
    assert [tier_of(cache, x) for x in (A, B, C)] == ["device", "host", "device"]


def test_acquire_promotes_a_host_hit_and_counts_it():
    cache, ledger = PrefixCache(10, 10), Ledger()
    for ids in (A, B, C):
        put(cache, ledger, ids)
    m = cache.acquire(A + [5])
    assert (m.position, m.tier) == (4, "host") and all(n.tier == "device" for n in m.node_path)
    cache.release(m)
    assert [tier_of(cache, x) for x in (A, B, C)] == ["device", "host", "device"]
    s = cache.stats()
    assert (s["hits_host"], s["promotions"], s["reused_tokens"]) == (1, 1, 4)
    m = cache.acquire(A)
    assert m.tier == "device" and cache.stats()["hits_device"] == 1
    cache.release(m)
    cache.acquire([99])
    assert cache.stats()["misses"] == 1
    cache.check()


def test_locked_nodes_are_never_moved_or_dropped():
    cache, ledger = PrefixCache(10, 5), Ledger()
    put(cache, ledger, A)
    held = cache.acquire(A)
    for ids in (B, C, D, E):
        put(cache, ledger, ids)
        cache.check()
        assert held.node.alive and held.node.tier == "device"
    with pytest.raises(ValueError, match="release them"):
        cache.set_budgets(device=0)
    cache.release(held)
    with pytest.raises(ValueError, match="not held"):
        cache.release(held)
    cache.set_budgets(device=0)
    assert tier_of(cache, A) in ("host", "gone") and cache.stats()["device_bytes"] == 0
    cache.check()


def test_release_after_an_insert_split_the_held_path():
    cache, ledger = PrefixCache(100, 100, require_checkpoint=False), Ledger()
    put(cache, ledger, [1, 2, 3, 4], ckpts=[])
    held = cache.acquire([1, 2, 3, 4])
    put(cache, ledger, [1, 2, 9], ckpts=[])  # splits the held edge at 2: the new upper node is held too
    assert [n.locks for n in held.node_path] == [1, 1]
    cache.release(held)
    assert all(n.locks == 0 for n in cache.tree.nodes())
    cache.check()


def test_dropping_an_ancestor_drops_its_descendants():
    cache, ledger = PrefixCache(20, 10), Ledger()
    put(cache, ledger, [1, 2, 3], bpt=4)  # 13 bytes: too big for the host tier
    put(cache, ledger, [1, 2, 3, 4])  # child edge [4]: 2 bytes
    put(cache, ledger, [9, 9], bpt=5)  # 11 bytes: child demoted to host, then the parent, which cannot fit
    assert cache.match([1, 2, 3, 4]).position == 0 and cache.match([9, 9]).position == 2
    s = cache.stats()
    assert (s["host_bytes"], s["host_nodes"], s["dropped_nodes"]) == (0, 0, 2)
    assert ledger.live == held_payloads(cache)
    cache.check()


def test_invalidate_drops_everything_beyond_a_prefix():
    cache, ledger = PrefixCache(100, 100), Ledger()
    put(cache, ledger, [1, 2, 3, 4], ckpts=[2, 4])
    put(cache, ledger, [1, 2, 5], ckpts=[3])
    assert cache.invalidate([1, 2, 3], 3) == 1  # splits [3, 4] at 3, drops [4]
    assert [cache.match(x).position for x in ([1, 2, 3, 4], [1, 2, 5])] == [2, 3]
    held = cache.acquire([1, 2, 5])
    with pytest.raises(ValueError, match="live request"):
        cache.invalidate([1], 0)
    cache.release(held)
    assert cache.invalidate([], 0) == 3 and cache.stats()["device_nodes"] == 0
    with pytest.raises(ValueError, match="0..len"):
        cache.invalidate([1], 2)
    assert ledger.live == set()


def test_pinned_nodes_move_to_host_and_are_dropped_last():
    cache, ledger = PrefixCache(10, 10), Ledger()
    pinned = put(cache, ledger, A)
    put(cache, ledger, B)
    cache.pin("s", [pinned])
    for ids in (C, D):
        put(cache, ledger, ids)
    assert [tier_of(cache, x) for x in (A, B)] == ["host", "host"]
    put(cache, ledger, E)  # host must drop one: B, although A is older, because A is pinned
    assert [tier_of(cache, x) for x in (A, B, C)] == ["host", "gone", "host"]
    cache.set_budgets(host=5)  # the host tier cannot hold both: the unpinned C goes first
    assert [tier_of(cache, x) for x in (A, C)] == ["host", "gone"] and cache.stats()["pinned_drops"] == 0
    cache.set_budgets(host=4)  # ... and a pin does not beat the budget
    assert tier_of(cache, A) == "gone" and cache.stats()["pinned_drops"] == 1
    cache.unpin("s")
    cache.check()


def test_a_prefix_many_sessions_share_outlives_the_newest_sessions_tail():
    """Sessions a and b share P; c, the most recent, has a private history as big as P. Least recently used
    would drop P (older than c) to fit the host budget; counting users drops the single-user nodes first."""
    cache, ledger = PrefixCache(0, 30), Ledger()  # no device room: everything lives on the host
    P = [1] * 8
    for session, tail in (("a", [20, 21]), ("b", [30, 31])):
        cache.pin(session, [put(cache, ledger, P + tail, ckpts=[8, 10])])
    cache.pin("c", [put(cache, ledger, [50] * 10)])
    assert cache.stats()["shared_nodes"] == 1 and cache.stats()["shared_tokens"] == 8
    cache.set_budgets(host=12)  # a's tail, b's tail, then c's history go; P (9 bytes) stays
    assert [tier_of(cache, x) for x in (P, P + [20, 21], P + [30, 31], [50] * 10)] == ["host", "gone", "gone", "gone"]
    assert cache.stats()["pinned_drops"] == 3 and cache.stats()["shared_evictions"] == 0
    cache.set_budgets(host=8)  # the budget still wins over a shared pin
    assert tier_of(cache, P) == "gone" and cache.stats()["shared_evictions"] == 1
    cache.check()


def test_shared_nodes_stay_on_the_device_while_private_ones_are_demoted():
    cache, ledger = PrefixCache(20, 100), Ledger()
    P = [1] * 8
    for session, tail in (("a", [20]), ("b", [30])):
        cache.pin(session, [put(cache, ledger, P + tail, ckpts=[8, 9])])
    put(cache, ledger, [50] * 9)  # 10 bytes, the newest: the private tails go to the host, not P
    assert [tier_of(cache, x) for x in (P, P + [20], P + [30], [50] * 9)] == ["device", "host", "host", "device"]
    cache.unpin("a")  # one user left: P is private again and, the oldest, goes next
    put(cache, ledger, [60] * 4)
    assert [tier_of(cache, x) for x in (P, [50] * 9, [60] * 4)] == ["host", "device", "device"]
    cache.check()


def test_unpin_makes_nodes_droppable_again_and_pin_covers_ancestors():
    cache, ledger = PrefixCache(100, 100), Ledger()
    put(cache, ledger, [1, 2, 3], ckpts=[1, 3])
    leaf = cache.match([1, 2, 3]).node
    cache.pin("s", [leaf])
    assert all(n.pinned_by == {"s"} for n in cache.tree.nodes())
    put(cache, ledger, [1, 2, 7])  # splits a pinned edge: the new upper node is pinned as well
    assert cache.match([1, 2]).position == 1 and cache.tree.boundary([1, 2], 2).pinned_by == {"s"}
    cache.check()
    cache.unpin("s")
    assert all(not n.pinned_by for n in cache.tree.nodes()) and cache.stats()["pinned_sessions"] == 0
    cache.invalidate([], 0)
    with pytest.raises(ValueError, match="already evicted"):
        cache.pin("s", [leaf])


@pytest.mark.parametrize("require_checkpoint", [True, False])
def test_promotion_is_cut_where_the_device_cannot_hold_the_path(require_checkpoint):
    cache, ledger = PrefixCache(10, 100, require_checkpoint), Ledger()
    put(cache, ledger, [1, 2, 3], ckpts=[1, 3])  # edges [1] (2 bytes) and [2, 3] (3 bytes)
    cache.set_budgets(device=0)
    cache.set_budgets(device=10)
    other = put(cache, ledger, [5] * 7)  # 8 bytes
    held = cache.acquire([5] * 7)
    m = cache.acquire([1, 2, 3])
    assert (m.position, m.tier, [n.end for n in m.node_path]) == (1, "host", [1])
    assert cache.tree.boundary([1, 2, 3], 3).tier == "host" and cache.stats()["cut_matches"] == 1
    assert other.alive and other.tier == "device"
    cache.release(m)
    cache.release(held)
    assert all(n.locks == 0 for n in cache.tree.nodes())
    cache.check()


def test_new_checkpoint_on_a_locked_node_is_shed_when_nothing_else_can_make_room():
    cache, ledger = PrefixCache(6, 100), Ledger()
    put(cache, ledger, [1, 2, 3, 4])  # 5 bytes
    held = cache.acquire([1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], 2, sim_kv_source([1, 2, 3, 4], ledger), {2: SimCheckpoint([1, 2], ledger, nbytes=3)})
    assert cache.stats()["shed_checkpoints"] == 1 and cache.match([1, 2]).position == 0
    assert ledger.live == held_payloads(cache)
    cache.release(held)
    cache.check()


# -- random sequences with small budgets ---------------------------------------------------------------

seqs = st.lists(st.integers(0, 2), min_size=1, max_size=8)


@st.composite
def operations(draw):
    ids = draw(seqs)
    upto = draw(st.integers(1, len(ids)))
    kind = draw(st.sampled_from(["insert"] * 3 + ["acquire"] * 2 + ["release", "pin", "unpin", "invalidate", "budget"]))
    ckpts = draw(st.lists(st.integers(1, upto), max_size=3, unique=True))
    return kind, ids, upto, ckpts, draw(st.integers(1, 3)), draw(st.integers(0, 4)), draw(st.integers(0, 40))


def step(cache, ref, ledger, held, op):
    kind, ids, upto, ckpts, bpt, ckpt_bytes, n = op
    if kind == "insert":
        put(cache, ledger, ids, ckpts, bpt, ckpt_bytes, upto)
        ref.insert(ids, upto, ckpts)
    elif kind == "acquire" and len(held) < 2:
        m = cache.acquire(ids)
        assert m.position <= ref.match(ids)
        assert [t for node in m.node_path for t in node.kv.tokens][: m.position] == ids[: m.position]
        held.append(m)
    elif kind == "release" and held:
        cache.release(held.pop(0))
    elif kind in ("pin", "unpin"):
        node = cache.match(ids).node
        cache.pin(f"s{n % 2}", [node] if node else []) if kind == "pin" else cache.unpin(f"s{n % 2}")
    elif kind == "invalidate":
        try:
            cache.invalidate(ids, min(n, len(ids)))
            ref.invalidate(ids, min(n, len(ids)))
        except ValueError:
            assert any(m.node is not None for m in held)
    elif kind == "budget":
        locked = cache.bytes["device"] - cache._evictable_bytes("device")
        cache.set_budgets(device=max(n, locked), host=n // 2 + 5)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(operations(), min_size=1, max_size=40), budgets=st.tuples(st.integers(0, 30), st.integers(0, 30)),
       require_checkpoint=st.booleans())
def test_budgets_hold_after_every_operation(ops, budgets, require_checkpoint):
    cache = PrefixCache(*budgets, require_checkpoint=require_checkpoint)
    ref, ledger, held = ReferencePrefixCache(require_checkpoint), Ledger(), []
    for op in ops:
        step(cache, ref, ledger, held, op)
        cache.check()  # raises if bytes per tier exceed a budget or the bookkeeping drifted
        assert ledger.live == held_payloads(cache)
        assert all(node.alive and node.tier == "device" for m in held for node in m.node_path)
        assert cache.match(op[1]).position <= ref.match(op[1])
    for m in held:
        cache.release(m)
    assert all(n.locks == 0 for n in cache.tree.nodes())
