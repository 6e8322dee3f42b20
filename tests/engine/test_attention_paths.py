"""The CPU chunk-attention fast path (two fused calls merged by log-sum-exp) against the masked reference."""
import pytest
import torch

from engine.layers import attention


@pytest.mark.skipif(attention._FLASH_CPU is None, reason="this torch has no fused CPU attention op")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T,pos,heads,kv_heads,D", [
    (7, 0, 4, 2, 16), (5, 9, 4, 2, 16), (33, 130, 8, 2, 32), (2, 1, 4, 4, 8), (64, 64, 6, 3, 24), (3, 1000, 4, 1, 16),
])
def test_split_cpu_attention_matches_the_masked_reference(T, pos, heads, kv_heads, D, dtype, tol):
    gen = torch.Generator().manual_seed(T * 1000 + pos)
    q = torch.randn(T, heads, D, generator=gen).to(dtype)
    keys = torch.randn(kv_heads, pos + T, D, generator=gen).to(dtype)
    values = torch.randn(kv_heads, pos + T, D, generator=gen).to(dtype)
    scale = D**-0.5
    with torch.inference_mode():
        fast = attention.attend_split_cpu(q, keys, values, pos, scale)
        ref = attention.attend_reference(q.double(), keys.double(), values.double(), pos, scale)
    assert fast.shape == (T, heads, D) and fast.dtype == dtype
    torch.testing.assert_close(fast.double(), ref, atol=tol, rtol=tol)
