"""The device half of a graphed decode step's CPU share (the host half: engine/experts/graph_cpu.py).

In a mapped decode (engine/experts/mapped.py) an expert whose location entry is LOC_CPU is skipped by the
expert kernels and run by a native CPU thread from the host pool instead, while the device runs the rest of
the layer's experts; the step stays one CUDA graph. Per MoE layer, in stream order:

    publish(...)   routes and normed hidden rows -> the mailbox in page-locked host memory, seq += 1
    post(...)      posted <- seq: a kernel of its own, so the publish's writes are visible before the flag
    (expert kernels: every pair but the CPU's)
    wait(...)      if the layer has CPU pairs, spin until the CPU's done >= seq (bounded: err <- 1)
    join(...)      y[pair] <- the CPU's output row * the pair's routing weight, read past the caches

The mailbox's buffers are CPU tensors the kernels address directly (pinned memory is mapped into the
device's address space); seq lives on the device, so a graph replays the protocol unchanged. Under Triton's
interpreter (the CPU tests) the same kernels run on the host against the same native thread.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import next_pow2
from engine.kernels.moe_pairs_triton import LOC_CPU, _topk_row

# spins of the wait kernel (one read of host memory each, ~1 us over PCIe) before it gives up: the CPU
# thread is gone or stuck; the step's output is then wrong and err says so
WAIT_LIMIT = 5_000_000


@triton.jit(do_not_specialize=["N", "row"])
def _publish_kernel(h_ptr, logits_ptr, lstride, E, valid_ptr, N, H, ids_ptr, x_ptr, meta_ptr, seq_ptr, row,
                    K: tl.constexpr, KP: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    slots = tl.arange(0, BLOCK_K)
    for t in range(N):
        ids, ws = _topk_row(logits_ptr, t, lstride, E, tl.load(valid_ptr + t), K, SHARED, NORM, BLOCK_E, BLOCK_K)
        tl.store(ids_ptr + t * KP + slots, ids, mask=slots < KP)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            tl.store(x_ptr + t * H + cols, tl.load(h_ptr + t * H + cols, mask=m), mask=m)
    tl.store(meta_ptr, row)
    tl.store(meta_ptr + 1, N)
    seq = tl.load(seq_ptr) + 1
    tl.debug_barrier()  # every thread has read seq before any writes it
    tl.store(seq_ptr, seq)


@triton.jit
def _post_kernel(seq_ptr, posted_ptr):
    tl.store(posted_ptr, tl.load(seq_ptr))


@triton.jit
def _spin_until(word_ptr, target, err_ptr, LIMIT):
    """Read word_ptr[0] (host memory, uncached) until it reaches target or LIMIT reads pass; err_ptr[0] <- 1 on
    the latter. Returns the reads it took."""
    d = tl.load(word_ptr, volatile=True)
    i = 0
    while (d < target) & (i < LIMIT):
        d = tl.load(word_ptr, volatile=True)
        i += 1
    if d < target:
        tl.store(err_ptr, 1)
    return i


@triton.jit(do_not_specialize=["P"])
def _wait_kernel(ids_ptr, loc_ptr, P, seq_ptr, done_ptr, err_ptr, spins_ptr, LIMIT, BLOCK_P: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    loc = tl.load(loc_ptr + tl.maximum(e, 0), mask=p < P, other=0)
    need = tl.sum(((e >= 0) & (loc == -3)).to(tl.int32), axis=0)
    if need > 0:
        tl.store(spins_ptr, _spin_until(done_ptr, tl.load(seq_ptr), err_ptr, LIMIT))
    else:
        tl.store(spins_ptr, 0)


@triton.jit
def _join_kernel(ids_ptr, w_ptr, loc_ptr, y_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(ids_ptr + b)
    if e >= 0:
        if tl.load(loc_ptr + e) == -3:
            wt = tl.load(w_ptr + b)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                m = cols < H
                # .cv: the CPU rewrote these rows since any earlier read; fetch them again
                v = tl.load(out_ptr + b.to(tl.int64) * H + cols, mask=m, other=0.0, cache_modifier=".cv")
                tl.store(y_ptr + b.to(tl.int64) * H + cols, (v * wt).to(y_ptr.dtype.element_ty), mask=m)


def publish(box, row: int, h: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor, top_k: int,
            norm_topk: bool, shared: bool) -> None:
    """The layer's routes (as route_topk computes them) and h [N, H] into the mailbox, then the flag."""
    N, H = h.shape
    if N > box.n_max or not h.is_contiguous() or logits.stride(1) != 1:
        raise ValueError(f"publish: h must be contiguous [<= {box.n_max}, H], logits row-major")
    E = logits.shape[1] - (1 if shared else 0)
    kp = top_k + (1 if shared else 0)
    _publish_kernel[(1,)](h, logits, logits.stride(0), E, valid, N, H, box.ids, box.x, box.meta, box.seq, row,
                          K=top_k, KP=kp, SHARED=shared, NORM=norm_topk, BLOCK_E=next_pow2(E),
                          BLOCK_K=next_pow2(max(kp, 2)), BLOCK_H=1024, num_warps=4)
    _post_kernel[(1,)](box.seq, box.posted, num_warps=1)


def join(box, row: int, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, loc: torch.Tensor) -> None:
    """y [N, KP, H]: the CPU pairs' rows (ids / weights [N, KP] as the expert kernels wrote them, loc the
    layer's location row) from the mailbox, after waiting for the CPU where the layer has any."""
    N, KP, H = y.shape
    P = N * KP
    _wait_kernel[(1,)](ids, loc, P, box.seq, box.done, box.err, box.spins[row:], WAIT_LIMIT,
                       BLOCK_P=next_pow2(max(P, 2)), num_warps=1)
    _join_kernel[(P,)](ids, weights, loc, y, box.out, H, BLOCK_H=1024, num_warps=4)


def join_ref(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, loc: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """What join leaves in y, computed plainly (tests): CPU pairs' rows are out's rows times their weight."""
    y = y.clone()
    N, KP, H = y.shape
    for p in range(N * KP):
        e = int(ids.view(-1)[p])
        if e >= 0 and int(loc[e]) == LOC_CPU:
            y.view(-1, H)[p] = (out[p].float().to(y.device) * float(weights.view(-1)[p])).to(y.dtype)
    return y


@triton.jit
def _scatter_rows_kernel(pos_ptr, src_ptr, y_ptr, H, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(pos_ptr + i, cache_modifier=".cv").to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        v = tl.load(src_ptr + i.to(tl.int64) * H + cols, mask=m, other=0.0, cache_modifier=".cv")
        tl.store(y_ptr + p * H + cols, v.to(y_ptr.dtype.element_ty), mask=m)


def scatter_rows(y: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
    """y[pos[i]] = src[i] for the n rows of src [n, H], read in place from page-locked host memory (pos [n]
    int64 too) by a kernel on y's stream: a routed prompt's CPU expert outputs reach the device without a copy
    queued on a copy engine, where an H2D copy waited behind the next layer's experts copied ahead (H200 box,
    2026-12-03: 2-4 ms a layer). y [R, H] on the device, contiguous."""
    n, H = src.shape
    if not (y.is_contiguous() and src.is_contiguous() and y.shape[1] == H and pos.shape == (n,)):
        raise ValueError(f"scatter_rows: y [R, {H}] and src [{n}, {H}] contiguous, pos [{n}]")
    if n:
        _scatter_rows_kernel[(n,)](pos, src, y, H, BLOCK_H=1024, num_warps=4)


# Counts that change from call to call are not specialized on: Triton compiles (or loads) a variant of a kernel
# for an int argument equal to 1 or divisible by 16, and a variant's first launch mid-run held a layer call of an
# extend ~10-12 ms in the engine thread (_init_handles, H100 box profiles, docs/PERF.md); the target here is the
# joined CPU job's sequence number, a new variant at 1 and at 16
@triton.jit(do_not_specialize=["target"])
def _wait_flag_kernel(flag_ptr, target, err_ptr, LIMIT):
    _spin_until(flag_ptr, target, err_ptr, LIMIT)


def wait_flag(flag: torch.Tensor, target: int, err: torch.Tensor) -> None:
    """Hold the stream until flag[0] >= target: flag a page-locked host int64 [1] that a CPU thread raises once
    what the kernels queued after this read is written (a routed prompt's CPU expert outputs, which the host
    then need not wait for before queuing the layers after). Bounded: after WAIT_LIMIT reads err[0] <- 1 and the
    stream goes on."""
    if flag.dtype != torch.int64 or flag.numel() != 1 or err.dtype != torch.int32:
        raise ValueError("wait_flag: flag is int64 [1], err int32")
    _wait_flag_kernel[(1,)](flag, target, err, WAIT_LIMIT, num_warps=1)
