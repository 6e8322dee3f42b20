"""The mapped decode's cache keeping (engine/experts/mapped.py), on CPU without kernels: the location table
the kernels read always matches what the slots hold, each step's routes count as hits and in-place reads,
and a miss is admitted only into a free slot or over a clearly colder expert."""
import numpy as np
import pytest
import torch

from engine.experts import admission
from engine.experts.host_pool import pool_from_source
from engine.experts.mapped import MappedExperts
from engine.experts.offload import OffloadBackend
from engine.experts.source import ExpertWeights
from engine.kernels.moe_pairs_triton import LOC_HOST, LOC_SHARED

L_IDS, E, H, I = [0, 2, 3], 8, 16, 12


def backend(slots: int, seed: int = 0, **kw) -> OffloadBackend:
    g = torch.Generator().manual_seed(seed)
    src = ExpertWeights({l: torch.randn(E, 2 * I, H, generator=g) for l in L_IDS},
                        {l: torch.randn(E, H, I, generator=g) for l in L_IDS})
    return OffloadBackend(pool_from_source(src), slots, "cpu", slot_policy="lfu", **kw)


def step(m: MappedExperts, per_layer: list[list[int]]) -> None:
    """One decode step of one token whose routes are `per_layer` (an expert list per MoE layer)."""
    m.begin()
    k = max(len(r) for r in per_layer)
    routes = torch.full((len(L_IDS), 1, k), -1, dtype=torch.int32)
    for row, r in enumerate(per_layer):
        routes[row, 0, : len(r)] = torch.tensor(r, dtype=torch.int32)
    m.end(routes, 1)


def take_in(m: MappedExperts) -> None:
    """What the step after the last would do to the table before it runs: the last routes taken in (a step's
    end takes in the step before it), then the push."""
    m.observe_last()
    m.begin()


def table_matches_slots(b: OffloadBackend, m: MappedExperts) -> None:
    """Every entry the kernels would read is the expert's weights: a slot holding exactly its block."""
    loc = m.loc.numpy()
    assert (loc[:, E] == LOC_SHARED).all()
    for row, layer in enumerate(L_IDS):
        for e in range(E):
            s = int(loc[row, e])
            assert s == LOC_HOST or torch.equal(b.cache.buf[s], b.pool.block(layer, e))


def test_misses_are_read_in_place_then_fill_free_slots():
    b = backend(slots=4)
    m = b.mapped_decode()
    assert isinstance(m, MappedExperts) and m is b.mapped_decode()
    step(m, [[1, 2], [3], [0, 5]])
    take_in(m)
    st = b.stats()["total"]
    assert (st["hits"], st["misses"], st["direct_reads"]) == (0, 5, 5)
    assert st["bytes_read"] == 5 * b.pool.expert_bytes
    assert st["fills"] == 4  # four free slots, taken by the four hottest misses
    assert (m.loc.numpy()[:, :E] >= 0).sum() == 4
    table_matches_slots(b, m)
    admitted = {(row, e) for row in range(3) for e in range(E) if m.loc[row, e] >= 0}
    row, e = next(iter(admitted))
    routes = [[], [], []]
    routes[row] = [e]
    step(m, routes)
    take_in(m)
    assert b.stats()["total"]["hits"] == 1


def test_a_full_cache_admits_only_a_clearly_hotter_expert(monkeypatch):
    monkeypatch.setattr(admission, "MAX_FILLS", 1)
    b = backend(slots=2)
    m = b.mapped_decode()
    for _ in range(3):
        step(m, [[0], [0], []])  # layers 0 and 2's expert 0 fill both slots and get hot
    take_in(m)
    assert m.loc[0, 0] >= 0 and m.loc[1, 0] >= 0
    fills = b.stats()["total"]["fills"]
    step(m, [[], [], [5]])  # a single use of a new expert does not evict either
    take_in(m)
    assert b.stats()["total"]["fills"] == fills and m.loc[2, 5] == LOC_HOST
    for _ in range(12):  # used every step while layer 0's expert 0 goes cold: it moves in over it
        step(m, [[], [0], [5]])
    take_in(m)
    assert m.loc[2, 5] >= 0 and m.loc[0, 0] == LOC_HOST and m.loc[1, 0] >= 0
    table_matches_slots(b, m)


def test_the_table_follows_fills_made_by_the_prefill_path():
    b = backend(slots=6)
    m = b.mapped_decode()
    m.begin()
    assert (m.loc.numpy()[:, :E] == LOC_HOST).all()
    x = torch.randn(3, H)
    ids = torch.tensor([[1, 2], [3, 4], [1, 6]])
    b.forward(L_IDS[1], x, ids, torch.full((3, 2), 0.5))  # fills for layer 2 through the host path
    m.begin()
    assert sorted(np.flatnonzero(m.loc.numpy()[1, :E] >= 0).tolist()) == [1, 2, 3, 4, 6]
    table_matches_slots(b, m)
    b.resize(3)
    m.begin()
    assert (m.loc.numpy()[:, :E] >= 0).sum() == 3
    table_matches_slots(b, m)


def test_decode_modes():
    assert backend(slots=2, decode="host").mapped_decode() is None
    from engine.experts.cpu import CpuBackend

    g = torch.Generator().manual_seed(1)
    src = ExpertWeights({0: torch.randn(E, 2 * I, H, generator=g)}, {0: torch.randn(E, H, I, generator=g)})
    assert CpuBackend(pool_from_source(src), 2, "cpu").mapped_decode() is None  # auto: cpu runs misses itself
    with pytest.raises(ValueError, match="--moe-decode"):
        backend(slots=2, decode="fast")


def test_observe_layer_counts_cpu_runs_apart_from_in_place_reads():
    """A hybrid step's CPU pairs (entries LOC_CPU) are misses, not PCIe reads: counted as `cpu`."""
    from engine.experts.lru import SlotTable
    from engine.kernels.moe_pairs_triton import LOC_CPU

    assert admission.CPU_RUN == LOC_CPU
    table = SlotTable(num_layers=1, num_experts=6, num_slots=4)
    seen = np.array([0, LOC_HOST, LOC_CPU, LOC_CPU, LOC_HOST, LOC_HOST], dtype=np.int32)
    step = admission.observe_layer(table, 0, np.array([[0, 1, 2], [2, 3, 1], [-1, -1, -1]]), seen)
    assert (step.hits, step.misses, step.reads, step.cpu) == (1, 3, 2, 3)
