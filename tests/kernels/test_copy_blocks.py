"""The slot fill kernel: each (expert, slot) pair copies the whole block, nothing else is written."""
import pytest
import torch

from engine.kernels.copy_triton import BLOCK, ITERS, copy_blocks


@pytest.mark.parametrize("programs", [64, 3])
def test_copy_blocks_puts_each_expert_in_its_slot(dev, programs, monkeypatch):
    from engine.kernels import copy_triton

    monkeypatch.setattr(copy_triton, "PROGRAMS", programs)  # 3: each program loops over several chunks
    g = torch.Generator().manual_seed(4)
    E, S, numel = 9, 6, BLOCK * ITERS + 37  # a block of more than one program, with a ragged end
    src = torch.randn(E, numel, generator=g)
    if dev == "cuda":
        src = src.pin_memory()  # read in place from the host, as the pool is
    dst = torch.full((S, numel), float("nan"), device=dev)
    pairs = torch.tensor([[7, 0], [2, 4], [8, 5], [0, 1]], dtype=torch.int32)
    copy_blocks(src, dst, pairs.to(dev))
    out = dst.cpu()
    for e, s in pairs.tolist():
        assert torch.equal(out[s], src[e].cpu())
    assert torch.isnan(out[[2, 3]]).all()
    with pytest.raises(ValueError, match="copy_blocks"):
        copy_blocks(src, dst[:, :-1], pairs.to(dev))
