"""A prompt's DeltaNet conv in one launch (conv_prefill) against the eager layer's (GatedDeltaNet._conv): outputs
and the state it leaves, runs shorter than the conv's window among them, inputs as rows of a wider projection;
its gates (prefill_gates) against GatedDeltaNet.gates."""
import pytest
import torch

from engine.kernels.deltanet_prefill_triton import conv_prefill, prefill_gates
from engine.layers.deltanet import GatedDeltaNet
from engine.models.state import LinearState
from tests.kernels.conftest import float_dtypes, rel_err, tol


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("T", [1, 2, 3, 5, 33, 100])
def test_conv_prefill_matches_the_eager_conv(dev, dtype, T):
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    C, K, P = 200, 4, 237  # C not a multiple of the channel block; rows of a wider projection
    proj = torch.randn(T, P, generator=g).to(dev, dtype)
    x = proj[:, 5 : 5 + C]
    w = (torch.randn(C, K, generator=g) * 0.5).to(dev, dtype)
    state = torch.randn(C, K - 1, generator=g).to(dev, dtype)
    net = GatedDeltaNet.__new__(GatedDeltaNet)  # the eager conv alone: it reads conv_w [C, 1, K]
    net.conv_w, net.prefill_conv = w[:, None, :], None
    ref_state = LinearState(state.clone(), None)
    ref = net._conv(x, ref_state)
    got_state = state.clone()
    got = conv_prefill(x, got_state, w)
    assert got.is_contiguous() and got.dtype == dtype
    assert rel_err(got, ref) < tol(dtype), seed
    assert torch.equal(got_state, ref_state.conv), seed  # the state holds inputs: copied, never rounded


def test_conv_prefill_names_a_mismatch(dev):
    x = torch.zeros(4, 8, device=dev)
    with pytest.raises(ValueError, match="agree on C and K"):
        conv_prefill(x, torch.zeros(8, 3, device=dev), torch.zeros(8, 3, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        conv_prefill(x, torch.zeros(3, 8, device=dev).t(), torch.zeros(8, 4, device=dev))


@pytest.mark.parametrize("dtype", float_dtypes())
def test_prefill_gates_match_the_eager_gates(dev, dtype):
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    T, Hv, P, b_off, a_off = 45, 6, 40, 7, 20
    proj = (torch.randn(T, P, generator=g) * 8).to(dev, dtype)  # some a + dt_bias past softplus' threshold
    net = GatedDeltaNet.__new__(GatedDeltaNet)
    net.neg_A = -torch.rand(Hv, generator=g).to(dev) * 2
    net.dt_bias = torch.randn(Hv, generator=g).to(dev, dtype)
    beta, gl = prefill_gates(proj, b_off, a_off, net.neg_A, net.dt_bias)
    ref_beta, ref_g = net.gates(proj[:, b_off : b_off + Hv], proj[:, a_off : a_off + Hv])
    assert beta.dtype == ref_beta.dtype == dtype and gl.dtype == ref_g.dtype == torch.float32
    assert rel_err(beta, ref_beta) < tol(dtype), seed
    assert rel_err(gl, ref_g) < 1e-5, seed
