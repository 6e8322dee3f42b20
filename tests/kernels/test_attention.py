"""Attention kernels against the eager path: q/k norm + RoPE + KV store, split-K decode with the output
gate, and the causal prefill that starts at each sequence's cached length."""
import pytest
import torch

from engine.kernels.attention_triton import (AttnConsts, attention_ref, decode_attention, prefill_attention,
                                             prefill_block, prefill_tiles, qk_rope_store, qk_rope_store_ref)
from tests.kernels.conftest import float_dtypes, rel_err, tol


def setup(g, dev, dtype, gated=True, heads=4, kv=2, D=16, R=8, S=4, cap=80):
    c = AttnConsts(heads, kv, D, R, gated, zero_centered=gated, eps=1e-6,
                   q_norm=(0.3 * torch.randn(D, generator=g)).to(dev, dtype),
                   k_norm=(0.3 * torch.randn(D, generator=g)).to(dev, dtype),
                   inv_freq=(1.0 / (1e4 ** (torch.arange(0, R, 2).float() / R))).to(dev))
    k_slab = torch.randn(S, kv, cap, D, generator=g).to(dev, dtype)
    v_slab = torch.randn(S, kv, cap, D, generator=g).to(dev, dtype)
    return c, k_slab, v_slab


def proj_for(g, c, N, dev, dtype):
    width = c.heads * c.q_width + 2 * c.kv_heads * c.head_dim
    return torch.randn(N, width + 3, generator=g).to(dev, dtype)[:, :width]  # a strided view, as in the model


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("gated", [True, False])
def test_qk_rope_store(dev, dtype, gated):
    g = torch.Generator().manual_seed(31 + gated)
    c, ks, vs = setup(g, dev, dtype, gated)
    N = 5
    proj = proj_for(g, c, N, dev, dtype)
    slots = torch.tensor([1, 1, 3, 0, 3], dtype=torch.int32, device=dev)
    pos = torch.tensor([7, 8, 0, 41, 1], dtype=torch.int32, device=dev)
    ks2, vs2 = ks.clone(), vs.clone()
    q = qk_rope_store(proj, torch.empty(N, c.heads, c.head_dim, dtype=dtype, device=dev), ks, vs, slots, pos, c)
    q_ref = qk_rope_store_ref(proj, ks2, vs2, slots, pos, c)
    assert rel_err(q, q_ref) < 2 * tol(dtype)
    assert rel_err(ks, ks2) < 2 * tol(dtype)
    assert torch.equal(vs.cpu(), vs2.cpu())


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_attention(dev, dtype, splits):
    g = torch.Generator().manual_seed(41 + splits)
    c, ks, vs = setup(g, dev, dtype)
    B = 3
    proj = proj_for(g, c, B, dev, dtype)
    q = torch.randn(B, c.heads, c.head_dim, generator=g).to(dev, dtype)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    pos = torch.tensor([0, 37, 79], dtype=torch.int32, device=dev)
    out = decode_attention(q, proj, ks, vs, slots, pos, c, splits=splits)
    spans = [(i, 1, int(p), int(s)) for i, (p, s) in enumerate(zip(pos.tolist(), slots.tolist()))]
    ref = attention_ref(q, proj, ks, vs, spans, c)
    assert rel_err(out, ref) < 3 * tol(dtype)


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("gated", [True, False])
def test_prefill_attention(dev, dtype, gated):
    g = torch.Generator().manual_seed(51)
    c, ks, vs = setup(g, dev, dtype, gated, cap=200)
    spans = [(0, 70, 0, 1), (70, 5, 33, 3), (75, 130, 60, 0)]  # fresh, short extend, long extend
    N = 205
    proj = proj_for(g, c, N, dev, dtype)
    q = torch.randn(N, c.heads, c.head_dim, generator=g).to(dev, dtype)
    tiles = prefill_tiles(spans, prefill_block(c.head_dim)[0], dev)
    out = prefill_attention(q, proj, ks, vs, tiles, c)
    ref = attention_ref(q, proj, ks, vs, spans, c)
    assert rel_err(out, ref) < 3 * tol(dtype)
