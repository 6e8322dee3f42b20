"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and newer GPUs.

A decode step is a chain of ~10 small kernels a layer, each waiting for the one before; between two of them
the GPU drains one grid and only then starts the next. Launched with PDL, a kernel's programs may be put on
the SMs while its predecessor's last programs still run, and wait there (`griddepcontrol.wait`) until the
predecessor has finished and its writes are visible. Each kernel calls `pdl_enter(PDL)` before it reads or
writes memory that a kernel writes (constant weights may be read first: norm_triton's add_norm_router takes its
router rows so), so the order of every such read and write is the one the stream gives; only the launch gap
and those weight reads overlap. Kernels launched without PDL (cuBLAS, torch ops) and graphs captured with it keep
ordinary stream order around them.

    on = pdl_on(x)                                # for the device x lives on
    kernel[grid](..., PDL=on, launch_pdl=on)      # in the kernel: pdl_enter(PDL) first
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED = {"on": True}
_CAPABLE: dict[int, bool] = {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the predecessor has finished, its writes are visible
        gdc_launch_dependents()  # the next kernel may now be placed beside this one's programs


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: a CUDA device of compute capability 9 or newer,
    compiled kernels (not Triton's interpreter), and not switched off by set_pdl(False)."""
    if not (_ENABLED["on"] and t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's launch arithmetic: triton.cdiv is a constexpr function whose host calls cost
    ~3 us each on the dev box (~8 on the H100 box) against ~0.15, and a layer's launches make a dozen of them."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), triton.next_power_of_2's value at a plain call's cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def set_pdl(on: bool) -> None:
    """Switch PDL on or off for kernels launched from now on (benchmarks compare the two)."""
    _ENABLED["on"] = bool(on)


def pdl_args(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel that starts with pdl_enter: PDL=..., launch_pdl=... for t's device."""
    on = pdl_on(t)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def last_to_finish(count_ptr, programs):
    """Inside a program that has stored its share: whether it is the last of `programs` to do so for the row of
    counts at count_ptr (zeroed_counts), the count then back at 0. Every thread's stores are done before the
    count moves (a barrier, then one thread's release); the last program may then read the others' shares
    (acquire), past L1 (cache_modifier=".cg": lines another SM wrote)."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    last = done == programs - 1
    if last:
        tl.store(count_ptr, 0)
    return last


_COUNTS: dict = {}


def zeroed_counts(kind: str, rows: int, device) -> torch.Tensor:
    """A zeroed int32 [rows] that a kernel of `kind` counts finished programs in (each row's last program acts on
    what the others wrote, then sets the row back to 0): one buffer a (kind, rows, device) serves every launch
    and graph, the kernels of a stream running one after the other (under PDL too: they wait at pdl_enter)."""
    key = (kind, rows, str(device))
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(rows, dtype=torch.int32, device=device)
    return _COUNTS[key]
