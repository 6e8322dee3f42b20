"""Router top-k and the grouped expert kernels against the slow per-pair reference, for both block mappings."""
import numpy as np
import pytest
import torch

from engine.kernels.moe_pairs_triton import (LOC_CPU, LOC_HOST, LOC_SHARED, PAIR_ROWS, Blocks, ExpertMap,
                                             expert_blocks, expert_blocks_fused, group_blocks, host_blocks,
                                             pair_blocks, route_topk, route_topk_ref)
from engine.kernels.moe_triton import run_experts, run_experts_ref, run_experts_routed
from engine.kernels.stage_triton import stage_guess, stage_guess_ref, stage_programs
from tests.kernels.conftest import float_dtypes, rel_err, tol


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_matches_torch_topk(dev, shared, norm):
    g = torch.Generator().manual_seed(3 + shared + 2 * norm)
    N, E, K = 5, 40, 6
    logits = torch.randn(N, E + shared, generator=g).to(dev)
    valid = torch.tensor([1, 1, 0, 1, 0], dtype=torch.int8, device=dev)
    ids, w = route_topk(logits, K, norm, shared, valid)
    ref_ids, ref_w = route_topk_ref(logits, K, norm, shared, valid)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    live = valid.bool().cpu()
    assert torch.allclose(w.cpu()[live], ref_w.cpu()[live], atol=1e-6)


@pytest.mark.parametrize("padding", [0.0, 0.08, 0.5])
def test_expert_blocks_cover_every_pair_once(dev, padding):
    g = torch.Generator().manual_seed(11 + int(padding * 100))
    E, bm = 9, 4
    ids = torch.randint(0, E, (13, 3), generator=g).int()
    ids[torch.rand(ids.shape, generator=g) < padding] = -1  # padding pairs belong to no block
    ids[2, 1] = -1
    b = expert_blocks(ids.to(dev), E, bm)
    rows, expert = b.rows.cpu(), b.expert.cpu()
    seen = rows[rows >= 0].sort().values
    expected = torch.arange(ids.numel())[ids.flatten() >= 0]
    assert torch.equal(seen, expected.int())
    for blk in range(rows.shape[0]):
        r = rows[blk][rows[blk] >= 0]
        if len(r):
            assert (ids.flatten()[r.long()] == expert[blk]).all()
            assert torch.equal(r, r.sort().values)  # pair order kept inside an expert
        else:
            assert expert[blk] == -1


@pytest.mark.parametrize("E,bm,N,K", [(9, 4, 13, 3), (257, 64, 256, 9), (5, 1, 7, 2), (33, 16, 50, 4)])
def test_expert_blocks_fused_is_expert_blocks_bit_for_bit(dev, E, bm, N, K):
    """One launch against the sort (the reference), on fresh random routing with padding pairs and experts no pair
    routes to: the same blocks, rows and idle tail."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E - 1 if E > 8 else E, (N, K), generator=g).int()  # (the last expert unrouted)
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
    got, want = expert_blocks_fused(ids.to(dev), E, bm), expert_blocks(ids.to(dev), E, bm)
    assert torch.equal(got.rows.cpu(), want.rows.cpu()), seed
    assert torch.equal(got.expert.cpu(), want.expert.cpu()), seed


def _random_experts(g, dev, dtype, N: int, E: int, KP: int, H: int, I: int):
    """x [N, H], gate_up [E, 2I, H], down [E, H, I] on dev in dtype, and ids [N, KP] int32 on the CPU, drawn from g."""
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dev, dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dev, dtype)
    return x, gate_up, down, torch.randint(0, E, (N, KP), generator=g).int()


def _grouped_on_host(ids: torch.Tensor, bm: int):
    """host_blocks' inputs as a routed call's host holds them (compute.Routing's grouping), from ids [N, KP]."""
    flat = ids.flatten().numpy()
    order = np.argsort(flat, kind="stable")
    order = order[flat[order] >= 0]
    run_ids, counts = np.unique(flat[order], return_counts=True)
    return host_blocks(order, counts, run_ids, bm)


@pytest.mark.parametrize("bm", [1, 4, 16])
def test_host_blocks_are_expert_blocks_without_the_idle_ones(dev, bm):
    """Fresh random routing each run, some pairs padding: the blocks made on the host from the grouped pairs are
    expert_blocks' used blocks, in the same order, and every block expert_blocks adds past them is idle."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(2, 40, (), generator=g))
    ids = torch.randint(0, E, (int(torch.randint(1, 60, (), generator=g)), 3), generator=g).int()
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
    rows, expert = _grouped_on_host(ids, bm)
    ref = expert_blocks(ids.to(dev), E, bm)
    nb = len(expert)
    assert torch.equal(torch.from_numpy(rows), ref.rows[:nb].cpu()), f"seed {seed}"
    assert torch.equal(torch.from_numpy(expert), ref.expert[:nb].cpu()), f"seed {seed}"
    assert (ref.expert[nb:] == -1).all() and (ref.rows[nb:] == -1).all()


def test_experts_over_host_blocks_equal_expert_blocks(dev):
    """The same kernels over host_blocks' mapping (no ids given) and over expert_blocks': the same bits."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    N, E, KP, I = 24, 6, 4, 40
    dtype = float_dtypes()[-1]
    x, gate_up, down, ids = _random_experts(g, dev, dtype, N, E, KP, 48, I)
    ids[3, 1] = -1
    w = torch.ones(N, KP, device=dev)
    rows, expert = _grouped_on_host(ids, 16)
    host = Blocks(torch.from_numpy(rows).to(dev), torch.from_numpy(expert).to(dev))
    want = run_experts(x, gate_up, down, ids.to(dev), w, expert_blocks(ids.to(dev), E, 16))
    got = run_experts(x, gate_up, down, None, w, host, out=(torch.empty(N * KP, I, dtype=dtype, device=dev),
                                                          want.new_zeros(want.shape)))
    live = (ids >= 0).to(dev)
    assert torch.equal(got[live], want[live]), f"seed {seed}"


@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("mapping", ["pair", "expert"])
def test_run_experts_matches_reference(dev, dtype, mapping):
    g = torch.Generator().manual_seed(5 if mapping == "pair" else 6)
    N, E, KP, H, I = 6, 7, 3, 48, 40  # H, I not multiples of the tiles: masked edges
    x, gate_up, down, ids = _random_experts(g, dev, dtype, N, E, KP, H, I)
    ids[4, 2] = -1
    w = torch.rand(N, KP, generator=g)
    ids, w = ids.to(dev), w.to(dev)
    blocks = pair_blocks(ids) if mapping == "pair" else expert_blocks(ids, E, 16)
    y = run_experts(x, gate_up, down, ids, w, blocks)
    ref = run_experts_ref(x, gate_up, down, ids, w)
    live = (ids >= 0).cpu()
    assert rel_err(y.cpu()[live], ref.cpu()[live]) < 3 * tol(dtype)


@pytest.mark.parametrize("mapping", ["pair", "expert"])
def test_run_experts_reads_slot_blocks_in_place(dev, mapping):
    """An expert cache's slots hold gate_up and down in one block [S, 3IH]: views with an expert stride of
    the whole block run as their contiguous copies do; a view with scattered rows is refused."""
    g = torch.Generator().manual_seed(8)
    N, S, KP, H, I = 5, 6, 2, 48, 40
    buf = (torch.randn(S, 3 * I * H, generator=g) * 0.2).to(dev)  # [S, numel]
    gate_up, down = buf[:, : 2 * I * H].view(S, 2 * I, H), buf[:, 2 * I * H :].view(S, H, I)
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    ids = torch.randint(0, S, (N, KP), generator=g).int().to(dev)
    ids[1, 0] = -1  # a pair the CPU runs: its row is left alone
    w = torch.ones(N, KP, device=dev)
    blocks = pair_blocks(ids) if mapping == "pair" else expert_blocks(ids, S, 16)
    y = run_experts(x, gate_up, down, ids, w, blocks)
    ref = run_experts(x, gate_up.contiguous(), down.contiguous(), ids, w, blocks)
    live = (ids >= 0).cpu()
    assert torch.equal(y.cpu()[live], ref.cpu()[live])
    with pytest.raises(ValueError, match="packed row-major"):
        run_experts(x, torch.zeros(S, 2 * I, 2 * H, device=dev)[:, :, ::2], down, ids, w, blocks)


def test_run_experts_names_a_dtype_mismatch(dev):
    x = torch.randn(2, 16, device=dev)
    gu = torch.randn(3, 32, 16, device=dev, dtype=torch.float16)
    dn = torch.randn(3, 16, 16, device=dev, dtype=torch.float16)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="experts are"):
        run_experts(x, gu, dn, ids, torch.ones(2, 1, device=dev), pair_blocks(ids))



@pytest.mark.parametrize("N", [2, 5, PAIR_ROWS])
def test_group_blocks_equal_a_block_a_pair(dev, N):
    """group_blocks (every pair of an expert in the block of its first pair, one read of the expert) computes
    what pair_blocks does, bit for bit (under Triton's interpreter within a few float32 units), on fresh random
    routing where most experts serve several tokens (the shared one all of them), with a padding token, and mapped
    with experts in slots, read in place and run by the CPU (whose rows stay unwritten); more tokens than a block
    has rows are refused."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    E, K, H, I, S = 6, 3, 40, 24, 3
    numel = 3 * I * H
    host = torch.randn(E + 1, numel, generator=g) * 0.2  # expert E: the shared one
    if dev == "cuda":
        host = host.pin_memory()

    def split(buf):
        return buf[..., : 2 * I * H].unflatten(-1, (2 * I, H)), buf[..., 2 * I * H:].unflatten(-1, (H, I))

    ids = torch.stack([torch.cat([torch.randperm(E, generator=g)[:K], torch.tensor([E])]) for _ in range(N)]).int()
    ids[N // 2] = -1  # a padding token
    ids, w = ids.to(dev), torch.rand(N, K + 1, generator=g).to(dev)
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    loc = torch.full((E + 1,), LOC_HOST, dtype=torch.int32)
    slots = torch.zeros(S, numel, device=dev)
    for s, e in enumerate((1, 4)):
        slots[s], loc[e] = host[e].to(dev), s
    loc[E], loc[2] = LOC_SHARED, LOC_CPU
    hg, hd = split(host[:E])
    emap = ExpertMap(loc.to(dev), hg, hd, *(t.to(dev) for t in split(host[E])))
    for weights, mapped in ((split(host.to(dev)), None), (split(slots), emap)):
        ys = []
        for blocks in (pair_blocks(ids), group_blocks(ids)):
            y = torch.full((N, K + 1, H), float("nan"), device=dev)
            run_experts(x, *weights, ids, w, blocks, out=(torch.empty(N * (K + 1), I, device=dev), y), mapped=mapped)
            ys.append(y.cpu())
        if dev == "cuda":
            assert torch.equal(ys[0].nan_to_num(7.0), ys[1].nan_to_num(7.0)), (seed, mapped is not None)
        else:  # the interpreter's dots are numpy's, whose float32 sums may round a row apart by its block's rows
            torch.testing.assert_close(ys[1], ys[0], rtol=0, atol=4e-7, equal_nan=True,
                                       msg=f"seed {seed}, mapped {mapped is not None}")
        ran = (ids >= 0) & ((ids != 2) if mapped is not None else True)
        assert not ys[1][ran.cpu()].isnan().any() and ys[1][~ran.cpu()].isnan().all(), seed
    with pytest.raises(ValueError, match="at most"):
        group_blocks(torch.zeros(PAIR_ROWS + 1, K, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("shared", [True, False])
def test_routed_experts_equal_top_k_then_experts(dev, shared):
    """The decode MoE that routes inside its gate/up kernel: the same ids and weights as route_topk, the
    same rows as run_experts on them, padding rows untouched."""
    dtype = torch.float32
    g = torch.Generator().manual_seed(21 + shared)
    N, E, K, H, I = 4, 12, 3, 40, 24
    kp = K + shared
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev, dtype)
    gate_up = (torch.randn(E + shared, 2 * I, H, generator=g) * 0.2).to(dev, dtype)
    down = (torch.randn(E + shared, H, I, generator=g) * 0.2).to(dev, dtype)
    logits = torch.randn(N, E + shared, generator=g).to(dev, dtype)
    valid = torch.tensor([1, 0, 1, 1], dtype=torch.int8, device=dev)
    ids = torch.full((N, kp), 99, dtype=torch.int32, device=dev)
    w = torch.full((N, kp), 9.0, device=dev)
    y = torch.full((N, kp, H), float("nan"), dtype=dtype, device=dev)
    act = torch.empty(N * kp, I, dtype=dtype, device=dev)
    run_experts_routed(x, gate_up, down, logits, K, True, shared, valid, ids, w, out=(act, y))
    ref_ids, ref_w = route_topk(logits, K, True, shared, valid)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    live = valid.bool().cpu()
    assert torch.equal(w.cpu()[live], ref_w.cpu()[live])
    ref = run_experts(x, gate_up, down, ref_ids, ref_w, pair_blocks(ref_ids))
    assert torch.equal(y.cpu()[live], ref.cpu()[live])
    assert torch.isnan(y.cpu()[~live]).all()  # padding rows route nowhere and are never written


@pytest.mark.parametrize("shared", [True, False])
def test_mapped_experts_read_slots_host_and_shared_as_stacked(dev, shared):
    """An expert cache's decode MoE: each expert read where its location entry says (a slot of the device
    buffer, in place from the host pool, the shared expert) computes what the same kernels compute on every
    expert stacked in one tensor, bit for bit; a location change is seen at the next launch."""
    g = torch.Generator().manual_seed(41 + shared)
    N, E, K, H, I, S = 3, 10, 3, 40, 24, 4
    numel = 3 * I * H
    host = (torch.randn(E, numel, generator=g) * 0.2)  # the layer's host pool [E, numel] (CPU memory)
    if dev == "cuda":
        host = host.pin_memory()
    shared_block = (torch.randn(numel, generator=g) * 0.2).to(dev)

    def split(buf):
        return buf[..., : 2 * I * H].unflatten(-1, (2 * I, H)), buf[..., 2 * I * H:].unflatten(-1, (H, I))

    stacked = torch.cat([host.to(dev), shared_block[None]]) if shared else host.to(dev)
    gu_all, dn_all = split(stacked)
    slots = torch.zeros(S, numel, device=dev)
    loc = torch.full((E + 1,), LOC_HOST, dtype=torch.int32)
    loc[E] = LOC_SHARED
    for s, e in enumerate((7, 0, 4)):  # three experts in slots (slot 3 holds nothing), the rest in place
        slots[s] = host[e].to(dev)
        loc[e] = s
    loc = loc.to(dev)
    sg, sd = split(shared_block) if shared else (None, None)
    hg, hd = split(host)
    emap = ExpertMap(loc, hg, hd, sg, sd)
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    logits = torch.randn(N, E + shared, generator=g).to(dev)
    valid = torch.ones(N, dtype=torch.int8, device=dev)
    kp = K + shared

    def both():
        outs = []
        for weights, m in (((gu_all, dn_all), None), (split(slots), emap)):
            ids = torch.empty(N, kp, dtype=torch.int32, device=dev)
            w = torch.empty(N, kp, device=dev)
            outs.append((run_experts_routed(x, *weights, logits, K, True, shared, valid, ids, w, mapped=m), ids))
        return outs

    (ref, ref_ids), (got, got_ids) = both()
    assert torch.equal(got_ids.cpu(), ref_ids.cpu()) and torch.equal(got.cpu(), ref.cpu())
    assert ((ref_ids >= 0) & (ref_ids < E)).any()
    emap.loc[ref_ids[0, 0]] = LOC_HOST if int(emap.loc[ref_ids[0, 0]]) >= 0 else 3  # move one expert
    slots[3] = host[int(ref_ids[0, 0])].to(dev)
    (ref, _), (got, _) = both()
    assert torch.equal(got.cpu(), ref.cpu())
    blocks = pair_blocks(ref_ids)
    ref_ids_routed = torch.where(ref_ids < E, ref_ids, -1)  # run_experts on the routed pairs, mapped too
    w = torch.rand(N, kp, generator=g).to(dev)
    live = ref_ids_routed.cpu() >= 0
    got = run_experts(x, *split(slots), ref_ids_routed, w, pair_blocks(ref_ids_routed), mapped=emap)
    assert torch.equal(got.cpu()[live], run_experts(x, gu_all, dn_all, ref_ids_routed, w, blocks).cpu()[live])
    with pytest.raises(ValueError, match="ExpertMap"):
        run_experts(x, *split(slots), ref_ids_routed, w, blocks, mapped=ExpertMap(loc.long(), hg, hd))


def test_experts_tiles_do_not_change_the_function(dev):
    g = torch.Generator().manual_seed(31)
    N, E, KP, H, I = 3, 5, 2, 64, 48
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dev)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dev)
    ids = torch.randint(0, E, (N, KP), generator=g).int().to(dev)
    w = torch.rand(N, KP, generator=g).to(dev)
    ref = run_experts_ref(x, gate_up, down, ids, w)
    for tiles in (((16, 32, 4, 2), (16, 16, 4, 2)), ((32, 64, 4, 3), (64, 32, 4, 3))):
        y = run_experts(x, gate_up, down, ids, w, pair_blocks(ids), tiles=tiles)
        assert rel_err(y.cpu(), ref.cpu()) < 3 * tol(torch.float32)


@pytest.mark.parametrize("routed", [True, False])
def test_mapped_decode_kernels_match_the_reference_in_any_down_tiling(dev, routed):
    """The decode kernels over an expert cache (mapped: experts in slots, read in place from the host, the
    shared one, and pairs the CPU runs, LOC_CPU, left alone) compute the reference's rows, whether the down
    kernel's K loop runs once (BK >= I) or in several tiles, routed in the gate/up kernel or before it."""
    g = torch.Generator().manual_seed(77 + routed)
    N, E, K, H, I, S = 3, 9, 3, 40, 40, 3
    numel = 3 * I * H
    host = torch.randn(E, numel, generator=g) * 0.2
    if dev == "cuda":
        host = host.pin_memory()
    shared_block = (torch.randn(numel, generator=g) * 0.2).to(dev)

    def split(buf):
        return buf[..., : 2 * I * H].unflatten(-1, (2 * I, H)), buf[..., 2 * I * H:].unflatten(-1, (H, I))

    slots = torch.zeros(S, numel, device=dev)
    loc = torch.full((E + 1,), LOC_HOST, dtype=torch.int32)
    loc[E] = LOC_SHARED
    for s, e in enumerate((2, 5)):
        slots[s] = host[e].to(dev)
        loc[e] = s
    loc[[0, 7]] = LOC_CPU  # the CPU's pairs: the kernels leave their rows alone
    emap = ExpertMap(loc.to(dev), *split(host), *split(shared_block))
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    logits = torch.randn(N, E + 1, generator=g).to(dev)
    valid = torch.tensor([1, 0, 1], dtype=torch.int8, device=dev)
    every = torch.cat([host.to(dev), shared_block[None]])  # expert E: the shared one, as the routing names it
    up = (16, 16, 4, 2)
    for down_tile in ((32, 64, 4, 1), (16, 16, 4, 2)):  # BK >= I: one pass of the K loop; BK < I: several
        y = torch.full((N, K + 1, H), float("nan"), device=dev)
        act = torch.empty(N * (K + 1), I, device=dev)
        ids = torch.empty(N, K + 1, dtype=torch.int32, device=dev)
        w = torch.empty(N, K + 1, device=dev)
        if routed:
            run_experts_routed(x, *split(slots), logits, K, True, True, valid, ids, w, out=(act, y),
                               tiles=(up, down_tile), mapped=emap)
        else:
            ids, w = route_topk(logits, K, True, True, valid)
            run_experts(x, *split(slots), ids, w, pair_blocks(ids), out=(act, y), tiles=(up, down_tile), mapped=emap)
        ran = torch.isin(ids, torch.tensor([0, 7], device=dev), invert=True) & (ids >= 0)
        assert ran.any() and (~ran & (ids >= 0)).any()  # both kinds of pair occur
        ref = run_experts_ref(x, *split(every), ids.clamp(min=0), w)
        assert rel_err(y[ran].cpu(), ref[ran].cpu()) < 3 * tol(torch.float32), down_tile
        assert torch.isnan(y[~ran]).all()


@pytest.mark.parametrize("grid", [None, (32, 3)])
def test_stage_guess_picks_the_likeliest_expert_read_in_place(dev, grid, monkeypatch):
    """The prefetch's pick (the valid rows' summed softmax, over the experts read in place only) and its copy
    of that expert's gate/up, against the reference, on fresh random inputs; -1 and nothing copied when every
    expert sits in a slot. grid (elements a load, most programs): the copy in a few programs of several loads
    each, the last ones partly or wholly past the staged rows (these shapes fit one load of the default's)."""
    if grid is not None:
        from engine.kernels import stage_triton

        monkeypatch.setattr(stage_triton, "STAGE_BLOCK", grid[0])
        monkeypatch.setattr(stage_triton, "STAGE_PROGRAMS", grid[1])
        assert stage_triton.stage_grid(8, 24) == (3, 4) and stage_triton.stage_grid(8, 24, 3) == (3, 2)
    g = torch.Generator().manual_seed(5)
    N, E, I, H = 3, 16, 8, 24
    for trial in range(6):
        logits = torch.randn(N, E, generator=g).to(torch.bfloat16)
        valid = torch.tensor([1, trial % 2, 1], dtype=torch.int8)
        loc = torch.full((E + 1,), LOC_HOST, dtype=torch.int32)
        loc[E] = LOC_SHARED
        loc[torch.randperm(E, generator=g)[:6]] = torch.arange(6, dtype=torch.int32)
        loc[torch.randperm(E, generator=g)[:2]] = LOC_CPU  # the CPU's experts are not prefetched either
        if trial == 5:
            loc[:E] = torch.arange(E, dtype=torch.int32)
        host = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
        want, weights = stage_guess_ref(logits, valid, loc, host)
        if dev == "cuda":
            host = host.pin_memory()
        sid = torch.full((1,), -7, dtype=torch.int32, device=dev)
        buf = torch.zeros(2 * I, H, dtype=torch.bfloat16, device=dev)
        rows = (None, 3, I)[trial % 3]  # all rows, or the first R of the gate and of the up projection
        done = torch.full((1,), 99, dtype=torch.int32, device=dev)  # the pick sets it back to 0 first
        order = []
        stage_guess(logits.to(dev), valid.to(dev), loc.to(dev), host, sid, buf, rows, done,
                    picked=lambda: order.append((int(sid), int(done))))
        assert order == [(want, 0)]  # picked() runs after the pick, before the copy
        assert int(sid) == want
        assert int(done) == stage_programs(I, H, rows)  # every copy program counted itself done
        expect = torch.zeros(2 * I, H, dtype=torch.bfloat16)
        if weights is not None:
            r = rows or I
            expect[:r], expect[I: I + r] = weights[:r], weights[I: I + r]
        assert torch.equal(buf.cpu(), expect)


def _host_experts(g, E: int, H: int, I: int, dev: str):
    """E random expert blocks [E, 3IH] in host memory (page-locked on CUDA: the kernels read them in place) and
    the split of any such blocks into their gate/up [.., 2I, H] and down [.., H, I] views."""
    host = torch.randn(E, 3 * I * H, generator=g) * 0.2
    if dev == "cuda":
        host = host.pin_memory()

    def split(buf):
        return buf[..., : 2 * I * H].unflatten(-1, (2 * I, H)), buf[..., 2 * I * H:].unflatten(-1, (H, I))
    return host, split


def test_the_gate_up_kernel_reads_a_staged_expert_from_its_device_copy(dev):
    """A staged expert's pairs take its gate/up from the stage buffer, the others from slots and the host: with
    the true weights staged the rows equal the unstaged kernels', with other weights staged only that expert's
    pairs change, and as the reference computes them with those weights."""
    g = torch.Generator().manual_seed(9)
    N, E, K, H, I = 4, 8, 3, 32, 16
    numel = 3 * I * H
    host, split = _host_experts(g, E, H, I, dev)
    slots = torch.zeros(2, numel, device=dev)
    loc = torch.full((E,), LOC_HOST, dtype=torch.int32)
    slots[0], loc[3] = host[3].to(dev), 0
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    logits = torch.randn(N, E, generator=g).to(dev)
    valid = torch.ones(N, dtype=torch.int8, device=dev)

    def run(emap, tiles=None):
        ids = torch.empty(N, K, dtype=torch.int32, device=dev)
        w = torch.empty(N, K, device=dev)
        y = run_experts_routed(x, *split(slots), logits, K, True, False, valid, ids, w, mapped=emap, tiles=tiles)
        return y, ids, w

    plain, ids, w = run(ExpertMap(loc.to(dev), *split(host)))
    staged = int(ids[0, 0])  # an expert the first token routes to
    assert loc[staged] == LOC_HOST
    sid = torch.tensor([staged], dtype=torch.int32, device=dev)
    true_copy = split(host)[0][staged].to(dev).contiguous()
    same, _, _ = run(ExpertMap(loc.to(dev), *split(host), stage_id=sid, stage_gate_up=true_copy))
    assert torch.equal(same, plain)
    other = (torch.randn(2 * I, H, generator=g) * 0.2).to(dev)
    changed, _, _ = run(ExpertMap(loc.to(dev), *split(host), stage_id=sid, stage_gate_up=other))
    hit = ids == staged
    assert torch.equal(changed[~hit], plain[~hit]) and not torch.equal(changed[hit], plain[hit])
    every = host.to(dev).clone()
    every[staged, : 2 * I * H] = other.reshape(-1)
    ref = run_experts_ref(x, *split(every), ids, w)
    assert rel_err(changed.cpu(), ref.cpu()) < 3 * tol(torch.float32)
    # only the first 8 of 16 rows staged, in 8-row tiles: the other tiles still read the expert over PCIe
    tiles = ((8, 16, 4, 2), (16, 16, 4, 2))
    half, _, _ = run(ExpertMap(loc.to(dev), *split(host), stage_id=sid, stage_gate_up=other, stage_rows=8), tiles)
    mixed = host.to(dev).clone()
    gu = mixed[staged, : 2 * I * H].view(2 * I, H)
    gu[:8], gu[I: I + 8] = other[:8], other[I: I + 8]
    ref = run_experts_ref(x, *split(mixed), ids, w)
    assert rel_err(half.cpu(), ref.cpu()) < 3 * tol(torch.float32)
    assert not torch.equal(half[hit], changed[hit]) and not torch.equal(half[hit], plain[hit])


def test_a_staged_tile_reads_the_stage_only_once_the_copy_counted_itself_done(dev, monkeypatch):
    """With the copy's done count given (the engine's case: the layer's kernels do not wait for the copy), a
    staged tile reads the stage once the count reaches the copy's programs, and the host's rows when it never
    does within its polls (a late copy costs time, never a wrong row): with other weights staged, the first
    gives the staged weights' rows, the second the plain kernels' rows exactly."""
    from engine.kernels import moe_triton

    monkeypatch.setattr(moe_triton, "STAGE_SPIN", 3)  # few polls: the interpreter runs them one by one
    g = torch.Generator().manual_seed(13)
    N, E, K, H, I = 3, 8, 2, 32, 16
    host, split = _host_experts(g, E, H, I, dev)
    slots = torch.zeros(1, 3 * I * H, device=dev)
    loc = torch.full((E,), LOC_HOST, dtype=torch.int32, device=dev)
    x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
    logits = torch.randn(N, E, generator=g).to(dev)
    valid = torch.ones(N, dtype=torch.int8, device=dev)

    def run(emap):
        ids = torch.empty(N, K, dtype=torch.int32, device=dev)
        w = torch.empty(N, K, device=dev)
        return run_experts_routed(x, *split(slots), logits, K, True, False, valid, ids, w, mapped=emap), ids

    plain, ids = run(ExpertMap(loc, *split(host)))
    staged = int(ids[0, 0])
    sid = torch.tensor([staged], dtype=torch.int32, device=dev)
    other = (torch.randn(2 * I, H, generator=g) * 0.2).to(dev)
    programs = stage_programs(I, H)
    for count, lands in ((programs, True), (programs - 1, False), (0, False)):
        done = torch.tensor([count], dtype=torch.int32, device=dev)
        y, _ = run(ExpertMap(loc, *split(host), stage_id=sid, stage_gate_up=other, stage_done=done))
        hit = ids == staged
        assert torch.equal(y[~hit], plain[~hit])
        assert torch.equal(y[hit], plain[hit]) != lands, count
