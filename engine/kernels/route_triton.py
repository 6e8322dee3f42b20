"""Decode routing step for one MoE layer as one Triton launch, no host sync: dedup, residency lookup,
q*, LRU victim choice, assignment and logical -> slot rewrite. Semantics: route_ref.py (exact match).

One program does everything (a decode step routes a few dozen (token, k) pairs): per-expert counts by
broadcast compare, miss ranks by pairwise compare over E, victims by one bitonic sort of the S slot keys
(stamp, slot), passed through a scratch buffer to be read back by rank. Imported only on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import next_pow2


@triton.jit(do_not_specialize=["layer", "clock"])
def _route_kernel(ids_ptr, resident_ptr, owner_ptr, stamp_ptr, slot_ids_ptr, fill_e_ptr, fill_s_ptr,
                  cpu_ptr, counts_ptr, sorted_ptr, order_ptr, layer, clock, ratio,
                  TK: tl.constexpr, E: tl.constexpr, S: tl.constexpr, F: tl.constexpr,
                  BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_F: tl.constexpr):
    offs_tk = tl.arange(0, BLOCK_TK)
    offs_e = tl.arange(0, BLOCK_E)
    offs_s = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + offs_tk, mask=offs_tk < TK, other=-1).to(tl.int32)  # [TK]
    counts = tl.sum((ids[None, :] == offs_e[:, None]).to(tl.int32), axis=1)  # [E]
    slot_of = tl.load(resident_ptr + layer * E + offs_e, mask=offs_e < E, other=-1)  # [E]
    hit = (counts > 0) & (slot_of >= 0)
    miss = (counts > 0) & (slot_of < 0)
    # hits become the newest: never victims below
    tl.store(stamp_ptr + slot_of, tl.zeros_like(slot_of).to(tl.int64) + clock, mask=hit)
    tl.debug_barrier()
    st = tl.load(stamp_ptr + offs_s, mask=offs_s < S, other=clock)  # [S] int64
    avail = st < clock
    m = tl.sum(miss.to(tl.int32), axis=0)
    q = tl.floor(m.to(tl.float32) * ratio + 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(q, 0), tl.minimum(m, tl.sum(avail.to(tl.int32), axis=0)))
    # miss rank: more routed pairs first, then lower expert id
    key_e = tl.where(miss, (TK + 1 - counts) * BLOCK_E + offs_e, 2147483647)  # [E]
    rank = tl.sum((key_e[None, :] < key_e[:, None]).to(tl.int32), axis=1)  # [E]
    fill = miss & (rank < q)
    tl.store(order_ptr + rank, offs_e, mask=fill)  # fill experts by rank
    big = 9223372036854775807
    key_s = tl.where(avail, (st + 1) * BLOCK_S + offs_s, big)  # [S] (stamp, slot) packed
    tl.store(sorted_ptr + offs_s, tl.sort(key_s, 0))
    tl.debug_barrier()
    offs_f = tl.arange(0, BLOCK_F)
    live = offs_f < q
    fe = tl.load(order_ptr + offs_f, mask=live, other=-1)  # [F] experts to fill
    vs = (tl.load(sorted_ptr + offs_f, mask=live, other=0) % BLOCK_S).to(tl.int32)  # [F] their slots
    old = tl.load(owner_ptr + vs, mask=live, other=-1)
    tl.store(resident_ptr + old, tl.full([BLOCK_F], -1, tl.int32), mask=live & (old >= 0))
    tl.store(resident_ptr + layer * E + fe, vs, mask=live)
    tl.store(owner_ptr + vs, layer * E + fe, mask=live)
    tl.store(stamp_ptr + vs, tl.zeros_like(vs).to(tl.int64) + clock, mask=live)
    fmask = offs_f < F
    tl.store(fill_e_ptr + offs_f, tl.where(live, fe, -1), mask=fmask)
    tl.store(fill_s_ptr + offs_f, tl.where(live, vs, -1), mask=fmask)
    tl.store(cpu_ptr + offs_e, (miss & ~fill).to(tl.int8), mask=offs_e < E)
    tl.store(counts_ptr + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, m, q))
    tl.debug_barrier()
    new_slot = tl.load(resident_ptr + layer * E + ids, mask=offs_tk < TK, other=-1)
    tl.store(slot_ids_ptr + offs_tk, new_slot, mask=offs_tk < TK)


def route_triton(topk_ids: torch.Tensor, resident: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor,
                 layer: int, clock: int, ratio: float):
    """Same contract as route_ref.route_ref; state tensors updated in place on their device."""
    if resident.dtype != torch.int32 or owner.dtype != torch.int32 or stamp.dtype != torch.int64:
        raise ValueError("route_triton wants resident/owner int32 and stamp int64")
    if not (topk_ids.is_contiguous() and resident.is_contiguous()):
        raise ValueError("route_triton wants contiguous topk_ids and resident")
    num_layers, num_experts = resident.shape
    tk, s = topk_ids.numel(), owner.numel()
    f = min(tk, num_experts)
    block_tk, block_e = next_pow2(tk), next_pow2(num_experts)
    if block_tk * block_e > 1 << 16 or s > 1 << 15:
        raise ValueError(f"route_triton is a decode kernel: {tk} routed pairs x {num_experts} experts or "
                         f"{s} slots is too many for one program; use route_ref")
    dev = topk_ids.device
    slot_ids = torch.empty(topk_ids.shape, dtype=torch.int32, device=dev)
    fill_e = torch.empty(f, dtype=torch.int32, device=dev)
    fill_s = torch.empty(f, dtype=torch.int32, device=dev)
    cpu = torch.empty(num_experts, dtype=torch.int8, device=dev)
    counts = torch.empty(2, dtype=torch.int32, device=dev)
    block_s = next_pow2(s)
    scratch_sorted = torch.empty(block_s, dtype=torch.int64, device=dev)
    scratch_order = torch.empty(block_e, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](topk_ids, resident, owner, stamp, slot_ids, fill_e, fill_s, cpu, counts,
                        scratch_sorted, scratch_order, layer, clock, ratio,
                        TK=tk, E=num_experts, S=s, F=f, BLOCK_TK=block_tk, BLOCK_E=block_e,
                        BLOCK_S=block_s, BLOCK_F=next_pow2(f), num_warps=8)
    return slot_ids, fill_e, fill_s, cpu.bool(), counts
