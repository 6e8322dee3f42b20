"""Radix tree structure: splits, matching in hybrid and pure-attention mode, ownership of payloads, and
equivalence with the flat reference under random insert / match / invalidate / spill sequences."""
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import PrefixCache, RadixTree
from engine.cache.reference import ReferencePrefixCache
from engine.cache.sim import Ledger, SimCheckpoint, sim_checkpoints, sim_kv_source

UNLIMITED = 1 << 40


def tree_and_ledger(require_checkpoint=True):
    return RadixTree(require_checkpoint), Ledger()


def insert(tree, ledger, ids, upto=None, ckpts=()):
    upto = len(ids) if upto is None else upto
    return tree.insert(ids, upto, sim_kv_source(ids, ledger), sim_checkpoints(ids, ckpts, ledger))


def edges(tree):
    return sorted((n.start, n.key, n.ckpt is not None) for n in tree.nodes())


def held_payloads(tree):
    return {p for n in tree.nodes() for p in (n.kv, n.ckpt) if p is not None}


def path_tokens(match):
    """The KV tokens the match serves, concatenated along its path, cut at its position."""
    out = [t for n in match.node_path for t in n.kv.tokens]
    return out[: match.position]


def test_modules_import_no_torch():
    code = ("import sys; import engine.cache, engine.cache.sim, engine.cache.reference; "
            "assert 'torch' not in sys.modules, 'engine.cache imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_insert_splits_edge_and_asks_kv_only_for_new_ranges():
    tree, ledger = tree_and_ledger()
    asked = []
    insert(tree, ledger, [1, 2, 3, 4], ckpts=[4])
    src = sim_kv_source([1, 2, 5], ledger)
    tree.insert([1, 2, 5], 3, lambda s, e: asked.append((s, e)) or src(s, e), sim_checkpoints([1, 2, 5], [3], ledger))
    assert asked == [(2, 3)]
    assert edges(tree) == [(0, (1, 2), False), (2, (3, 4), True), (2, (5,), True)]
    (top,) = tree.root.children.values()
    assert top.kv.tokens == (1, 2) and top.children[3].kv.tokens == (3, 4) and top.children[3].start == 2
    assert ledger.live == held_payloads(tree)


def test_checkpoint_position_inside_an_edge_splits_it():
    tree, ledger = tree_and_ledger()
    insert(tree, ledger, [1, 2, 3, 4, 5, 6], ckpts=[6])
    insert(tree, ledger, [1, 2, 3, 4, 5, 6], upto=3, ckpts=[3])
    assert edges(tree) == [(0, (1, 2, 3), True), (3, (4, 5, 6), True)]
    assert tree.match([1, 2, 3, 4, 9]).position == 3
    assert ledger.live == held_payloads(tree)


def test_hybrid_mode_resumes_only_at_checkpoints():
    tree, ledger = tree_and_ledger(require_checkpoint=True)
    insert(tree, ledger, [1, 2, 3, 4, 5, 6], ckpts=[2, 6])
    assert tree.match([1, 2, 3, 4, 5, 6, 7]).position == 6
    assert tree.match([1, 2, 3, 4, 5, 9]).position == 2  # KV up to 5 exists, but no checkpoint after 2
    assert tree.match([1, 2, 3, 4, 5, 6], max_position=5).position == 2
    m = tree.match([7, 1])
    assert (m.position, m.node, m.tier, m.node_path) == (0, None, "none", [])


def test_attention_mode_resumes_wherever_kv_exists_even_mid_edge():
    tree, ledger = tree_and_ledger(require_checkpoint=False)
    insert(tree, ledger, [1, 2, 3, 4, 5, 6])
    m = tree.match([1, 2, 3, 4, 9])
    assert m.position == 4 and m.node.end == 6 and path_tokens(m) == [1, 2, 3, 4]
    assert tree.match([1, 2, 3, 4, 5, 6], max_position=5).position == 5
    assert edges(tree) == [(0, (1, 2, 3, 4, 5, 6), False)]  # matching never splits


def test_match_tier_is_host_when_any_node_on_the_path_is():
    tree, ledger = tree_and_ledger()
    insert(tree, ledger, [1, 2, 3, 4], ckpts=[2, 4])
    top = tree.root.children[1]
    top.tier = "host"  # the tier manager's job; only the flag matters to match()
    assert tree.match([1, 2, 3, 4]).tier == "host"
    top.tier = "device"
    assert tree.match([1, 2, 3, 4]).tier == "device"


def test_duplicate_checkpoint_is_released_and_the_first_one_kept():
    tree, ledger = tree_and_ledger()
    insert(tree, ledger, [1, 2, 3], ckpts=[3])
    first = tree.root.children[1].ckpt
    dup = SimCheckpoint([1, 2, 3], ledger)
    tree.insert([1, 2, 3], 3, sim_kv_source([1, 2, 3], ledger), {3: dup})
    assert tree.root.children[1].ckpt is first and dup not in ledger.live
    assert ledger.live == held_payloads(tree)


def test_remove_subtree_drops_descendants_and_releases_payloads():
    tree, ledger = tree_and_ledger()
    insert(tree, ledger, [1, 2, 3, 4], ckpts=[2, 4])
    insert(tree, ledger, [1, 2, 5, 6], ckpts=[4])
    insert(tree, ledger, [7, 8], ckpts=[2])
    top = tree.root.children[1]
    kids = list(top.children.values())
    assert tree.remove_subtree(top) == 3
    assert not top.alive and not any(k.alive for k in kids)
    assert tree.match([1, 2, 3, 4]).position == 0 and tree.match([7, 8]).position == 2
    assert ledger.live == held_payloads(tree)


def test_boundary_splits_at_the_requested_length_or_says_none():
    tree, ledger = tree_and_ledger()
    insert(tree, ledger, [1, 2, 3, 4], ckpts=[4])
    node = tree.boundary([1, 2, 3, 4], 2)
    assert (node.start, node.end) == (0, 2) and tree.boundary([1, 2, 9], 3) is None
    assert tree.boundary([5], 0) is tree.root


def test_split_that_grows_a_payload_is_refused():
    class Greedy:
        nbytes, tier = 10, "device"

        def split(self, n):
            return Greedy(), Greedy()

    tree = RadixTree()
    tree.insert([1, 2, 3], 3, lambda s, e: Greedy())
    with pytest.raises(ValueError, match="must keep its tier and not grow"):
        tree.insert([1, 9], 2, lambda s, e: Greedy())


@pytest.mark.parametrize("ids,upto,ckpts", [([], 1, []), ([1, 2], 3, []), ([1, 2], 2, [3]), ([1, 2], 2, [0])])
def test_insert_rejects_ranges_outside_the_sequence(ids, upto, ckpts):
    tree, ledger = tree_and_ledger()
    with pytest.raises(ValueError):
        tree.insert(ids, upto, sim_kv_source(ids, ledger), {p: SimCheckpoint([], ledger) for p in ckpts})


# -- random sequences against the flat reference ------------------------------------------------------

seqs = st.lists(st.integers(0, 2), min_size=1, max_size=9)


@st.composite
def operations(draw):
    ids = draw(seqs)
    kind = draw(st.sampled_from(["insert", "insert", "insert", "match", "acquire", "invalidate", "spill"]))
    upto = draw(st.integers(1, len(ids)))
    ckpts = draw(st.lists(st.integers(1, upto), max_size=3, unique=True))
    return kind, ids, upto, ckpts, draw(st.integers(0, len(ids)))


def apply(cache, ref, ledger, op):
    kind, ids, upto, ckpts, n = op
    if kind == "insert":
        cache.insert(ids, upto, sim_kv_source(ids, ledger), sim_checkpoints(ids, ckpts, ledger))
        ref.insert(ids, upto, ckpts)
    elif kind == "invalidate":
        cache.invalidate(ids, n)
        ref.invalidate(ids, n)
    elif kind == "spill":  # push everything to the host tier, then restore the budget
        cache.set_budgets(device=0)
        cache.set_budgets(device=UNLIMITED)
    else:
        m = cache.acquire(ids, n) if kind == "acquire" else cache.match(ids, n)
        assert m.position == ref.match(ids, n)
        assert path_tokens(m) == list(ids[: m.position])
        if kind == "acquire":
            assert all(node.tier == "device" for node in m.node_path)
            cache.release(m)


@pytest.mark.parametrize("require_checkpoint", [True, False])
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operations(), min_size=1, max_size=30), probes=st.lists(seqs, max_size=5))
def test_random_sequences_match_the_reference_with_unlimited_budgets(require_checkpoint, ops, probes):
    cache = PrefixCache(UNLIMITED, UNLIMITED, require_checkpoint=require_checkpoint)
    ref, ledger = ReferencePrefixCache(require_checkpoint), Ledger()
    for op in ops:
        apply(cache, ref, ledger, op)
        cache.check()
        for probe in probes + [op[1]]:
            assert cache.match(probe).position == ref.match(probe)
    assert ledger.live == held_payloads(cache.tree)
    assert cache.stats()["dropped_nodes"] == 0 or any(op[0] == "invalidate" for op in ops)
