"""The skinny decode projection against a float64 product, at every row count it takes and odd widths."""
import pytest
import torch

from engine.kernels.linear_triton import SKINNY_ROWS, skinny_linear
from tests.kernels.conftest import float_dtypes, rel_err, tol


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("rows", [1, 5, SKINNY_ROWS])
def test_skinny_linear_matches_a_float64_product(dev, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    N, K = 37, 300  # neither a multiple of the tiles: masked edges in both directions
    x = torch.randn(rows, K, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) * 0.1).to(dev, dtype)
    y = torch.full((rows, N), float("nan"), dtype=dtype, device=dev)
    skinny_linear(x, w, out=y)
    assert rel_err(y, x.double() @ w.double().T) < tol(dtype)
    for tiles in ((32, 64, 4, 2), (16, 128, 4, 3)):  # the tile sweep's candidates compute the same function
        assert rel_err(skinny_linear(x, w, tiles=tiles), x.double() @ w.double().T) < tol(dtype)


def test_skinny_linear_refuses_what_it_cannot_take(dev):
    w = torch.randn(8, 16, device=dev)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(SKINNY_ROWS + 1, 16, device=dev), w)
    with pytest.raises(ValueError, match="do not fit"):
        skinny_linear(torch.randn(2, 15, device=dev), w)


def test_skinny_linear_writes_float32_sums_when_asked(dev):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 64, generator=g).to(dev, torch.float16)
    w = (torch.randn(40, 64, generator=g) * 0.1).to(dev, torch.float16)
    y = skinny_linear(x, w, dtype=torch.float32)
    assert y.dtype == torch.float32
    assert rel_err(y, x.double() @ w.double().T) < 1e-4  # fp16 operands, fp32 sums, no fp16 rounding at the end


def test_each_width_class_takes_the_tiles_set_for_it(dev):
    """set_skinny_tiles (bench model --skinny-tiles) changes the tiles of the classes it names alone, the product
    stays the product, and None restores the engine's own."""
    from engine.kernels.linear_triton import SKINNY_TILES, set_skinny_tiles, skinny_tiles, width_class

    assert [width_class(n) for n in (37, 4096, 4097, 65536, 65537, 248320)] == \
        ["narrow", "narrow", "wide", "wide", "head", "head"]
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 300, generator=g).to(dev), (torch.randn(37, 300, generator=g) * 0.1).to(dev)
    try:
        set_skinny_tiles({"narrow": (32, 64, 4, 2)})
        assert skinny_tiles(37) == (32, 64, 4, 2) and skinny_tiles(248320) == SKINNY_TILES["head"]
        assert rel_err(skinny_linear(x, w), x.double() @ w.double().T) < tol(torch.float32)
        with pytest.raises(ValueError, match="width classes are narrow, wide, head"):
            set_skinny_tiles({"vocab": (32, 128, 4, 4)})
    finally:
        set_skinny_tiles(None)
    assert skinny_tiles(37) == SKINNY_TILES["narrow"]
