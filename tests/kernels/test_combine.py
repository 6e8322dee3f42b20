"""An expert cache's layer output in one launch (combine_triton.combine_rows) against compute.combine's torch
arithmetic: fp32 products summed over k in order, rounded once."""
import pytest
import torch

from engine.kernels.combine_triton import combine_rows
from tests.kernels.conftest import float_dtypes, rel_err, tol


def torch_combine(y, w):
    t, k = w.shape
    return (y.view(t, k, -1).float() * w.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("T, K, H", [(1, 8, 64), (37, 8, 700), (5, 3, 16)])
def test_combine_rows_matches_torch(dev, dtype, T, K, H):
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T * K, H, generator=g).to(dev, dtype)
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(dev, dtype)
    got = combine_rows(y, w)
    assert got.dtype == dtype and got.shape == (T, H)
    assert rel_err(got, torch_combine(y, w)) < tol(dtype), seed


def test_combine_rows_names_a_wrong_shape(dev):
    with pytest.raises(ValueError, match="contiguous"):
        combine_rows(torch.zeros(10, 4, device=dev), torch.zeros(3, 3, device=dev))
