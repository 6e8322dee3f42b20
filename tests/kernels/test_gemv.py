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
