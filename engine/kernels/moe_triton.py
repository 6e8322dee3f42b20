"""The MoE block's experts on the device without a host sync: every (token, expert) pair through two grouped
GEMM kernels that read each expert's weights once per block of pairs.

    ids, w = route_topk(logits, top_k, norm_topk, shared)       # moe_pairs_triton.py: [N, KP] pairs
    blocks = pair_blocks(ids) | group_blocks(ids) | expert_blocks(ids, E, BM)   # which pairs each program runs
    y = run_experts(x, gate_up, down, ids, w, blocks)           # [N, KP, H]: weighted output of each pair
    y = run_experts_routed(x, gate_up, down, logits, ...)       # a decode step's: the routing done here too

The shared expert rides along as expert E (weights stacked after the routed ones) with weight
sigmoid(shared gate), so one launch pair serves the whole block; the caller sums the KP rows of a token
(kernels/norm_triton.add_rms_norm does it with the residual add). In an expert cache's decode the kernels read
each expert where an ExpertMap says it is: a slot, the host pool in place, or a staged prefetch
(stage_triton.py). N = tokens, E = experts (+1 with the shared one), K = top-k, KP = pairs per token, H =
hidden, I = expert intermediate, P = N * KP pairs, NB = blocks, BM = pairs per block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2, pdl_args, pdl_enter
from engine.kernels.moe_pairs_triton import (PAIR_ROWS, ROUTE_GROUP_TOKENS, Blocks, ExpertMap, _topk_row,
                                             group_blocks, pair_blocks, route_topk)
from engine.kernels.stage_triton import stage_programs


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


# (the pairs' blocks and the staged copy's target change call to call: not specialized on, mailbox_triton.py)
@triton.jit(do_not_specialize=["P", "done_target"])
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


@triton.jit(do_not_specialize=["P"])
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
        return min(64, next_pow2(n)), min(128, next_pow2(k)), 4, 4 if up else 3
    return min(64, next_pow2(n)), min(64, next_pow2(k)), 4, 3


# polls of the copy's done count a staged gate/up tile makes before it reads its rows from the host instead
# (each an L2 atomic, under a microsecond: a bound of milliseconds, far beyond a copy's ~50 us)
STAGE_SPIN = 8192


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor | None,
                weights: torch.Tensor, blocks: Blocks, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                tiles: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None,
                mapped: ExpertMap | None = None):
    """x [N, H]; gate_up [E, 2I, H]; down [E, H, I]; ids / weights [N, KP] -> y [N, KP, H] (x's dtype).

    The kernels read the pairs through blocks alone: ids may be None where blocks were made without them (a routed
    call's, host_blocks). Rows of pairs with id -1 (padding) are left unwritten. out = (act [P, I], y [N, KP, H])
    reuses buffers. tiles = ((BN, BK, warps, stages) of the gate/up kernel, the same of the down kernel) overrides
    _tiles (engine/bench/tiles.py sweeps them). mapped: gate_up / down are an expert cache's slots, looked up
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
    pairs = weights.shape if ids is None else ids.shape
    if Hw != H or down.shape != (E, H, two_i // 2) or pairs != weights.shape or pairs[0] != N:
        raise ValueError(f"run_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, ids {tuple(pairs)} do not fit together")
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
    group = {"GROUP": blocks.group, "BLOCK_P": next_pow2(nb) if blocks.group else 1}
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
    _expert_up_kernel[(nb, cdiv(I, bn))](
        x, gate_up, gate_up.stride(0), blocks.rows, blocks.expert, act, H, I, KP, nb, logits, lstride, E, valid,
        weights,
        *up_map, *stage, BM=bm, BN=bn, BK=bk, PREC=prec, ROUTE=route is not None, K=top_k, SHARED=shared,
        NORM=norm, BLOCK_E=next_pow2(max(E, 2)), BLOCK_K=next_pow2(max(KP, 2)),
        MAPPED=mapped is not None, STAGED=staged, WAIT=wait, SPIN=STAGE_SPIN, **group, num_warps=warps,
        num_stages=stages, **pdl)
    bn, bk, warps, stages = tiles[1] if tiles else _tiles(bm, H, I, up=False)
    _expert_down_kernel[(nb, cdiv(H, bn))](
        act, down, down.stride(0), blocks.rows, blocks.expert, weights, y, H, I, nb, *down_map,
        BM=bm, BN=bn, BK=bk, PREC=prec, MAPPED=mapped is not None, **group, num_warps=warps, num_stages=stages,
        **pdl_args(act))
    return y


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
