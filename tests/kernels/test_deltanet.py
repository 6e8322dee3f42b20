"""DeltaNet decode kernels (conv step, rule step with gated norm) against the eager layer's arithmetic,
states in slot pools updated in place, several steps in a row; the tail rule (a prompt's last tokens, states
kept at marked steps) against the eager recurrence."""
import pytest
import torch

from engine.kernels.deltanet_triton import (RuleConsts, RuleTiles, conv_step, conv_step_ref, gated_norm, rule_step,
                                           rule_step_ref, rule_tail, rule_tiles, set_rule_tiles)
from engine.layers.delta_rule import recurrent_gated_delta_rule
from engine.layers.norm import gated_rms_norm
from tests.kernels.conftest import float_dtypes, rel_err, tol


def consts(g, dev, hk=2, hv=4, dk=16, dv=16):
    return RuleConsts(hk, hv, dk, dv, neg_A=-torch.rand(hv, generator=g).to(dev) * 2,
                      dt_bias=torch.randn(hv, generator=g).to(dev),
                      norm_w=(1 + 0.3 * torch.randn(dv, generator=g)).to(dev),
                      eps=1e-6)


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("fused, dv, tiles", [(True, 16, None), (False, 16, None), (False, 64, None),
                                              (None, 64, RuleTiles("launch", 16, 2)),
                                              (None, 32, RuleTiles("fused", 32, 4)),
                                              (None, 64, RuleTiles("last", 16, 4)),
                                              (None, 32, RuleTiles("last", 8, 2))])
def test_decode_steps_match_reference(dev, dtype, fused, dv, tiles):
    """Rule and gated norm in one launch (a program per head), in two (programs per block of dv columns, then the
    norm), or in one whose last program of each head normalises it; by default or in the tiles the bench sweeps
    (engine/bench/tiles.py). Several steps in a row: the "last" counts are back at zero after each."""
    g = torch.Generator().manual_seed(21 + dv)
    c = consts(g, dev, dv=dv)
    C = 2 * c.key_heads * c.key_dim + c.value_heads * c.value_dim
    P = C + c.value_heads * c.value_dim + 2 * c.value_heads + 5  # spare columns: row stride != width
    S, B, KW = 5, 3, 4
    conv_w = (torch.randn(C, KW, generator=g) * 0.5).to(dev, dtype)
    conv_a = torch.randn(S, C, KW - 1, generator=g).to(dev, dtype)
    rec_a = (torch.randn(S, c.value_heads, c.key_dim, c.value_dim, generator=g) * 0.1).to(dev)
    conv_b, rec_b = conv_a.clone(), rec_a.clone()
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=dev)
    for step in range(3):
        proj = torch.randn(B, P, generator=g).to(dev, dtype)
        qkv = conv_step(proj, conv_a, slots, conv_w)
        qkv_ref = conv_step_ref(proj, conv_b, slots, conv_w)
        assert rel_err(qkv, qkv_ref) < tol(dtype), step
        assert rel_err(conv_a, conv_b) == 0.0
        out = rule_step(qkv_ref, proj, rec_a, slots, c, fused=fused, tiles=tiles)
        ref = rule_step_ref(qkv_ref, proj, rec_b, slots, c)
        assert rel_err(out, ref) < 4 * tol(dtype), step
        assert rel_err(rec_a, rec_b) < 1e-5
    untouched = torch.tensor([1, 2])
    assert torch.equal(rec_a[untouched.to(dev)].cpu(), rec_b[untouched.to(dev)].cpu())


def test_the_chosen_tiles_are_every_rules_default_until_reset():
    """set_rule_tiles (bench model --rule-tiles): the default tiles until set back to None; asking for fused or not
    still gets the one asked for."""
    chosen = RuleTiles("last", 16, 2)
    set_rule_tiles(chosen)
    try:
        assert rule_tiles(128) == chosen and rule_tiles(128, fused=True) == RuleTiles("fused", 128, 8)
    finally:
        set_rule_tiles(None)
    assert rule_tiles(128) == RuleTiles("fused", 128, 8) and rule_tiles(256) == RuleTiles("launch", 32, 4)


def test_rule_step_names_a_wrong_width(dev):
    g = torch.Generator().manual_seed(1)
    c = consts(g, dev)
    with pytest.raises(ValueError, match="channels"):
        rule_step(torch.zeros(1, 10, device=dev), torch.zeros(1, 200, device=dev),
                  torch.zeros(1, 4, 16, 16, device=dev), torch.zeros(1, dtype=torch.int32, device=dev), c)
    # not a power of two; fused on part of a head; no such norm
    for bad in (RuleTiles("launch", 12, 4), RuleTiles("fused", 8, 4), RuleTiles("after", 8, 4)):
        with pytest.raises(ValueError, match="block_v"):
            rule_step(torch.zeros(1, 128, device=dev), torch.zeros(1, 200, device=dev),
                      torch.zeros(1, 4, 16, 16, device=dev), torch.zeros(1, dtype=torch.int32, device=dev), c,
                      tiles=bad)


@pytest.mark.parametrize("dtype", float_dtypes())
def test_rule_tail_runs_the_recurrence_and_keeps_the_marked_states(dev, dtype):
    """A prompt's last tokens in one launch: outputs and final state as the eager recurrence's, and the state
    after each marked step as the recurrence stopped there; q and k strided views of one conv output."""
    g = torch.Generator().manual_seed(5)
    T, hk, hv, dk, dv = 9, 2, 4, 16, 32
    keys = hk * dk
    qkv = torch.randn(T, 2 * keys + hv * dv, generator=g).to(dev, dtype)
    q, k = qkv[:, :keys].view(T, hk, dk), qkv[:, keys : 2 * keys].view(T, hk, dk)
    v = qkv[:, 2 * keys :].reshape(T, hv, dv)
    gate = (-torch.rand(T, hv, generator=g)).to(dev)
    beta = torch.rand(T, hv, generator=g).to(dev, dtype)
    state = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(dev)
    before = state.clone()
    marks = [1, 4, 7]  # and the end (9), which the kernel returns on its own
    o, after, snaps = rule_tail(q, k, v, gate, beta, state, marks)
    assert torch.equal(state, before)  # the caller's state is left as it was
    ref, s, a = [], state, 0
    for b in [*marks, T]:
        piece, s = recurrent_gated_delta_rule(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], s)
        ref.append(piece)
        if b in marks:
            assert rel_err(snaps[marks.index(b)], s) < 1e-5, b
        a = b
    assert o.dtype == v.dtype and rel_err(o, torch.cat(ref)) < 4 * tol(dtype)
    assert rel_err(after, s) < 1e-5
    with pytest.raises(ValueError, match="marks"):
        rule_tail(q, k, v, gate, beta, state, [4, 2])


@pytest.mark.parametrize("dtype", float_dtypes())
def test_gated_norm_over_prompt_rows_matches_the_eager_norm(dev, dtype):
    """A prompt's rows of the rule's output (the fast path's DeltaNet prefill), z read from the fused projection
    at its column offset: the eager layer's gated_rms_norm."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    c = consts(g, dev, hv=6, dv=32)
    N, z_off, values = 37, 19, c.value_heads * c.value_dim
    proj = torch.randn(N, z_off + values + 5, generator=g).to(dev, dtype)
    o = torch.randn(N, values, generator=g).to(dev, dtype)
    got = gated_norm(o, proj, z_off, c)
    z = proj[:, z_off : z_off + values].reshape(N, c.value_heads, c.value_dim)
    ref = gated_rms_norm(o.view(N, c.value_heads, c.value_dim), z, c.norm_w.to(dtype), c.eps).reshape(N, -1)
    assert got.dtype == dtype and got.shape == ref.shape
    assert rel_err(got, ref) < tol(dtype), seed
    with pytest.raises(ValueError, match="contiguous"):
        gated_norm(o.t().contiguous().t(), proj, z_off, c)
