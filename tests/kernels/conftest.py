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


def _can_compile_sm90() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401 - the compiler and its ptxas
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", autouse=True)
def compiles_for_sm90():
    """Under the interpreter, every kernel launch a test module makes is also compiled for the GPU box
    (tests/kernels/sm90.py): the interpreter runs kernels the compiler refuses."""
    if CUDA or not _can_compile_sm90():
        yield
        return
    from tests.kernels.sm90 import compile_all, recording

    launches: dict = {}
    with recording(launches):
        yield
    failures = compile_all(list(launches.values()))
    if failures:
        pytest.fail("kernels that run under the interpreter but do not compile for sm_90:\n" + "\n".join(failures))
