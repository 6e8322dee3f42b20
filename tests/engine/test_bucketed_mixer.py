"""A prompt's DeltaNet layer between its projections padded to a token bucket (token_graphs.BucketedMixer), on
fresh random inputs: the gated norm's rows and the states it leaves equal, bit for bit, the layer's launches over
the run as it comes with the bucketed rule (the fast path without it), for slot and eager states, across buckets
and a shorter run after a longer one; runs it does not take are left alone; and a fast path with it gives the
logits and slot states of one without, bit for bit. (The graphs themselves: tests/gpu/test_fast_cuda.py.)"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the DeltaNet prefill kernels run under Triton's interpreter here", allow_module_level=True)

from engine.kernels.deltanet_prefill_triton import conv_prefill, prefill_gates  # noqa: E402
from engine.kernels.deltanet_triton import RuleConsts, gated_norm  # noqa: E402
from engine.layers.delta_rule import chunked_gated_delta_rule  # noqa: E402
from engine.models.fused import FusedDeltaNet  # noqa: E402
from engine.models.slots import SlotLinear  # noqa: E402
from engine.models.state import LinearState, Span  # noqa: E402
from engine.models.token_graphs import BucketedMixer, BucketedRule  # noqa: E402

HK, HV, DK, DV, KW, H = 2, 4, 16, 8, 4, 24
C, VALUES = 2 * HK * DK + HV * DV, HV * DV
P = C + VALUES + 2 * HV


def seed() -> int:
    return int(torch.randint(1 << 30, ()))


def layer(s: int) -> FusedDeltaNet:
    g = torch.Generator().manual_seed(s)
    consts = RuleConsts(HK, HV, DK, DV, -torch.rand(HV, generator=g) - 0.1, torch.randn(HV, generator=g) * 0.5,
                        torch.rand(DV, generator=g) + 0.5, 1e-6)
    return FusedDeltaNet(torch.randn(P, H, generator=g) * 0.2, torch.randn(C, KW, generator=g) * 0.5,
                         torch.randn(H, VALUES, generator=g) * 0.2, consts)


def states(s: int, slot: bool):
    g = torch.Generator().manual_seed(s)
    conv, rec = torch.randn(C, KW - 1, generator=g), torch.randn(HV, DK, DV, generator=g) * 0.1
    if not slot:
        return LinearState(conv, rec)
    pool = torch.zeros(3, C, KW - 1), torch.zeros(3, HV, DK, DV)  # a slot's views, as a StatePool's row
    pool[0][1].copy_(conv)
    pool[1][1].copy_(rec)
    return SlotLinear(pool[0][1], pool[1][1])


def as_it_comes(m: FusedDeltaNet, proj: torch.Tensor, state) -> torch.Tensor:
    """FastPath._deltanet_prefill's launches for one run without checkpoints (run_sequence's conv and rule):
    the gated norm's rows; the state moved on."""
    c, n = m.consts, proj.shape[0]
    beta, g = prefill_gates(proj, C + VALUES, C + VALUES + HV, c.neg_A, c.dt_bias)
    conv = state.conv.clone()
    q, k, v = conv_prefill(proj[:, :C], conv, m.conv_w).split([HK * DK, HK * DK, VALUES], dim=-1)
    rule = BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(16, 64))
    out = torch.empty(n, HV, DV, dtype=proj.dtype)
    out[:], state.recurrent = rule(q.reshape(n, HK, -1), k.reshape(n, HK, -1), v.reshape(n, HV, -1), g, beta,
                                   state.recurrent)
    state.conv = conv
    return gated_norm(out.view(n, VALUES), proj, C, c)


@pytest.mark.parametrize("slot", [True, False])
def test_equals_the_layer_as_it_comes(slot):
    """n = 2 (fewer rows than the conv keeps: its state takes some of the old one), runs that fill a bucket and
    ones that leave padding, a shorter run after a longer one in the same bucket (its rows hold the longer run's
    projections), the state carried from run to run."""
    s = seed()
    m = layer(s)
    mixer = BucketedMixer(chunked_gated_delta_rule, capture=False, buckets=(16, 64))
    got, ref = states(s + 1, slot), states(s + 1, slot)
    g, pos = torch.Generator().manual_seed(s + 2), 0
    for n in (2, 16, 50, 9, 64, 3, 40):
        proj = torch.randn(n, P, generator=g)
        normed = mixer(3, m, proj, Span(0, n, pos, got, ()))
        want = as_it_comes(m, proj, ref)
        assert normed is not None and torch.equal(normed, want), (n, s)
        assert torch.equal(got.conv, ref.conv) and torch.equal(got.recurrent, ref.recurrent), (n, s)
        pos += n
    assert mixer.modes() == {16: "direct", 64: "direct"}


def test_what_it_hands_an_eager_state_is_the_states_own():
    """A LinearState keeps the tensors it is handed: a later call (the bucket's buffers rewritten) leaves them."""
    s = seed()
    m, st = layer(s), states(s + 1, slot=False)
    mixer = BucketedMixer(chunked_gated_delta_rule, capture=False, buckets=(64,))
    mixer(0, m, torch.randn(30, P), Span(0, 30, 0, st, ()))
    kept = st.conv.clone(), st.recurrent.clone()
    mixer(0, m, torch.randn(40, P), Span(0, 40, 0, states(s + 2, slot=False), ()))
    assert torch.equal(st.conv, kept[0]) and torch.equal(st.recurrent, kept[1])
    assert st.conv.is_contiguous()


def test_runs_it_does_not_take_are_left_alone():
    """A checkpoint inside the run, one row, a run past the last bucket, a span that is not all the rows: None,
    the state untouched."""
    s = seed()
    m, st = layer(s), states(s + 1, slot=True)
    before = st.conv.clone(), st.recurrent.clone()
    mixer = BucketedMixer(chunked_gated_delta_rule, capture=False, buckets=(16, 64))
    proj = torch.randn(20, P)
    assert mixer(0, m, proj, Span(0, 20, 100, st, (105,))) is None
    assert mixer(0, m, proj, Span(0, 20, 100, st, (120,))) is None  # (the run's last position: kept there too)
    assert mixer(0, m, proj[:1], Span(0, 1, 100, st, ())) is None
    assert mixer(0, m, torch.randn(65, P), Span(0, 65, 100, st, ())) is None
    assert mixer(0, m, proj, Span(4, 16, 100, st, ())) is None
    assert torch.equal(st.conv, before[0]) and torch.equal(st.recurrent, before[1])
    assert mixer(0, m, proj, Span(0, 20, 100, st, (99, 121))) is not None  # outside the run


def fast_pair(checkpoints):
    """Two fast paths over one tiny checkpoint, both with the bucketed rule, one with the bucketed mixer."""
    from engine import Engine

    ckpt = checkpoints["qwen3_5_moe", "fused"]
    models = []
    for with_mixer in (False, True):
        model = Engine.from_pretrained(ckpt, device="cpu", fast=False).model
        model.enable_fast(slots=3, capacity=96, graphs=False)
        model.fast.use_rule(BucketedRule(chunked_gated_delta_rule, capture=False, buckets=(8, 16)), with_mixer)
        models.append(model)
    return models


def test_a_fast_path_with_it_gives_the_same_bits(checkpoints):
    """A prompt and an extend in the other bucket: every logit and every slot state equal (batches and runs with
    checkpoints inside take the layers as they come: test_runs_it_does_not_take_are_left_alone)."""
    plain, mixed = fast_pair(checkpoints)
    g = torch.Generator().manual_seed(seed())
    sp, sm = plain.new_state(), mixed.new_state()
    assert sp.slot is not None and sm.slot is not None
    for n in (13, 2):
        t = torch.randint(0, 256, (n,), generator=g)
        ref, got = plain.forward([(t, sp)], logits="all"), mixed.forward([(t, sm)], logits="all")
        assert torch.equal(got[0], ref[0]), n
    for a, b in zip(plain.fast.pool.layers, mixed.fast.pool.layers):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert mixed.fast.bucket_modes()["mixer"] == {8: "direct", 16: "direct"}
    assert "mixer" not in plain.fast.bucket_modes()
