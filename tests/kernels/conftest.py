"""Kernel tests run on CUDA, or on the CPU under Triton's interpreter (tests/conftest.py sets it up)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture
def dev() -> str:
    return "cuda" if CUDA else "cpu"


def float_dtypes() -> list[torch.dtype]:
    """fp32 everywhere; bf16 only compiled (the interpreter's bf16 dot is wrong), fp16 in the interpreter."""
    return [torch.float32, torch.bfloat16] if CUDA else [torch.float32, torch.float16]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]

