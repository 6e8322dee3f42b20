"""add_rms_norm against the eager arithmetic, with and without rows summed in, both norm flavours."""
import pytest
import torch

from engine.kernels.moe_pairs_triton import route_topk
from engine.kernels.norm_triton import (SeamRoute, add_rms_norm, add_rms_norm_guess, add_rms_norm_ref,
                                        add_rms_norm_router)
from tests.kernels.conftest import float_dtypes, rel_err, tol


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_add_rms_norm_matches_reference(dev, dtype, rows, zero_centered):
    g = torch.Generator().manual_seed(rows * 7 + zero_centered)
    N, H = 3, 96  # H not a power of two: the masked tail counts
    x = torch.randn(N, H, generator=g).to(dev, dtype)
    delta = torch.randn(N, rows, H, generator=g).to(dev, dtype) if rows else None
    w = (torch.randn(H, generator=g) * 0.3).to(dev, dtype)
    ref_x, ref_h = add_rms_norm_ref(x, delta, w, 1e-6, zero_centered)
    got_x, got_h = add_rms_norm(x, delta, w, 1e-6, zero_centered)
    assert rel_err(got_x, ref_x) < tol(dtype)
    assert rel_err(got_h, ref_h) < 2 * tol(dtype)
    if delta is None:
        assert got_x is x


def test_add_rms_norm_names_a_bad_weight(dev):
    x = torch.randn(2, 8, device=dev)
    with pytest.raises(ValueError, match="does not match hidden size"):
        add_rms_norm(x, None, torch.ones(4, device=dev), 1e-6, True)


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("rows", [1, 3])
def test_add_rms_norm_router_is_add_norm_then_router(dev, dtype, rows):
    g = torch.Generator().manual_seed(40 + rows)
    N, H, E = 3, 96, 37  # neither a multiple of the tiles
    x = torch.randn(N, H, generator=g).to(dev, dtype)
    delta = torch.randn(N, rows, H, generator=g).to(dev, dtype)
    w = (torch.randn(H, generator=g) * 0.3).to(dev, dtype)
    router = (torch.randn(E, H, generator=g) * 0.2).to(dev, dtype)
    got_x, got_h, got_logits = add_rms_norm_router(x, delta, w, 1e-6, True, router)
    want_x, want_h = add_rms_norm(x, delta, w, 1e-6, True)
    assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h)  # the same arithmetic, bit for bit
    ref_logits = want_h.double() @ router.double().T
    assert got_logits.dtype == dtype and rel_err(got_logits, ref_logits) < 2 * tol(dtype)


@pytest.mark.parametrize("shared, norm_topk", [(True, True), (False, False)])
def test_the_router_seam_routes_as_route_topk(dev, shared, norm_topk):
    """With a SeamRoute the seam's last block of each row routes it: ids and weights exactly route_topk's on the
    seam's own logits (padding rows route nowhere), the seam's other outputs as without it, and three calls in a
    row (the counts it keeps are back at zero after each); fresh random inputs."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    # E routed experts (+ the shared gate's row), not a multiple of the tiles, and a block of them narrower than H's
    N, H, E, K = 5, 96, 13 + shared, 4
    w = (torch.randn(H, generator=g) * 0.3).to(dev, torch.bfloat16)
    router = (torch.randn(E, H, generator=g) * 0.5).to(dev, torch.bfloat16)
    valid = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int8, device=dev)
    for _ in range(3):
        x = torch.randn(N, H, generator=g).to(dev, torch.bfloat16)
        delta = torch.randn(N, 2, H, generator=g).to(dev, torch.bfloat16)
        ids = torch.full((N, K + shared), 99, dtype=torch.int32, device=dev)
        wts = torch.full((N, K + shared), 9.0, device=dev)
        got = add_rms_norm_router(x, delta, w, 1e-6, True, router, route=SeamRoute(K, norm_topk, shared, valid, ids,
                                                                                     wts))
        plain = add_rms_norm_router(x, delta, w, 1e-6, True, router)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        want_ids, want_w = route_topk(got[2], K, norm_topk, shared, valid)
        assert torch.equal(ids, want_ids) and torch.equal(wts, want_w)
        assert (ids[2] == -1).all() and (ids[[0, 1, 3, 4]] >= 0).all()
    with pytest.raises(ValueError, match="route"):
        add_rms_norm_router(x, delta, w, 1e-6, True, router, route=SeamRoute(K, norm_topk, shared, valid, ids[:, 1:],
                                                                               wts))


def test_add_rms_norm_router_names_a_bad_router(dev):
    x = torch.randn(2, 8, device=dev)
    with pytest.raises(ValueError, match="router"):
        add_rms_norm_router(x, x, torch.ones(8, device=dev), 1e-6, True, torch.ones(4, 6, device=dev))


@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("N", [1, 3])
def test_add_rms_norm_guess_is_the_seam_and_the_next_layers_router(dev, zero_centered, N):
    """The seam after a MoE block with the next layer's guess in one launch: x_out and h exactly add_rms_norm's,
    the guess the next router on rms_norm(x_out, guess_w) in fp32 (within a bf16 rounding of the engine's own
    norm then matmul), for a router sliced from one with a further row (stride) and a width that is not a
    tile; fresh random inputs."""
    from engine.layers.norm import rms_norm

    g = torch.Generator().manual_seed(60 + 2 * N + zero_centered)
    H, E, R = 600, 40, 9
    x = (torch.randn(N, H, generator=g) * 3).to(dev, torch.bfloat16)
    delta = torch.randn(N, R, H, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(H, generator=g) * 0.3).to(dev, torch.bfloat16)
    gw = (torch.randn(H, generator=g) * 0.1).to(dev, torch.bfloat16)
    router = torch.randn(E + 1, H, generator=g).to(dev, torch.bfloat16)
    got_x, got_h, got = add_rms_norm_guess(x, delta, w, 1e-6, zero_centered, gw, router[:E])
    want_x, want_h = add_rms_norm(x, delta, w, 1e-6, zero_centered)
    assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h)
    assert got.shape == (N, E) and got.dtype == torch.float32
    xf = want_x.float().cpu()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (normed * ((1 + gw.float().cpu()) if zero_centered else gw.float().cpu())) @ router[:E].float().cpu().T
    assert torch.allclose(got.cpu(), ref, rtol=1e-4, atol=1e-3)
    hb = rms_norm(want_x, gw, 1e-6, zero_centered).float().cpu()
    engine = hb @ router[:E].float().cpu().T
    scale = hb.abs() @ router[:E].float().cpu().abs().T
    assert ((got.cpu() - engine).abs() <= scale * 2 ** -8).all()
    with pytest.raises(ValueError, match="does not match hidden size"):
        add_rms_norm_guess(x, delta, w, 1e-6, zero_centered, gw[:8], router[:E])
