"""Without CUDA, Triton kernels run under Triton's interpreter (numpy on the CPU), so every kernel's test
also runs in CI. The variable must be set before any kernel module is imported (triton.jit reads it)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpret import patch_interpreter

    patch_interpreter()


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
    if os.environ.get("TRITON_INTERPRET") != "1" or not _can_compile_sm90():
        yield
        return
    from tests.kernels.sm90 import compile_all, recording

    launches: dict = {}
    with recording(launches):
        yield
    failures = compile_all(list(launches.values()))
    if failures:
        pytest.fail("kernels that run under the interpreter but do not compile for sm_90:\n" + "\n".join(failures))
