"""Copy scattered expert blocks from the pinned host pool into device slots in one kernel launch.

    copy_blocks(src [E, numel] (pinned host, mapped), dst [S, numel] (device), pairs [n, 2] int32 (expert, slot))

A layer streamed into the slot pool lands in as many runs as its victims are scattered; one cudaMemcpyAsync a
run, and the host blocks in the driver once the copy queue is deep (on the H200 box ~100 us a call, one
layer's copies issued while the previous layer's drained: the host, not PCIe, paced the prefill; docs/PERF.md
issue 17). The kernel reads the host blocks in place over PCIe (engine/bench/mapped.py measured 48-49 GB/s for
such contiguous reads against 53-55 for the copy engines) and costs the host one launch, so the engine thread
keeps queueing compute while the copy stream fills the slots. E = experts, S = slots, numel = one block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, ITERS = 4096, 8  # elements a load, loads a chunk: 64 KB of bf16
PROGRAMS = 64  # programs in all, each looping over chunks: half the H200's SMs, the rest stay free for the
# compute the copies run beside (a grid of every chunk would fill the SMs with programs waiting on PCIe)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, pairs_ptr, numel, chunks, total, BLOCK: tl.constexpr,
                        ITERS: tl.constexpr, PROGRAMS: tl.constexpr):
    for c in range(tl.program_id(0), total, PROGRAMS):
        pair = c // chunks
        e = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
        s = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
        start = (c % chunks).to(tl.int64) * (BLOCK * ITERS)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            live = offs < numel
            tl.store(dst_ptr + s * numel + offs, tl.load(src_ptr + e * numel + offs, mask=live), mask=live)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """dst[slot] = src[expert] for each row (expert, slot) of pairs [n, 2] int32 (on dst's device), on the
    current stream."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype \
            or not (src.is_contiguous() and dst.is_contiguous()) or pairs.dtype != torch.int32 or pairs.dim() != 2:
        raise ValueError(f"copy_blocks: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}, "
                         f"pairs {tuple(pairs.shape)} {pairs.dtype} do not fit together")
    if pairs.shape[0] == 0:
        return
    numel = src.shape[1]
    chunks = triton.cdiv(numel, BLOCK * ITERS)
    total = pairs.shape[0] * chunks
    programs = min(PROGRAMS, total)
    _copy_blocks_kernel[(programs,)](src, dst, pairs.contiguous(), numel, chunks, total, BLOCK=BLOCK, ITERS=ITERS,
                                     PROGRAMS=programs, num_warps=8)
