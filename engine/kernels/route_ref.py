"""Torch reference of the decode routing step for one MoE layer (the Triton kernel in route_triton.py
must agree with it exactly): dedup -> residency lookup -> q* -> LRU victims -> assign -> slot rewrite.

T = tokens, K = experts per token, L = MoE layers, E = experts per layer, S = slots.
State (device tensors, updated in place): resident [L, E] int32 (slot or -1), owner [S] int32
(layer * E + expert or -1), stamp [S] int64 (last use; -1 = free). `clock` is this step's stamp and is
larger than every stamp already stored; `ratio` = B_P / B_H.

Rules: q = clamp(floor(m * ratio + 0.5), 0, m) of the m missing experts are filled, those routed by the
most (token, k) pairs first (ties: lower expert id); hits are stamped with `clock` and so can never be
victims; victims are the q slots with the smallest (stamp, slot id) among stamps < clock (fewer if fewer
exist: the rest run on the CPU).
Returns slot_ids [T, K] int32 (-1 = run on the CPU), fill_experts [F] / fill_slots [F] int32 padded with
-1 (F = min(T*K, E)), cpu_mask [E] bool, counts [2] int32 = (m, q).
"""
from __future__ import annotations

import torch


def route_ref(topk_ids: torch.Tensor, resident: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor,
              layer: int, clock: int, ratio: float):
    num_experts = resident.shape[1]
    n_pairs = topk_ids.numel()
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)  # [E]
    slot_of = resident[layer].long()  # [E]
    hit, miss = (counts > 0) & (slot_of >= 0), (counts > 0) & (slot_of < 0)
    stamp[slot_of[hit]] = clock
    avail = torch.nonzero(stamp < clock).flatten()  # candidate slots
    m = int(miss.sum())
    q32 = torch.tensor(m, dtype=torch.float32) * torch.tensor(ratio, dtype=torch.float32) + 0.5  # as the kernel
    q = min(max(0, int(torch.floor(q32))), m, len(avail))
    e_idx = torch.arange(num_experts, device=counts.device)
    order = sorted(torch.nonzero(miss).flatten().tolist(), key=lambda e: (-int(counts[e]), e))
    fills = torch.tensor(order[:q], dtype=torch.long, device=counts.device)
    victims = avail[torch.argsort(stamp[avail] * (len(stamp) + 1) + avail)][:q]
    old = owner[victims].long()
    old = old[old >= 0]
    resident.view(-1)[old] = -1
    resident[layer, fills] = victims.to(resident.dtype)
    owner[victims] = (layer * num_experts + fills).to(owner.dtype)
    stamp[victims] = clock
    slot_ids = resident[layer][topk_ids.long()].to(torch.int32)  # [T, K]
    f = min(n_pairs, num_experts)
    fill_experts = torch.full((f,), -1, dtype=torch.int32, device=counts.device)
    fill_slots = fill_experts.clone()
    fill_experts[:q], fill_slots[:q] = fills.to(torch.int32), victims.to(torch.int32)
    cpu_mask = miss & ~torch.isin(e_idx, fills)
    return slot_ids, fill_experts, fill_slots, cpu_mask, torch.tensor([m, q], dtype=torch.int32)
