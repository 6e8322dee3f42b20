"""The skinny GEMM (a decode step's projections) against F.linear."""
import pytest
import torch

from engine.kernels.gemv_triton import linear_skinny
from tests.kernels.conftest import float_dtypes, rel_err, tol


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("M", [1, 5, 16])
def test_linear_skinny_matches_f_linear(dev, dtype, M):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 200, generator=g).to(dev, dtype)
    w = (torch.randn(72, 200, generator=g) * 0.1).to(dev, dtype)
    assert rel_err(linear_skinny(x, w, bn=32, bk=64), torch.nn.functional.linear(x.float(), w.float())) < tol(dtype)


@pytest.mark.parametrize("dtype", float_dtypes())
def test_gated_out_proj_matches_norm_then_linear(dev, dtype):
    from engine.kernels.gemv_triton import gated_out_proj
    from engine.layers.norm import gated_rms_norm

    g = torch.Generator().manual_seed(9)
    M, Hv, dv, H, z_off = 3, 4, 32, 40, 7
    o = torch.randn(M, Hv * dv, generator=g).to(dev)
    proj = torch.randn(M, z_off + Hv * dv + 5, generator=g).to(dev, dtype)
    norm_w = (1 + 0.3 * torch.randn(dv, generator=g)).to(dev, dtype)
    w = (torch.randn(H, Hv * dv, generator=g) * 0.1).to(dev, dtype)
    z = proj[:, z_off : z_off + Hv * dv].reshape(M, Hv, dv)
    ref = torch.nn.functional.linear(gated_rms_norm(o.to(dtype).view(M, Hv, dv), z, norm_w, 1e-6).reshape(M, -1), w)
    assert rel_err(gated_out_proj(o, proj, z_off, norm_w, 1e-6, w), ref) < 3 * tol(dtype)
