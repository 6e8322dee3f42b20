"""The MoE block on the device without a host sync: router top-k, then every (token, expert) pair through
two grouped GEMM kernels that read each expert's weights once per block of pairs.

    ids, w = route_topk(logits, top_k, norm_topk, shared)       # [N, KP] int32 / fp32, KP = K (+1 shared)
    blocks = pair_blocks(ids) | group_blocks(ids) | expert_blocks(ids, E, BM)   # which pairs each program runs
    y = run_experts(x, gate_up, down, ids, w, blocks)           # [N, KP, H]: weighted output of each pair

The shared expert rides along as expert E (weights stacked after the routed ones) with weight
sigmoid(shared gate), so one launch pair serves the whole block; the caller sums the KP rows of a token
(kernels/norm_triton.add_rms_norm does it with the residual add). A block is BM pairs of one expert:
`pair_blocks` gives each pair its own block (static shapes, graph-safe), `group_blocks` runs all pairs of an
expert in the block of its first pair over the same grid (decode: up to 16 tokens, each expert read once),
`expert_blocks` groups the pairs of each expert (prefill: hundreds of tokens per expert, real GEMM tiles).
N = tokens, E = experts (+1 with the shared one), K = top-k, KP = pairs per token, H = hidden, I = expert
intermediate, P = N * KP pairs, NB = blocks, BM = pairs per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.launch import pdl_args, pdl_enter

@triton.jit
def _topk_row(logits_ptr, row, stride, E, valid, K: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's routing -> (ids, weights) [BLOCK_K]: pairs 0..K-1 routed, pair K the shared expert."""
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    logit = tl.load(logits_ptr + row * stride + cols, mask=live, other=float("-inf")).to(tl.float32)
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
        s = tl.load(logits_ptr + row * stride + E).to(tl.float32)
        ids = tl.where(slots == K, E, ids)
        ws = tl.where(slots == K, 1.0 / (1.0 + tl.exp(-s)), ws)
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
                             NORM=norm_topk, BLOCK_E=triton.next_power_of_2(E),
                             BLOCK_K=triton.next_power_of_2(kp), num_warps=4, **pdl_args(logits))
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


def blocks_for(ids: torch.Tensor, num_experts: int) -> "Blocks":
    """The block mapping a batch of pairs runs best in: a block per pair for a few (each expert read once when
    the tokens fit a block: as a decode step of that many tokens runs), grouped per expert for many."""
    if ids.numel() >= GROUP_PAIRS:
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


@triton.jit
def _block_rows(rows_ptr, exp_ptr, b, e, P, BM: tl.constexpr, GROUP: tl.constexpr, BLOCK_P: tl.constexpr):
    """(pair index of each of the block's BM rows, -1 empty; whether the block runs). GROUP (group_blocks): the
    block of expert e's first pair takes all of e's pairs in pair order, the others none."""
    rm = tl.arange(0, BM)
    if GROUP:
        rp = tl.arange(0, BLOCK_P)
        same = (tl.load(exp_ptr + rp, mask=rp < P, other=-1) == e) & (rp < P)
        lead = tl.min(tl.where(same, rp, BLOCK_P), axis=0) == b
        at = tl.cumsum(same.to(tl.int32), axis=0) - 1  # each of e's pairs' row in the block
        rows = tl.max(tl.where(same[None, :] & (at[None, :] == rm[:, None]), rp[None, :], -1), axis=1)
    else:
        lead = b >= 0
        rows = tl.load(rows_ptr + b * BM + rm)
    return rows, lead


@triton.jit
def _runs_here(e, loc_ptr, MAPPED: tl.constexpr):
    """Whether this block computes its expert e: a routed pair (e >= 0) that, in a mapped decode, the CPU does
    not run (LOC_CPU: the graph's CPU share, mailbox_triton.py, writes that pair's output instead)."""
    run = e >= 0
    if MAPPED:
        run = run & (tl.load(loc_ptr + tl.maximum(e, 0)) != -3)
    return run


@triton.jit
def _expert_base(w_ptr, w_stride, e, loc_ptr, h_ptr, h_stride, sh_ptr, MAPPED: tl.constexpr):
    """Where expert e's weights start. Unmapped: expert e of w. Mapped (an expert cache's decode): its
    location entry says slot s of w (s >= 0), in place in the host pool h (LOC_HOST: read over PCIe, no
    copy) or the shared expert sh (LOC_SHARED)."""
    if MAPPED:
        s = tl.load(loc_ptr + e)
        if s >= 0:
            base = w_ptr + s.to(tl.int64) * w_stride
        elif s == -1:
            base = h_ptr + e.to(tl.int64) * h_stride
        else:
            base = sh_ptr
    else:
        base = w_ptr + e.to(tl.int64) * w_stride
    return base


@triton.jit
def _pair_route(logits_ptr, b, lstride, E, valid_ptr, KP, K: tl.constexpr, SHARED: tl.constexpr,
                NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pair b's (expert, weight) in the decode mapping (one block a pair): its token's routing, pair b % KP."""
    token = b // KP
    ids, ws = _topk_row(logits_ptr, token, lstride, E, tl.load(valid_ptr + token), K, SHARED, NORM, BLOCK_E, BLOCK_K)
    pick = tl.arange(0, BLOCK_K) == b % KP
    return tl.sum(tl.where(pick, ids, 0), axis=0), tl.sum(tl.where(pick, ws, 0.0), axis=0)


@triton.jit
def _expert_up_kernel(x_ptr, w_ptr, w_stride, rows_ptr, exp_ptr, act_ptr, H, I, KP, P,
                      logits_ptr, lstride, E, valid_ptr, pw_ptr, loc_ptr, h_ptr, h_stride, sh_ptr,
                      stage_ptr, stage_w_ptr, stage_rows, done_ptr, done_target,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                      ROUTE: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, MAPPED: tl.constexpr, STAGED: tl.constexpr,
                      WAIT: tl.constexpr, SPIN: tl.constexpr, GROUP: tl.constexpr, BLOCK_P: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    if ROUTE:  # one pair per block (the decode mapping): route its token here, no top-k launch before
        e, pw = _pair_route(logits_ptr, b, lstride, E, valid_ptr, KP, K, SHARED, NORM, BLOCK_E, BLOCK_K)
        if tl.program_id(1) == 0:  # the down kernel reads the pair's weight (and expert) from here
            tl.store(exp_ptr + b, e)
            tl.store(pw_ptr + b, pw)
    else:
        e = tl.load(exp_ptr + b)
    rows, lead = _block_rows(rows_ptr, exp_ptr, b, e, P, BM, GROUP, BLOCK_P)
    if _runs_here(e, loc_ptr, MAPPED) & lead:
        valid = rows >= 0
        tok = tl.where(valid, rows // KP, 0).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < I
        base = _expert_base(w_ptr, w_stride, e, loc_ptr, h_ptr, h_stride, sh_ptr, MAPPED)
        if STAGED:  # the gate/up rows prefetched for this layer (stage_guess): read from the device copy
            if (e == tl.load(stage_ptr)) & ((tl.program_id(1) + 1) * BN <= stage_rows):
                if WAIT:  # the copy may still run on its stream: wait for it (bounded), else read the host's
                    got = tl.atomic_add(done_ptr, 0, sem="acquire")
                    n = 0
                    while (got < done_target) & (n < SPIN):
                        got = tl.atomic_add(done_ptr, 0, sem="acquire")
                        n += 1
                    tl.debug_barrier()
                    if got >= done_target:
                        base = stage_w_ptr
                else:
                    base = stage_w_ptr
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < H
            xa = tl.load(x_ptr + tok[:, None] * H + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(base + rn[:, None] * H + rk[None, :], mask=wmask, other=0.0)
            wu = tl.load(base + (I + rn)[:, None] * H + rk[None, :], mask=wmask, other=0.0)
            acc_g += tl.dot(xa, tl.trans(wg), input_precision=PREC)
            acc_u += tl.dot(xa, tl.trans(wu), input_precision=PREC)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        out = act_ptr + rows.to(tl.int64)[:, None] * I + rn[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _expert_down_kernel(act_ptr, w_ptr, w_stride, rows_ptr, exp_ptr, pw_ptr, y_ptr, H, I, P,
                        loc_ptr, h_ptr, h_stride, sh_ptr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        MAPPED: tl.constexpr, GROUP: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < H
    pdl_enter(PDL)
    e = tl.load(exp_ptr + b)
    rows, lead = _block_rows(rows_ptr, exp_ptr, b, e, P, BM, GROUP, BLOCK_P)
    if _runs_here(e, loc_ptr, MAPPED) & lead:
        valid = rows >= 0
        r64 = tl.where(valid, rows, 0).to(tl.int64)
        base = _expert_base(w_ptr, w_stride, e, loc_ptr, h_ptr, h_stride, sh_ptr, MAPPED)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < I
            a = tl.load(act_ptr + r64[:, None] * I + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            w = tl.load(base + rn[:, None] * I + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(w), input_precision=PREC)
        acc = acc * tl.load(pw_ptr + r64, mask=valid, other=0.0)[:, None]  # the pair's routing weight
        tl.store(y_ptr + r64[:, None] * H + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


def _tiles(bm: int, n: int, k: int, up: bool) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages): decode blocks (BM 16) stream weights in wide K tiles, prefill blocks use
    square-ish tiles. Decode tiles from `python -m engine.bench.tiles` on the H200 (weights read from HBM,
    docs/PERF.md issue 20): the gate/up kernel runs best in 64-row tiles 4 deep, for one token's pairs (20.8
    against 22.4 us a layer with 3) and for four or eight tokens' grouped per expert (group_blocks: 54.6 / 93.2
    us against 57.8 / 94.7 in 32-row tiles, 2026-12-05); the down kernel's candidates were within the noise of
    (64, 128, 4, 3). Triton's autotuner, timing on weights that stayed in L2, picked tiles that ran 7-11% slower
    in the step. The down kernel loops over K for every expert: its whole [BN, I] tile read before the PDL wait
    runs 17 us a layer against 7.5 on resident experts and gains nothing over PCIe in the offload decode
    (docs/PERF.md, twelfth session)."""
    if bm <= 16:
        return min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k)), 4, 4 if up else 3
    return min(64, triton.next_power_of_2(n)), min(64, triton.next_power_of_2(k)), 4, 3


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


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, blocks: Blocks, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                tiles: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None,
                mapped: ExpertMap | None = None):
    """x [N, H]; gate_up [E, 2I, H]; down [E, H, I]; ids / weights [N, KP] -> y [N, KP, H] (x's dtype).

    Rows of pairs with id -1 (padding) are left unwritten. out = (act [P, I], y [N, KP, H]) reuses buffers.
    tiles = ((BN, BK, warps, stages) of the gate/up kernel, the same of the down kernel) overrides _tiles
    (engine/bench/tiles.py sweeps them). mapped: gate_up / down are an expert cache's slots, looked up
    through mapped.loc (ExpertMap)."""
    _check(x, gate_up, down, ids, weights, mapped)
    return _launch(x, gate_up, down, blocks, weights, out, tiles, None, mapped)


def run_experts_routed(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, logits: torch.Tensor,
                       top_k: int, norm_topk: bool, shared: bool, valid: torch.Tensor,
                       ids: torch.Tensor, weights: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       tiles: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None,
                       mapped: ExpertMap | None = None):
    """The decode step's MoE: one token in two launches, route_topk's routing done inside the gate/up kernel
    (one block per pair, pair_blocks); ROUTE_GROUP_TOKENS to PAIR_ROWS tokens in three, route_topk first and
    then each expert read once for all its pairs (group_blocks).

    logits [N, E (+1 shared gate)] and valid [N] int8 as route_topk takes them; ids / weights [N, KP]
    (int32 / fp32) are written with what route_topk would return (the down kernel reads them) -> y [N, KP, H]
    as run_experts; mapped as run_experts."""
    _check(x, gate_up, down, ids, weights, mapped)
    E = logits.shape[1] - (1 if shared else 0)
    kp = top_k + (1 if shared else 0)
    if ids.shape != (x.shape[0], kp) or logits.stride(1) != 1 or not ids.is_contiguous() \
            or not weights.is_contiguous() or valid.shape != (x.shape[0],):
        raise ValueError(f"run_experts_routed: ids / weights must be contiguous [N, {kp}], valid [N], "
                         "logits row-major")
    if ROUTE_GROUP_TOKENS <= x.shape[0] <= PAIR_ROWS:  # the routing first, then each expert read once
        route_topk(logits, top_k, norm_topk, shared, valid, out=(ids, weights))
        return _launch(x, gate_up, down, group_blocks(ids), weights, out, tiles, None, mapped)
    route = (logits, logits.stride(0), E, valid, top_k, shared, norm_topk)
    return _launch(x, gate_up, down, pair_blocks(ids), weights, out, tiles, route, mapped)


def _check(x, gate_up, down, ids, weights, mapped: ExpertMap | None = None) -> None:
    N, H = x.shape
    E, two_i, Hw = gate_up.shape
    if Hw != H or down.shape != (E, H, two_i // 2) or ids.shape != weights.shape or ids.shape[0] != N:
        raise ValueError(f"run_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, ids {tuple(ids.shape)} do not fit together")
    if not (x.is_contiguous() and _rows_packed(gate_up) and _rows_packed(down)):
        raise ValueError("run_experts wants contiguous x and each expert's gate_up / down packed row-major "
                         "(the expert stride may be larger: an expert cache's slots hold both in one block)")
    if x.dtype != gate_up.dtype or x.dtype != down.dtype:
        raise ValueError(f"run_experts: x is {x.dtype} but the experts are {gate_up.dtype}")
    if mapped is not None:
        hg, hd = mapped.host_gate_up, mapped.host_down
        if hg.shape[1:] != gate_up.shape[1:] or hd.shape[1:] != down.shape[1:] or hg.shape[0] != hd.shape[0] \
                or not (_rows_packed(hg) and _rows_packed(hd)) or hg.dtype != x.dtype or hd.dtype != x.dtype \
                or mapped.loc.dtype != torch.int32 or mapped.loc.numel() < hg.shape[0]:
            raise ValueError("run_experts: the ExpertMap's host experts do not fit the slots (shape, packing, "
                             "dtype) or its loc is not int32 [E (+1)]")
        sg = mapped.stage_gate_up
        if mapped.stage_id is not None and (sg is None or sg.shape != gate_up.shape[1:] or not sg.is_contiguous()
                                            or sg.dtype != x.dtype or mapped.stage_id.dtype != torch.int32):
            raise ValueError("run_experts: the ExpertMap's staged gate/up must be a contiguous [2I, H] of the "
                             "experts' dtype, with an int32 stage_id")
        for w, ref in ((mapped.shared_gate_up, gate_up), (mapped.shared_down, down)):
            if w is not None and (w.shape != ref.shape[1:] or not w.is_contiguous() or w.dtype != x.dtype):
                raise ValueError("run_experts: the ExpertMap's shared expert does not have the routed ones' "
                                 "shape and dtype")


def _rows_packed(w: torch.Tensor) -> bool:
    """[E, R, C] with each expert's [R, C] row-major and contiguous (any stride between experts)."""
    return w.stride(2) == 1 and w.stride(1) == w.shape[2] and w.stride(0) >= w.shape[1] * w.shape[2]


def _launch(x, gate_up, down, blocks: Blocks, weights, out, tiles, route, mapped: ExpertMap | None):
    N, H = x.shape
    I = gate_up.shape[1] // 2
    KP = weights.shape[1]
    if out is None:
        act = torch.empty(N * KP, I, dtype=x.dtype, device=x.device)
        y = torch.empty(N, KP, H, dtype=x.dtype, device=x.device)
    else:
        act, y = out
    nb, bm = blocks.rows.shape
    group = {"GROUP": blocks.group, "BLOCK_P": triton.next_power_of_2(nb) if blocks.group else 1}
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 exact; 16-bit inputs ignore it
    if route is None:
        logits, lstride, E, valid, top_k, shared, norm = x, 0, 0, blocks.expert, 1, False, False
    else:
        logits, lstride, E, valid, top_k, shared, norm = route
    # unmapped: the location arguments are placeholders the kernels never read
    up_map = mapped.args(up=True) if mapped else (blocks.expert, gate_up, 0, gate_up)
    down_map = mapped.args(up=False) if mapped else (blocks.expert, down, 0, down)
    staged = mapped is not None and mapped.stage_id is not None
    rows = I if not staged or mapped.stage_rows is None else mapped.stage_rows
    wait = staged and mapped.stage_done is not None
    stage = (mapped.stage_id, mapped.stage_gate_up, rows) if staged else (blocks.expert, gate_up, 0)  # placeholders
    stage += (mapped.stage_done, stage_programs(I, H, rows)) if wait else (blocks.expert, 0)
    # a staged layer's gate/up waits for the prefetch's pick on another stream: plain stream order, no PDL edge
    pdl = {"PDL": False, "launch_pdl": False} if staged else pdl_args(x)
    bn, bk, warps, stages = tiles[0] if tiles else _tiles(bm, I, H, up=True)
    _expert_up_kernel[(nb, triton.cdiv(I, bn))](
        x, gate_up, gate_up.stride(0), blocks.rows, blocks.expert, act, H, I, KP, nb, logits, lstride, E, valid,
        weights,
        *up_map, *stage, BM=bm, BN=bn, BK=bk, PREC=prec, ROUTE=route is not None, K=top_k, SHARED=shared,
        NORM=norm, BLOCK_E=triton.next_power_of_2(max(E, 2)), BLOCK_K=triton.next_power_of_2(max(KP, 2)),
        MAPPED=mapped is not None, STAGED=staged, WAIT=wait, SPIN=STAGE_SPIN, **group, num_warps=warps,
        num_stages=stages, **pdl)
    bn, bk, warps, stages = tiles[1] if tiles else _tiles(bm, H, I, up=False)
    _expert_down_kernel[(nb, triton.cdiv(H, bn))](
        act, down, down.stride(0), blocks.rows, blocks.expert, weights, y, H, I, nb, *down_map,
        BM=bm, BN=bn, BK=bk, PREC=prec, MAPPED=mapped is not None, **group, num_warps=warps, num_stages=stages,
        **pdl_args(act))
    return y


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
# polls of the copy's done count a staged gate/up tile makes before it reads its rows from the host instead
# (each an L2 atomic, under a microsecond: a bound of milliseconds, far beyond a copy's ~50 us)
STAGE_SPIN = 8192


def stage_grid(inter: int, hidden: int, rows: int | None = None) -> tuple[int, int]:
    """(programs, loads each) of stage_guess's copy for experts of this width staging `rows` (None: all) of the
    gate and of the up rows. The programs are the done count at which every staged row has landed."""
    loads = triton.cdiv(2 * (inter if rows is None else rows) * hidden, STAGE_BLOCK)
    programs = min(STAGE_PROGRAMS, loads)
    return programs, triton.cdiv(loads, programs)


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
                             BLOCK_E=triton.next_power_of_2(max(E, 2)))
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


def run_experts_ref(x, gate_up, down, ids, weights):
    """The slow, obviously right version: every pair on its own, in fp32."""
    N, KP = ids.shape
    y = torch.zeros(N, KP, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(N):
        for k in range(KP):
            e = int(ids[t, k])
            if e < 0:
                continue
            g, u = (x[t].float() @ gate_up[e].float().T).chunk(2)
            y[t, k] = (F.silu(g) * u) @ down[e].float().T * weights[t, k]
    return y.to(x.dtype)
