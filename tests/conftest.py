"""Without CUDA, Triton kernels run under Triton's interpreter (numpy on the CPU), so every kernel's test
also runs in CI. The variable must be set before any kernel module is imported (triton.jit reads it)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpret import patch_interpreter

    patch_interpreter()
