"""A prompt's short runs padded to a token bucket (engine/models/token_graphs.py), on fresh random inputs: the
delta rule equals the rule over the run as it comes (outputs of the real rows, the state after them), padding
left by a longer run of the same bucket changes nothing, what it returns is the caller's own; an expert-cache
layer's routing equals route_cached's on the real rows. (The graphs themselves: tests/gpu/test_fast_cuda.py.)"""
from __future__ import annotations

import os

import pytest
import torch

from engine.models.token_graphs import BucketedRoute, BucketedRule, _side_by_side
from engine.layers.delta_rule import chunked_gated_delta_rule

HK, HV, DK, DV = 2, 4, 16, 8


def inputs(T: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HK, DK, generator=g).to(dtype)
    k = torch.randn(T, HK, DK, generator=g).to(dtype)
    v = torch.randn(T, HV, DV, generator=g).to(dtype)
    gl = -torch.rand(T, HV, generator=g) * 0.5
    beta = torch.rand(T, HV, generator=g).to(dtype)
    state = torch.randn(HV, DK, DV, generator=g) * 0.1
    return q, k, v, gl, beta, state


class Counting:
    """The reference rule, recording the tokens of each call."""

    def __init__(self):
        self.tokens: list[int] = []

    def __call__(self, q, k, v, g, beta, state):
        self.tokens.append(q.shape[0])
        return chunked_gated_delta_rule(q, k, v, g, beta, state)


def seed() -> int:
    return int(torch.randint(1 << 30, ()))


@pytest.mark.parametrize("T", [1, 17, 64, 65, 200, 256])
def test_padded_run_equals_the_run(T):
    s = seed()
    args = inputs(T, s)
    rule = Counting()
    o, state = BucketedRule(rule, capture=False, buckets=(64, 128, 256))(*args)
    o_ref, state_ref = chunked_gated_delta_rule(*args)
    assert rule.tokens == [64 if T <= 64 else 128 if T <= 128 else 256]
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")


def test_longer_runs_go_to_the_rule_as_they_come():
    rule = Counting()
    args = inputs(300, seed())
    o, state = BucketedRule(rule, capture=False, buckets=(64, 256))(*args)
    assert rule.tokens == [300]
    o_ref, state_ref = chunked_gated_delta_rule(*args)
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)


def test_padding_a_longer_run_left_changes_nothing():
    """Rows 150-239 of the bucket's buffers hold the first run's q, k, v after the second run's load: its beta
    and g there must read zero again."""
    s = seed()
    rule = BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(256,))
    rule(*inputs(240, s))
    args = inputs(150, s + 1)
    o, state = rule(*args)
    o_ref, state_ref = chunked_gated_delta_rule(*args)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")


def test_inputs_untouched_and_results_owned():
    """The caller's state is left as it is, and a later call does not change what an earlier one returned (an
    eager LinearState keeps the state tensor it is handed)."""
    s = seed()
    rule = BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(128,))
    args = inputs(100, s)
    before = [t.clone() for t in args]
    o, state = rule(*args)
    assert all(torch.equal(a, b) for a, b in zip(args, before))
    o_kept, state_kept = o.clone(), state.clone()
    rule(*inputs(90, s + 1))
    assert torch.equal(o, o_kept) and torch.equal(state, state_kept)


def test_strided_views_and_half_precision():
    """q, k, v as the DeltaNet layer hands them (views into one conv output), in bf16; g fp32, beta bf16."""
    s = seed()
    T = 70
    g = torch.Generator().manual_seed(s)
    conv = torch.randn(T, 2 * HK * DK + HV * DV, generator=g).to(torch.bfloat16)
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.reshape(T, HK, DK), k.reshape(T, HK, DK), v.reshape(T, HV, DV)
    _, _, _, gl, beta, state = inputs(T, s + 1, torch.bfloat16)
    assert _side_by_side(q, k, v) is not None and _side_by_side(k, q, v) is None  # loaded in one copy
    assert _side_by_side(*inputs(T, s)[:3]) is None
    o, new = BucketedRule(chunked_gated_delta_rule, capture=False)(q, k, v, gl, beta, state)
    o_ref, new_ref = chunked_gated_delta_rule(q, k, v, gl, beta, state)
    assert o.dtype == torch.bfloat16 and new.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2, msg=f"seed {s}")
    torch.testing.assert_close(new, new_ref, rtol=1e-4, atol=1e-4, msg=f"seed {s}")


def test_modes_name_each_bucket():
    rule = BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(64, 128))
    rule(*inputs(100, 1))
    rule(*inputs(10, 2))
    rule(*inputs(500, 3))  # past the buckets: no bucket made
    assert rule.modes() == {64: "direct", 128: "direct"}


def cached_moe(seed: int, H: int = 32, E: int = 16, shared: bool = True):
    from engine.models.fused import CachedMoE

    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E + shared, H, generator=g)
    gate_up = torch.randn(2 * 8, H, generator=g) * 0.3 if shared else None
    down = torch.randn(H, 8, generator=g) * 0.3 if shared else None
    return CachedMoE(router, 4, True, None, 3, gate_up, down)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="route_topk runs under Triton's interpreter")
@pytest.mark.parametrize("shared", [True, False])
def test_bucketed_routing_equals_the_rows_routed_as_they_come(shared):
    """Every row is routed on its own: the real rows of a padded bucket route as they do alone, across buckets,
    a shorter run after a longer one in the same bucket, and runs past the last bucket."""
    pytest.importorskip("triton")
    from engine.models.fast import route_cached

    s = seed()
    mlp = cached_moe(s, shared=shared)
    route = BucketedRoute(route_cached, capture=False, buckets=(16, 64))
    g = torch.Generator().manual_seed(s + 1)
    for T in (40, 9, 30, 64, 100):
        h = torch.randn(T, 32, generator=g)
        got, ref = route(mlp, h), route_cached(mlp, h, None)
        assert got.h is h and got.mlp is mlp
        assert torch.equal(got.ids, ref.ids), (T, s)
        torch.testing.assert_close(got.w, ref.w, rtol=1e-5, atol=1e-6, msg=f"seed {s}")
        if shared:
            torch.testing.assert_close(got.shared, ref.shared, rtol=1e-5, atol=1e-5, msg=f"seed {s}")
        else:
            assert got.shared is None
    assert route.modes() == {16: "direct", 64: "direct"}


def test_a_bucket_takes_side_by_side_heads_and_separate_ones_alike():
    """q | k | v as column slices of one conv output load in one copy, separate tensors one by one, into the
    same bucket's buffers: each call equals the rule over its run."""
    s = seed()
    rule = BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(256,))
    g = torch.Generator().manual_seed(s)
    conv = torch.randn(240, 2 * HK * DK + HV * DV, generator=g)
    q, k, v = (x.reshape(240, -1, d) for x, d in zip(conv.split([HK * DK, HK * DK, HV * DV], dim=-1), (DK, DK, DV)))
    for args in ((q, k, v, *inputs(240, s + 1)[3:]), inputs(150, s + 2), (q[:99], k[:99], v[:99], *inputs(99, s)[3:])):
        o, state = rule(*args)
        o_ref, state_ref = chunked_gated_delta_rule(*args)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")
        torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5, msg=f"seed {s}")
