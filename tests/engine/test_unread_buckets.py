"""A wholly resident layer's experts (SlotRunner.unread) over a prompt's run padded to a token bucket: on fresh
random inputs, the weighed rows equal the run as it comes bit for bit (padding pairs routed nowhere, a shorter
run after a longer one in the same bucket, padding pairs of the caller's own), close to the per-token reference;
decode-sized runs and runs of fewer pairs than the grouped mapping takes go as they come; and a backend's unread
layer calls, with prompt_graphs on, give the same outputs and the same counts. (The graph itself: CUDA,
tests/gpu/test_experts_cuda.py.)"""
import numpy as np
import pytest
import torch

from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate

from tests.engine.backends_util import E, K, L_IDS, reference, routing
from tests.engine.backends_util import pool, src  # noqa: F401 (pytest fixtures)

pytest.importorskip("triton")


def resident(pool, bucketed: bool) -> OffloadBackend:
    """A grouped backend (the CUDA path, here under Triton's interpreter) whose slots hold every expert."""
    b = OffloadBackend(pool, len(L_IDS) * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True),
                       stream_prefill="off", grouped=True)
    for layer in L_IDS:
        b.cache.admit(layer, list(range(E)))
    assert all(b.cache.resident_count(layer) == E for layer in L_IDS)
    if bucketed:
        b.prompt_graphs(False)
    return b


def seed() -> int:
    return int(torch.randint(1 << 30, ()))


def test_padded_runs_equal_the_runs_as_they_come(pool, src):
    s = seed()
    plain, padded = resident(pool, False), resident(pool, True)
    layer = L_IDS[1]
    table = plain.cache.lookup_table(plain.cache.table.resident[plain.pool.row[layer]])
    for k, T in enumerate((100, 50, 64, 45, 128, 70)):  # buckets 128 and 64, shorter runs after longer ones
        x, ids, w = routing(T, s + k)
        if k == 3:
            ids[5] = -1  # the caller's padding pairs: left out
        got, want = padded.runner.unread(x, ids, w, table), plain.runner.unread(x, ids, w, table)
        assert got.shape == (T, x.shape[1]) and torch.equal(got, want), (T, s)
        torch.testing.assert_close(got, reference(src, layer, x, ids.clamp(min=0), w * (ids >= 0)),
                                   rtol=1e-4, atol=1e-5)
    assert padded.runner.unread_modes() == {64: "direct", 128: "direct"} and not plain.runner.unread_modes()
    plain.close()
    padded.close()


def test_decode_sized_runs_and_ones_of_few_pairs_go_as_they_come(pool):
    b = resident(pool, True)
    table = b.cache.lookup_table(b.cache.table.resident[b.pool.row[L_IDS[0]]])
    for T in (4, 31, 40):  # (40 x 3 pairs: fewer than GROUP_PAIRS)
        x, ids, w = routing(T, seed())
        b.runner.unread(x, ids, w, table)
    assert not b.runner.unread_modes()
    b.close()


def test_a_backends_unread_calls_count_as_before(pool):
    """A held prompt forward whose layers are all resident: every layer call unread, outputs and counts equal."""
    outs, stats = [], []
    for bucketed in (False, True):
        b = resident(pool, bucketed)
        x, ids, w = routing(50, seed=7)
        b.begin_forward(50, K, hold=True, span=50)
        outs.append([b.forward(layer, x, ids, w) for layer in L_IDS])
        b.end_forward()
        stats.append(b.stats())
        heat = b.cache.table.heat.copy()
        stats[-1]["heat"] = heat
        b.close()
    assert all(torch.equal(a, c) for a, c in zip(*outs))
    assert stats[0]["layers"] == stats[1]["layers"] and np.array_equal(stats[0]["heat"], stats[1]["heat"])
