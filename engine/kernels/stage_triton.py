"""The mapped decode's prefetch of a guessed expert (engine/experts/mapped.py), all on the device.

    stage_guess(logits, valid, loc, host_gate_up, stage_id, stage_gate_up, rows, done, picked)

picks, from a guess at a layer's router logits, the expert read in place from the host (LOC_HOST) that the
rows weigh most, and copies part of its gate/up rows over PCIe into a device stage; the gate/up kernel
(moe_triton.py) reads a staged tile there once the copy's programs counted themselves done in `done`
(stage_programs of them). Reference: stage_guess_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2
from engine.kernels.moe_pairs_triton import LOC_HOST

@triton.jit
def _stage_pick(logits_ptr, lstride, valid_ptr, N: tl.constexpr, E, loc_ptr, BLOCK_E: tl.constexpr):
    """The expert read in place (LOC_HOST) that the rows' softmax puts most weight on, or -1.
    N (a decode bucket's rows) is a constant: Triton 3.6's interpreter cannot loop to a runtime bound."""
    re = tl.arange(0, BLOCK_E)
    emask = re < E
    score = tl.zeros([BLOCK_E], dtype=tl.float32)
    for t in range(N):
        row = tl.load(logits_ptr + t * lstride + re, mask=emask, other=float("-inf")).to(tl.float32)
        p = tl.exp(row - tl.max(row, axis=0))
        on = (tl.load(valid_ptr + t) != 0).to(tl.float32)
        score += on * p / tl.sum(p, axis=0)
    host = emask & (tl.load(loc_ptr + re, mask=emask, other=0) == -1)
    score = tl.where(host, score, -1.0)
    best = tl.argmax(score, axis=0)
    return tl.where(tl.max(score, axis=0) > 0, best, -1)


@triton.jit
def _stage_pick_kernel(logits_ptr, lstride, valid_ptr, E, loc_ptr, stage_ptr, done_ptr, N: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """One program: the expert to prefetch (_stage_pick) into stage, and the copy's done count back to 0."""
    tl.store(stage_ptr, _stage_pick(logits_ptr, lstride, valid_ptr, N, E, loc_ptr, BLOCK_E).to(tl.int32))
    tl.store(done_ptr, 0)


@triton.jit
def _stage_copy_kernel(stage_ptr, host_ptr, host_stride, out_ptr, done_ptr, half, up_at, BLOCK: tl.constexpr,
                       ITERS: tl.constexpr):
    """Each program copies its share of the picked expert's gate rows [0, R) and up rows [I, I + R): elements
    [0, half) and [up_at, up_at + half) of its [2I, H] block (half = R * H, up_at = I * H), at the same offsets
    in the stage; then, once all of its threads stored, adds one to done (release: a reader that sees done at
    the program count sees every row)."""
    e = tl.load(stage_ptr)
    if e >= 0:
        src = host_ptr + e.to(tl.int64) * host_stride
        for i in range(ITERS):
            q = (tl.program_id(0) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
            m = q < 2 * half
            off = tl.where(q < half, q, q - half + up_at)
            tl.store(out_ptr + off, tl.load(src + off, mask=m), mask=m)
    tl.debug_barrier()
    tl.atomic_add(done_ptr, 1, sem="release")


# The copy's grid: at most STAGE_PROGRAMS programs, each moving STAGE_BLOCK elements a load (STAGE_WARPS warps)
# as many times as its share needs. It runs beside the mixer's last kernels and a program holds its SM while
# its loads cross PCIe: 128 programs of 4 KB loads stretched the mixer's last projection from 12-18 us to
# 25-48 us. H200 box, offload decode b1 (8 layers, 37.5% slots, 2 MB staged), two runs an arm: 128 x 4 KB
# 200.4 / 200.6 tok/s, 64 x 4 KB 201.7 / 201.9, 32 x 8 KB 201.7 / 202.3, 16 x 16 KB (8 warps) 201.7 / 201.8,
# 8 x 32 KB 200.7 / 200.9 (too few to keep the link busy).
STAGE_BLOCK, STAGE_PROGRAMS, STAGE_WARPS = 4096, 32, 4


def stage_grid(inter: int, hidden: int, rows: int | None = None) -> tuple[int, int]:
    """(programs, loads each) of stage_guess's copy for experts of this width staging `rows` (None: all) of the
    gate and of the up rows. The programs are the done count at which every staged row has landed."""
    loads = cdiv(2 * (inter if rows is None else rows) * hidden, STAGE_BLOCK)
    programs = min(STAGE_PROGRAMS, loads)
    return programs, cdiv(loads, programs)


def stage_programs(inter: int, hidden: int, rows: int | None = None) -> int:
    """The copy's program count (stage_grid): the done count a staged tile waits for."""
    return stage_grid(inter, hidden, rows)[0]


def stage_guess(logits: torch.Tensor, valid: torch.Tensor, loc: torch.Tensor, host_gate_up: torch.Tensor,
                stage_id: torch.Tensor, stage_gate_up: torch.Tensor, rows: int | None = None,
                done: torch.Tensor | None = None, picked=None) -> None:
    """Prefetch one expert's gate/up weights for a layer whose routing is not known yet, all on the device.

    logits [N, E]: a guess at the layer's router logits (its router applied to the hidden state entering the
    layer, before its mixer); valid [N] int8; loc [E (+1)] int32: the layer's ExpertMap.loc. Of the experts
    read in place (LOC_HOST), the one the valid rows' softmax weighs most goes to stage_id [1] int32 and its
    gate and up rows [0, rows) (None: all I) from host_gate_up [E, 2I, H] (pinned, read over PCIe) into the
    same rows of stage_gate_up; stage_id is -1 where every expert sits in a slot. Two launches: the pick
    (which also sets done [1] int32 to 0), then the copy, whose programs each add one to done when their rows
    have landed (stage_programs of them). picked(): called between the two launches (on CUDA, to record an
    event the layer's kernels wait for: they need the pick, not the copy). Graph-safe: no host sync, fixed
    grids."""
    N, E = logits.shape
    if logits.stride(1) != 1 or valid.shape != (N,) or stage_gate_up.shape != host_gate_up.shape[1:] \
            or not stage_gate_up.is_contiguous() or host_gate_up.stride(2) != 1 \
            or host_gate_up.stride(1) != host_gate_up.shape[2] or stage_id.dtype != torch.int32 \
            or (done is not None and (done.dtype != torch.int32 or done.numel() != 1)):
        raise ValueError("stage_guess: logits [N, E] row-major, valid [N], host gate/up packed per expert and a "
                         "contiguous [2I, H] stage of the same shape, stage_id and done int32 [1]")
    I, H = stage_gate_up.shape[0] // 2, stage_gate_up.shape[1]
    half = (I if rows is None else rows) * H
    if done is None:
        done = torch.zeros(1, dtype=torch.int32, device=logits.device)
    _stage_pick_kernel[(1,)](logits, logits.stride(0), valid, E, loc, stage_id, done, N=N,
                             BLOCK_E=next_pow2(max(E, 2)))
    if picked is not None:
        picked()
    programs, loads = stage_grid(I, H, rows)
    _stage_copy_kernel[(programs,)](
        stage_id, host_gate_up, host_gate_up.stride(0), stage_gate_up, done, half, I * H, BLOCK=STAGE_BLOCK,
        ITERS=loads, num_warps=STAGE_WARPS)


def stage_guess_ref(logits, valid, loc, host_gate_up):
    """-> (the expert stage_guess stages, or -1; its gate/up weights or None)."""
    p = torch.softmax(logits.float(), dim=-1) * (valid != 0).float()[:, None]
    score = torch.where(loc[: logits.shape[1]] == LOC_HOST, p.sum(0), -1.0)
    if score.max() <= 0:
        return -1, None
    e = int(score.argmax())
    return e, host_gate_up[e]
