"""`python -m engine.bench.mapped`: can the expert kernels read missing experts straight from the pinned host
pool (zero-copy over PCIe, no fill), and how fast, against copying them first (CUDA only).

In one process, on expert blocks of a model's widths drawn into a page-locked host buffer (allocated and
registered the way engine/experts/host_pool.py makes the pool: transparent huge pages unless --no-hugepages):
- B_P: host -> device copies of those blocks, one copy per block (what a fill does), and one copy for all;
- read: a Triton kernel summing the host buffer in place (the zero-copy read rate with nothing else to do),
  and read_tiles: the same in the expert kernels' pattern (bands of rows, a tile of columns a step);
- experts: one decode token's `experts` routed experts through the grouped expert kernels, weights read
  from the host buffer in place, against the same kernels on a device copy (HBM) and against copy-then-run;
- both at once: zero-copy expert reads while a copy stream fills other blocks (do they share PCIe?).
Prints a table and, with --json, the figures. Rates are bytes of expert weights / s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.experts.block_layout import ExpertLayout
from engine.experts.host_pool import anon_huge_kb, host_buffer
from engine.experts.synthetic import get_shape
from engine.kernels.launch import cdiv


def _register(buf: torch.Tensor, flags: int) -> bool:
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), flags)
    return int(err) == 0


def _time(fn, reps: int) -> float:
    """Median seconds of `reps` runs timed by CUDA events, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def run(args) -> dict:
    import triton
    import triton.language as tl

    from engine.kernels.moe_pairs_triton import pair_blocks
    from engine.kernels.moe_triton import run_experts

    @triton.jit
    def _sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = (pid * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr, tl.sum(acc, axis=0))

    @triton.jit
    def _tile_sum_kernel(x_ptr, out_ptr, H, BN: tl.constexpr, BK: tl.constexpr):
        """The expert gate/up kernel's read pattern without its math: a band of BN rows of H, BK columns a
        step (each step BN pieces of BK elements, H apart)."""
        rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(0, H, BK):
            acc += tl.load(x_ptr + rows[:, None] * H + k0 + tl.arange(0, BK)[None, :]).to(tl.float32)
        tl.atomic_add(out_ptr, tl.sum(tl.sum(acc, axis=1), axis=0))

    shape = get_shape(args.shape)
    lay = ExpertLayout(shape.hidden, shape.inter, 2)
    dtype = torch.bfloat16
    n = args.blocks
    before = anon_huge_kb()
    host = host_buffer((n, lay.numel), dtype, hugepages=args.hugepages)
    host.normal_(0, 0.02)
    res: dict = {"shape": args.shape, "expert_bytes": lay.nbytes, "blocks": n, "hugepages": args.hugepages,
                 "huge_mib": (anon_huge_kb() - before) / 1024,
                 "registered": _register(host, args.flags), "flags": args.flags}
    dev = torch.empty(n, lay.numel, dtype=dtype, device="cuda")
    nbytes = n * lay.nbytes

    def per_block():
        for i in range(n):
            dev[i].copy_(host[i], non_blocking=True)

    res["bp_per_block"] = nbytes / _time(per_block, args.reps)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    per_block()  # how long the host spends issuing them: near the copies' own time means it waits on them
    res["issue_s_per_block"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    res["wall_s_per_block"] = time.perf_counter() - t0
    res["bp_one_copy"] = nbytes / _time(lambda: dev.copy_(host, non_blocking=True), args.reps)

    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    numel = host.numel()
    for block, iters in ((4096, 16), (8192, 8), (2048, 64)):
        grid = cdiv(numel, block * iters)
        try:
            t = _time(lambda: _sum_kernel[(grid,)](host, out, numel, BLOCK=block, ITERS=iters, num_warps=8), args.reps)
            res[f"read_{block}x{iters}"] = nbytes / t
        except Exception as exc:  # noqa: BLE001 - the point of the probe is whether this works at all
            res[f"read_{block}x{iters}"] = f"failed: {exc}"
    rows = numel // lay.hidden
    for bn, bk in ((64, 128), (16, 512), (8, 2048)):
        try:
            t = _time(lambda: _tile_sum_kernel[(rows // bn,)](host, out, lay.hidden, BN=bn, BK=bk, num_warps=4,
                                                                num_stages=4), args.reps)
            res[f"read_tiles_{bn}x{bk}"] = rows // bn * bn * lay.hidden * 2 / t
        except Exception as exc:  # noqa: BLE001
            res[f"read_tiles_{bn}x{bk}"] = f"failed: {exc}"
    hbm = torch.empty_like(host, device="cuda").copy_(host)
    res["read_hbm"] = nbytes / _time(lambda: _sum_kernel[(cdiv(numel, 4096 * 16),)](
        hbm, out, numel, BLOCK=4096, ITERS=16, num_warps=8), args.reps)

    # one decode token's routed experts, weights read in place from the host blocks or a device copy
    k = args.experts
    gu = lay.gate_up_numel
    x = torch.randn(1, lay.hidden, dtype=dtype, device="cuda") * 0.1
    w = torch.full((1, k), 1.0 / k, dtype=torch.float32, device="cuda")
    rounds = n // k
    ids_sets = [torch.arange(r * k, (r + 1) * k, dtype=torch.int32, device="cuda")[None] for r in range(rounds)]

    def views(buf):
        return buf[:, :gu].view(n, 2 * lay.inter, lay.hidden), buf[:, gu:].view(n, lay.hidden, lay.inter)

    def experts_from(buf):
        return _rounds(x, *views(buf), w, ids_sets)

    ref = None
    for name, buf in (("experts_hbm", hbm), ("experts_host", host)):
        try:
            t = _time(experts_from(buf), args.reps)
            res[name] = rounds * k * lay.nbytes / t
            res[name + "_us_per_layer"] = t / rounds * 1e6
            g, d = views(buf)
            y = run_experts(x, g, d, ids_sets[0], w, pair_blocks(ids_sets[0]))
            if ref is None:
                ref = y
            else:
                res["host_equals_hbm"] = bool(torch.equal(y, ref))
        except Exception as exc:  # noqa: BLE001
            res[name] = f"failed: {exc}"
    g_dev, d_dev = views(dev)

    def copy_then_run():
        for ids in ids_sets:
            a = int(ids[0, 0])
            dev[a: a + k].copy_(host[a: a + k], non_blocking=True)
            run_experts(x, g_dev, d_dev, ids, w, pair_blocks(ids))
    res["copy_then_run"] = rounds * k * lay.nbytes / _time(copy_then_run, args.reps)

    if isinstance(res.get("experts_host"), float) and args.sweep:
        res["tiles_host"] = _sweep(x, *views(host), w, ids_sets, args.reps, k * lay.nbytes)
    if isinstance(res.get("experts_host"), float):
        side = torch.cuda.Stream()
        half = n // 2
        g, d = views(host)
        reads = [ids for ids in ids_sets if int(ids[0, -1]) < half]

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dev[half:].copy_(host[half:], non_blocking=True)
            for ids in reads:
                run_experts(x, g, d, ids, w, pair_blocks(ids))
            torch.cuda.current_stream().wait_stream(side)
        t = _time(both, args.reps)
        res["both_total"] = (len(reads) * k + (n - half)) * lay.nbytes / t
    return res


UP_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (16, 512, 4, 3), (32, 512, 8, 2),
            (128, 64, 4, 4), (16, 256, 4, 4)]
DOWN_TILES = [(64, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (16, 512, 4, 3), (128, 128, 8, 3), (32, 128, 4, 4),
              (64, 512, 8, 2)]


def _rounds(x, gate_up, down, w, ids_sets, tiles=None):
    """-> a function running one token's experts once per id set (every round other experts: nothing is read
    twice, nothing stays in L2)."""
    from engine.kernels.moe_pairs_triton import pair_blocks
    from engine.kernels.moe_triton import run_experts

    def fn():
        for ids in ids_sets:
            run_experts(x, gate_up, down, ids, w, pair_blocks(ids), tiles=tiles)
    return fn


def _sweep(x, gate_up, down, w, ids_sets, reps: int, layer_bytes: int) -> list[dict]:
    """The gate/up kernel's tiles (down at its default), then the down kernel's (gate/up at the best): one
    token's experts read in place from the host, GB/s of weights for the whole layer."""
    def rate(tiles) -> float:
        return len(ids_sets) * layer_bytes / _time(_rounds(x, gate_up, down, w, ids_sets, tiles), reps)

    rows = [{"up": up, "down": DOWN_TILES[0], "gbs": rate((up, DOWN_TILES[0])) / 1e9} for up in UP_TILES]
    best_up = max(rows, key=lambda r: r["gbs"])["up"]
    rows += [{"up": best_up, "down": dn, "gbs": rate((best_up, dn)) / 1e9} for dn in DOWN_TILES[1:]]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.mapped", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.6-35b-a3b", help="expert widths of this model (engine.experts.synthetic)")
    ap.add_argument("--blocks", type=int, default=64, help="expert blocks in the host buffer (default 64)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts of one token (default 8)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--flags", type=int, default=3, help="cudaHostRegister flags (1 portable, 2 mapped; default 3)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the expert kernels' tiles on host reads")
    ap.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=True,
                    help="the host buffer in transparent huge pages, as the pool allocates it (default); "
                         "--no-hugepages: 4 KB pages (0.75 of B_P against 0.93 for the expert kernels, H200)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench mapped needs CUDA", file=sys.stderr)
        return 2
    res = run(args)
    for row in res.get("tiles_host", []):
        print(f"tiles up {row['up']} down {row['down']}: {row['gbs']:.1f} GB/s")
    for key, val in res.items():
        if key == "tiles_host":
            continue
        rate = isinstance(val, float) and key.startswith(("bp", "read", "experts_h", "copy", "both")) \
            and not key.endswith("layer")
        print(f"{key:24s} {val / 1e9:8.1f} GB/s" if rate else f"{key:24s} {val}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
