"""q*, the balanced split, the bandwidth estimate, `auto`, slot sizing and the prefill choice (torch-free)."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.experts.policy import BandwidthEstimate, choose_backend, q_balanced, q_star, slots_from_spec
from engine.experts.prefill_stream import (LIKELY_READ, expected_touched, routed_fills, row_sums, should_stream,
                                          touched)
from engine.experts.registry import resolve


@given(st.integers(0, 300), st.floats(1e6, 1e12), st.floats(1e6, 1e12))
def test_q_star_bounds(m, bp, bh):
    q = q_star(m, bp, bh)
    assert 0 <= q <= m
    assert q == min(m, math.floor(m * bp / bh + 0.5))


def test_q_star_laptop_and_server():
    assert q_star(8, 12e9, 48e9) == 2  # laptop: a quarter filled
    assert q_star(8, 54e9, 58e9) == 7  # lent box at 6 threads: nearly all filled


def test_q_balanced_ends_both_paths_together():
    assert q_balanced(10, 12e9, 48e9) == 2  # laptop: a fifth filled, the CPU runs four times as many
    assert q_balanced(8, 54e9, 58e9) == 4  # lent box at 6 threads: about half
    assert q_balanced(8, 54e9, 0.0) == 8 and q_balanced(8, 0.0, 5e9) == 0 and q_balanced(0, 1e9, 1e9) == 0
    assert q_balanced(8, float("inf"), 5e9) == 8
    # work the fill path has besides (copies ahead, a lag in experts): both paths still end together
    assert q_balanced(10, 1e9, 1e9, head=2) == 4 and q_balanced(10, 1e9, 1e9, head=-2) == 6
    assert q_balanced(10, 1e9, 1e9, head=2.6) == 4  # (12.6 / 2 - 2.6 = 3.7)
    assert q_balanced(10, 1e9, 1e9, head=20) == 0 and q_balanced(10, 1e9, 1e9, head=-30) == 10  # clamped to [0, m]
    assert q_balanced(10, float("inf"), 1e9, head=20) == 10


def test_estimate_follows_measurements_unless_frozen():
    est = BandwidthEstimate(bp=10e9, bh=10e9, alpha=0.5)
    est.observe_cpu(5 << 30, 1.0)  # ~5.4 GB/s: something else eats bandwidth
    assert est.bh == pytest.approx(0.5 * 10e9 + 0.5 * (5 << 30))
    est.observe_fill(100, 1e-6)  # too small to be a bandwidth sample
    assert est.bp == 10e9
    assert est.q(10) > 10 * 10e9 / 10e9 - 1  # CPU slower -> more fills
    small = BandwidthEstimate(bp=10e9, bh=10e9, alpha=0.5)
    small.observe_cpu(1 << 30, 1.0, weight=0.25)  # a run of a few experts: a quarter of a sample
    assert small.bh == pytest.approx(0.875 * 10e9 + 0.125 * (1 << 30))
    small.observe_cpu(5 << 30, 1.0, weight=3.0)  # a large run counts as one sample, no more
    assert small.bh == pytest.approx(0.5 * (0.875 * 10e9 + 0.125 * (1 << 30)) + 0.5 * (5 << 30))
    frozen = BandwidthEstimate(bp=10e9, bh=10e9, frozen=True)
    frozen.observe_cpu(5 << 30, 1.0)
    assert frozen.bh == 10e9


def test_auto_backend():
    kw = dict(pool_bytes=64 << 30, free_bytes=24 << 30)
    assert choose_backend(dense=True, profile=None, **kw) == "fused"
    assert choose_backend(dense=False, profile=None, pool_bytes=1 << 30, free_bytes=2 << 30) == "fused"
    assert choose_backend(dense=False, profile=None, **kw) == "offload"
    assert choose_backend(dense=False, profile={"bp": 54e9, "bh": 58e9}, **kw) == "hybrid"
    assert choose_backend(dense=False, profile={"bp": 54e9, "bh": 5e9}, **kw) == "offload"
    assert choose_backend(dense=False, profile={"bp": 54e9, "bh": 54e9}, **kw) == "hybrid"  # split: 2x
    assert choose_backend(dense=False, profile={"bp": 54e9, "bh": 27e9}, **kw) == "hybrid"  # 1.5x
    assert choose_backend(dense=False, profile={"bp": 54e9, "bh": 20e9}, **kw) == "offload"  # 1.37x
    assert choose_backend(dense=False, profile={"bp": 12e9, "bh": 48e9}, **kw) == "hybrid"  # laptop
    assert choose_backend(dense=False, profile={"bp": None, "bh": 50e9}, **kw) == "offload"  # CPU-only box
    assert resolve("auto", dense=False, profile=None, **kw) == "offload"
    with pytest.raises(ValueError, match="--moe-backend"):
        resolve("gpu", dense=False, profile=None, **kw)


def test_slots_from_spec():
    kw = dict(total_experts=1000, expert_bytes=6 << 20, free_bytes=600 << 20)
    assert slots_from_spec(None, **kw) == 100
    assert slots_from_spec("37%", **kw) == 370
    assert slots_from_spec(5000, **kw) == 1000
    with pytest.raises(ValueError):
        slots_from_spec("0%", **kw)
    with pytest.raises(ValueError, match="at least 1 slot.*free device memory"):
        slots_from_spec(None, total_experts=10, expert_bytes=1 << 30, free_bytes=1)
    assert slots_from_spec("1%", total_experts=10, expert_bytes=1, free_bytes=0) == 1  # a share: one slot at least
    with pytest.raises(ValueError, match=r"--moe-slots needs at least 1 slot, got 0 \(or give a share"):
        slots_from_spec(0, **kw)


def test_prefill_choice_by_predicted_bytes():
    kw = dict(top_k=8, num_experts=256, expert_bytes=6 << 20, bp=50e9, bh=50e9, device_flops=2e14)

    def choose(tokens, missing, routed, cpu_share=0.0, **over):
        return should_stream(num_tokens=tokens, missing=[missing] * 40, routed=routed, cpu_share=cpu_share,
                             **{**kw, **over})

    assert not choose(8192, 0, 0)  # nothing to move
    assert not choose(20, 160, 40 * 5)  # a short extend moves its few routed experts
    # a streamed layer crosses whole: moving only the routed misses wins where they are fewer, even for a
    # long prompt whose copies add to a short compute...
    assert not choose(8192, 160, 40 * 160)
    # ...but not where the per-expert path moves about as much (its evictions: routed_fills), nor where it moves
    # a little less: its copies wait for each layer's routing and reach less of B_P than one copy a layer
    assert choose(8192, 160, 40 * 256)
    assert choose(256, 160, 40 * 250)
    assert not choose(256, 160, 40 * 200)
    # on a slow device the compute hides the whole stream, where the per-expert copies would add to it
    assert choose(8192, 160, 40 * 160, device_flops=1e12)
    # the CPU's share of the misses runs beside the fills (hybrid)
    assert not choose(256, 160, 40 * 256, cpu_share=0.45)
    # ...unless each expert has so many tokens that the CPU turns compute-bound
    assert choose(8192, 160, 40 * 256, cpu_share=0.45)


def test_routed_fills_count_the_residents_the_fills_evict():
    # every expert of 8 layers touched, 3 layers' worth of slots holding the last three layers (a streamed prompt
    # before): the first layer's fills find no slot that is not kept and evict a later layer's residents;
    # every layer after fills into the slots of the one before
    assert routed_fills([256] * 5 + [0] * 3, [0] * 5 + [256] * 3, 768) == 5 * 256 + 256
    # the same slots holding the first layer and the last two: nothing lost
    assert routed_fills([0] + [256] * 5 + [0] * 2, [256] + [0] * 5 + [256] * 2, 768) == 5 * 256
    # the touched experts fit the slots: only the misses move
    assert routed_fills([10] * 8, [40] * 8, 768) == 80
    # free or unlikely slots take the first layer's fills first; what they lack costs residents
    assert routed_fills([100] * 8, [40] * 8, 400) == 800 + (100 - (400 - 7 * 40 - 40))
    # misses the CPU runs take no slot
    assert routed_fills([256] * 5 + [0] * 3, [0] * 5 + [256] * 3, 768, cpu_share=1.0) == 5 * 256
    assert routed_fills([256] * 5 + [0] * 3, [0] * 5 + [256] * 3, 768, cpu_share=0.5) == 5 * 256 + 128


def test_touched_experts_from_the_slot_tables_heat():
    e, k = 256, 8
    missing = np.arange(e) >= 96  # experts 96.. are not resident
    # no history: uniform routing
    assert touched(np.zeros(e), 40, k) == pytest.approx(np.full(e, expected_touched(40, k, e)))
    # skewed history, the resident experts the hot ones: the cold misses are touched far less than uniformly
    heat = np.where(missing, 0.0, 100.0)
    skew = touched(heat, 40, k)[missing].sum()
    assert skew < 0.2 * 160 * expected_touched(40, k, e)
    # an expert far hotter than the rest is touched for sure, and the others share the k - 1 other picks
    heat[200] = 1e6
    rest = np.arange(e) != 200
    p = touched(heat, 40, k)
    assert p[200] == pytest.approx(1.0) and p[rest] == pytest.approx(touched(heat[rest], 40, k - 1))
    assert (touched(heat, 10 ** 6, k) <= 1).all()
    # rows of a [L, E] heat are layers of their own
    rows = np.stack([np.zeros(e), heat, np.arange(e, dtype=float)])
    np.testing.assert_allclose(touched(rows, 40, k), np.stack([touched(r, 40, k) for r in rows]))


@given(st.integers(1, 12), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_row_sums_are_the_rows_summed_one_at_a_time(rows, experts, seed):
    """The streaming choice's per-row sums, made for every row at once, against a row at a time: the counts equal,
    the touched misses' sum to the last bits the order of the additions moves."""
    g = np.random.default_rng(seed)
    warm = g.random((rows, experts)) < g.random()
    touch = np.where(g.random((rows, experts)) < 0.2, LIKELY_READ, g.random((rows, experts)))  # ties at the bound
    missing, cold_hit, likely = row_sums(warm, touch)
    for i in range(rows):
        assert missing[i] == int((~warm[i]).sum())
        assert cold_hit[i] == pytest.approx(float(touch[i][~warm[i]].sum()), rel=1e-12, abs=1e-12)
        assert likely[i] == float((warm[i] & (touch[i] >= LIKELY_READ)).sum())
