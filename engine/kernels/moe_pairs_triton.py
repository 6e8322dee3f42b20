"""What the MoE kernels run: the router's top-k as (token, expert) pairs, the block mappings that say which
pairs each program of the expert kernels (moe_triton.py) takes, and where each expert is read in an expert
cache's decode (ExpertMap).

    ids, w = route_topk(logits, top_k, norm_topk, shared)       # [N, KP] int32 / fp32, KP = K (+1 shared)
    blocks = pair_blocks(ids) | group_blocks(ids) | expert_blocks(ids, E, BM)   # which pairs each program runs
    blocks = expert_blocks_fused(ids, E, BM)                    # expert_blocks' in one launch (a few thousand pairs)
    rows, expert = host_blocks(pos, counts, run_ids, BM)        # expert_blocks' made on the host, pairs grouped there

A block is BM pairs of one expert: `pair_blocks` gives each pair its own block (static shapes, graph-safe),
`group_blocks` runs all pairs of an expert in the block of its first pair over the same grid (decode: up to 16
tokens, each expert read once), `expert_blocks` groups the pairs of each expert (prefill: hundreds of tokens
per expert, real GEMM tiles). N = tokens, E = experts (+1 with the shared one), K = top-k, KP = pairs per
token, P = N * KP pairs, NB = blocks, BM = pairs per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.launch import next_pow2, pdl_args, pdl_enter

@triton.jit
def _topk_row(logits_ptr, row, stride, E, valid, K: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's routing -> (ids, weights) [BLOCK_K]: pairs 0..K-1 routed, pair K the shared expert."""
    cols = tl.arange(0, BLOCK_E)
    logit = tl.load(logits_ptr + row * stride + cols, mask=cols < E, other=float("-inf"))
    two = tl.arange(0, 2)  # the shared expert's gate logit at column E, where there is one
    gate = tl.sum(tl.load(logits_ptr + row * stride + E + two, mask=two < SHARED, other=0.0).to(tl.float32), axis=0)
    return _topk_of(logit, gate, E, valid, K, SHARED, NORM, BLOCK_E, BLOCK_K)


@triton.jit
def _topk_of(logit, gate, E, valid, K: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
             BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """_topk_row's routing of one token's logits already loaded: the routed ones [BLOCK_E] (-inf past E) and the
    shared expert's gate logit (read with SHARED), for a caller that reads them its own way."""
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    logit = logit.to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(live, p / tl.sum(p, axis=0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    ws = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # lowest id among equal maxima
        ids = tl.where(slots == k, idx, ids)
        ws = tl.where(slots == k, best, ws)
        p = tl.where(cols == idx, -1.0, p)
    if NORM:
        ws = ws / tl.sum(tl.where(slots < K, ws, 0.0), axis=0)
    if SHARED:
        ids = tl.where(slots == K, E, ids)
        ws = tl.where(slots == K, 1.0 / (1.0 + tl.exp(-gate)), ws)
    ids = tl.where(valid != 0, ids, -1)  # rows of a padded decode batch route nowhere
    return ids, ws


@triton.jit
def _route_topk_kernel(logits_ptr, ids_ptr, w_ptr, valid_ptr, stride, E,
                       K: tl.constexpr, KP: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    ids, ws = _topk_row(logits_ptr, row, stride, E, tl.load(valid_ptr + row), K, SHARED, NORM, BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + row * KP + slots, ids, mask=slots < KP)
    tl.store(w_ptr + row * KP + slots, ws, mask=slots < KP)


def route_topk(logits: torch.Tensor, top_k: int, norm_topk: bool, shared: bool,
               valid: torch.Tensor | None = None, out=None):
    """logits [N, E (+1: the shared expert's gate logit last)] -> ids [N, KP] int32, weights [N, KP] fp32.

    Softmax over the E routed logits in fp32, the top-k (lowest id first among ties), renormalised when
    norm_topk; with `shared`, pair K is (E, sigmoid(gate logit)). valid [N] int8: rows with 0 get id -1."""
    N, width = logits.shape
    E = width - 1 if shared else width
    if logits.stride(1) != 1 or not 0 < top_k <= E:
        raise ValueError(f"route_topk wants row-major logits and 0 < top_k <= {E}")
    kp = top_k + (1 if shared else 0)
    if valid is None:
        valid = torch.ones(N, dtype=torch.int8, device=logits.device)
    ids, w = out if out is not None else (torch.empty(N, kp, dtype=torch.int32, device=logits.device),
                                          torch.empty(N, kp, dtype=torch.float32, device=logits.device))
    _route_topk_kernel[(N,)](logits, ids, w, valid, logits.stride(0), E, K=top_k, KP=kp, SHARED=shared,
                             NORM=norm_topk, BLOCK_E=next_pow2(E),
                             BLOCK_K=next_pow2(kp), num_warps=4, **pdl_args(logits))
    return ids, w


def route_topk_ref(logits, top_k, norm_topk, shared, valid=None):
    E = logits.shape[1] - (1 if shared else 0)
    probs = F.softmax(logits[:, :E].float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    ids = ids.int()
    if shared:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1)
        w = torch.cat([w, torch.sigmoid(logits[:, E:].float())], dim=1)
    if valid is not None:
        ids = torch.where(valid[:, None] != 0, ids, -1)
    return ids, w


# a decode batch of at least this many tokens routes in its own launch before the experts, which then read each
# expert once for all the pairs routed to it (group_blocks); a single token routes inside the gate/up kernel
ROUTE_GROUP_TOKENS = 2
GROUP_PAIRS = 128  # from this many (token, expert) pairs on, experts run grouped per expert, not per pair
GROUP_BLOCK = 64  # pairs per block when grouped


# up to this many pairs (an extend of 512 tokens at top 8) expert_blocks runs as one kernel (expert_blocks_fused):
# the sort's ~25 small launches took 0.5 ms of the engine thread a layer call (H100 box, docs/PERF.md fortieth
# session) at a routed prompt's wholly resident layers, the first of which the device waits for; fused, 0.11 ms of
# device time a call (H100 box, forty-seventh session). Past it the prompt's host runs ahead of the device, and
# every program of the fused kernel reading all the pairs twice grows with them
FUSED_BLOCK_PAIRS = 4096


def blocks_for(ids: torch.Tensor, num_experts: int) -> "Blocks":
    """The block mapping a batch of pairs runs best in: a block per pair for a few (each expert read once when
    the tokens fit a block: as a decode step of that many tokens runs), grouped per expert for many."""
    if ids.numel() >= GROUP_PAIRS:
        if ids.numel() <= FUSED_BLOCK_PAIRS:
            return expert_blocks_fused(ids, num_experts, GROUP_BLOCK)
        return expert_blocks(ids, num_experts, GROUP_BLOCK)
    return group_blocks(ids) if ROUTE_GROUP_TOKENS <= ids.shape[0] <= PAIR_ROWS else pair_blocks(ids)


@dataclass(frozen=True)
class Blocks:
    """rows [NB, BM] int32: pair index per block row (-1: empty); expert [NB] int32 (-1: idle block).
    group: one block per pair whose kernels run, in the block of each expert's first pair, every pair of that
    expert (the kernels find them in `expert`; rows is not read) and leave the other blocks idle, so an expert
    that several tokens of a decode batch route to is read once (group_blocks)."""

    rows: torch.Tensor
    expert: torch.Tensor
    group: bool = False

    @property
    def bm(self) -> int:
        return self.rows.shape[1]


PAIR_ROWS = 16  # rows of a decode block: the matrix units' smallest tile
_PAIR_TABLES: dict = {}  # pair_blocks' rows by (pairs, rows a block, device)


def pair_blocks(ids: torch.Tensor, bm: int = PAIR_ROWS) -> Blocks:
    """One block per pair: no sorting, shapes fixed by the pair count (the decode mapping)."""
    P = ids.numel()
    key = (P, bm, ids.device)
    if key not in _PAIR_TABLES:
        rows = torch.full((P, bm), -1, dtype=torch.int32, device=ids.device)
        rows[:, 0] = torch.arange(P, dtype=torch.int32, device=ids.device)
        _PAIR_TABLES[key] = rows
    return Blocks(_PAIR_TABLES[key], ids.reshape(-1))


def group_blocks(ids: torch.Tensor) -> Blocks:
    """pair_blocks' grid, each expert's pairs run together in the block of its first pair (Blocks.group): the
    decode mapping for ids [N, KP] of at most PAIR_ROWS tokens (a token routes to an expert at most once, so
    an expert has at most N pairs), still without sorting or a host sync."""
    if ids.shape[0] > PAIR_ROWS:
        raise ValueError(f"group_blocks takes at most {PAIR_ROWS} tokens, got {ids.shape[0]}: use pair_blocks")
    return Blocks(pair_blocks(ids).rows, ids.reshape(-1), group=True)


def expert_blocks(ids: torch.Tensor, num_experts: int, bm: int) -> Blocks:
    """The pairs of each expert in blocks of bm (pair order within an expert kept), all on the device and
    without a host sync (no boolean masks, no bincount: a prefill chunk's host keeps launching ahead).

    The block count is the bound min(P, ceil(P / bm) + E); blocks past the used ones are idle. Padding pairs
    (id -1) land in a spill row that is cut off."""
    flat = ids.reshape(-1).long()
    P, dev = flat.numel(), flat.device
    nb = min(P, -(-P // bm) + num_experts)
    key = torch.where(flat >= 0, flat, num_experts)  # unrouted pairs (padding) sort last, into the spill row
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    blocks_of = (counts + bm - 1) // bm
    first_block = torch.cumsum(blocks_of, 0) - blocks_of
    first_pair = torch.cumsum(counts, 0) - counts
    e_sorted = key[order]
    routed = e_sorted < num_experts
    e_at = torch.where(routed, e_sorted, 0)
    rank = torch.arange(P, device=dev) - first_pair[e_at]
    block = torch.where(routed, first_block[e_at] + rank // bm, nb)
    rows = torch.full((nb + 1, bm), -1, dtype=torch.int32, device=dev)
    rows[block, torch.where(routed, rank % bm, 0)] = order.int()
    expert = torch.full((nb + 1,), -1, dtype=torch.int32, device=dev)
    expert[block] = torch.where(routed, e_sorted, -1).int()
    return Blocks(rows[:nb], expert[:nb])


# (the pairs and blocks change call to call: not specialized on, mailbox_triton.py)
@triton.jit(do_not_specialize=["P", "NB"])
def _expert_blocks_kernel(ids_ptr, rows_ptr, expert_ptr, P, E, NB, BM: tl.constexpr, BLOCK_E: tl.constexpr,
                          CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program e < E writes expert e's blocks (its pairs in order, BM to a block, after the blocks of the experts
    before it); program E marks the blocks past the used ones idle. Each counts every expert's pairs itself."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        key = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        counts += tl.histogram(tl.where((key >= 0) & (key < E), key, E), BLOCK_E)  # bin E: padding, unused
    cols = tl.arange(0, BLOCK_E)
    blocks_of = tl.where(cols < E, (counts + BM - 1) // BM, 0)
    lane = tl.arange(0, BM)
    if e < E:
        first = tl.sum(tl.where(cols < e, blocks_of, 0), axis=0)
        mine = tl.sum(tl.where(cols == e, counts, 0), axis=0)
        seen = 0
        for start in range(0, P, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            hit = tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e
            rank = seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(rows_ptr + (first + rank // BM) * BM + rank % BM, offs.to(tl.int32), mask=hit)
            seen += tl.sum(hit.to(tl.int32), axis=0)
        used = (mine + BM - 1) // BM
        if mine % BM > 0:  # the last block's empty rows
            tl.store(rows_ptr + (first + used - 1) * BM + lane, -1, mask=lane >= mine % BM)
        for b in range(0, used):
            tl.store(expert_ptr + first + b, e)
    else:
        for b in range(tl.sum(blocks_of, axis=0), NB):
            tl.store(expert_ptr + b, -1)
            tl.store(rows_ptr + b * BM + lane, -1)


def expert_blocks_fused(ids: torch.Tensor, num_experts: int, bm: int) -> Blocks:
    """expert_blocks' mapping, bit for bit, in one launch (E + 1 programs, no sort): for a few thousand pairs,
    where the host's launches, not the device, set the pace."""
    flat = ids.reshape(-1).contiguous()
    P = flat.numel()
    nb = min(P, -(-P // bm) + num_experts)
    rows = torch.empty((nb, bm), dtype=torch.int32, device=ids.device)
    expert = torch.empty((nb,), dtype=torch.int32, device=ids.device)
    if P:
        _expert_blocks_kernel[(num_experts + 1,)](flat, rows, expert, P, num_experts, nb, BM=bm,
                                                  BLOCK_E=next_pow2(num_experts + 1), CHUNK=256,
                                                  num_warps=4, **pdl_args(flat))
    return Blocks(rows, expert)


def host_blocks(pos: np.ndarray, counts: np.ndarray, run_ids: np.ndarray, bm: int) -> tuple[np.ndarray, np.ndarray]:
    """expert_blocks' mapping made on the host from pairs the host already holds grouped: pos [P] the pairs' flat
    indices run after run, counts [n] the pairs of each run, run_ids [n] the expert (or slot) each run reads ->
    (rows [NB, bm] int32, expert [NB] int32), NB the blocks used alone (expert_blocks' bound adds idle ones).
    With the runs in ascending id and each run's pairs ascending, the blocks are expert_blocks' first NB. A routed
    layer call's host has its routing (compute.Routing): two arrays uploaded instead of a score of small launches
    (~0.5 ms of the engine thread a call on the H100 box)."""
    blocks_of = -(-counts // bm)
    nb = int(blocks_of.sum())
    first_block = np.cumsum(blocks_of) - blocks_of
    first_pair = np.cumsum(counts) - counts
    run = np.repeat(np.arange(len(counts)), counts)
    rank = np.arange(len(pos)) - first_pair[run]
    rows = np.full((nb, bm), -1, dtype=np.int32)
    rows[first_block[run] + rank // bm, rank % bm] = pos
    return rows, np.repeat(run_ids, blocks_of).astype(np.int32, copy=False)


LOC_HOST, LOC_SHARED, LOC_CPU = -1, -2, -3  # ExpertMap.loc entries besides a slot id (LOC_CPU: _runs_here)


@dataclass(frozen=True)
class ExpertMap:
    """Where each expert of one MoE layer lives, for the kernels of an expert cache's decode (mapped): the
    gate_up / down given to run_experts* are then the device slots [S, 2I, H] / [S, H, I], and loc [E (+1)]
    int32 names per expert its slot (>= 0), LOC_HOST (read in place from the layer's pinned host pool
    host_gate_up [E, 2I, H] / host_down [E, H, I], over PCIe, no copy), LOC_SHARED (the shared expert,
    entry E: shared_gate_up [2I, H] / shared_down [H, I]) or LOC_CPU (the kernels skip the pair: the CPU
    runs it, mailbox_triton.py brings its output in). loc is read by the kernels when they run, so a
    graph replays with whatever the table says then; so are stage_id and stage_gate_up."""

    loc: torch.Tensor
    host_gate_up: torch.Tensor
    host_down: torch.Tensor
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    # a prefetched expert (stage_guess): stage_id [1] int32 names it (-1: none), stage_gate_up [2I, H] holds its
    # gate and up rows [0, stage_rows) (None: all I) on the device; the gate/up kernel's tiles inside those rows
    # read them there instead of over PCIe
    stage_id: torch.Tensor | None = None
    stage_gate_up: torch.Tensor | None = None
    stage_rows: int | None = None
    # stage_done [1] int32: the copy's programs that finished (stage_guess); given, the gate/up kernel does not
    # need the copy done before it starts: a staged tile waits (bounded by STAGE_SPIN polls) until stage_done
    # reaches the copy's program count (stage_programs of the staged rows), and reads the host's copy of its
    # rows if it never does. None: the copy is done.
    stage_done: torch.Tensor | None = None

    def args(self, up: bool) -> tuple:
        """(loc, host weights, their expert stride, shared weights) of the gate/up or the down kernel."""
        host = self.host_gate_up if up else self.host_down
        shared = self.shared_gate_up if up else self.shared_down
        return self.loc, host, host.stride(0), host if shared is None else shared
