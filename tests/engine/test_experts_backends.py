"""Every slot backend equals a per-token reference for every slot count; bookkeeping stays consistent."""
import numpy as np
import pytest
import torch

from engine.experts import cpu_jobs, cpu_runner
from engine.experts.block_layout import ExpertLayout
from engine.experts.compute import Routing, expert_mlp
from engine.experts.cpu import CpuBackend
from engine.experts.host_pool import pool_from_source
from engine.experts.hybrid import HybridBackend
from engine.experts.lru import prompt_use_weights
from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate
from engine.experts.prefill_stream import routed_fills
from engine.experts.source import ExpertWeights

L_IDS, E, H, I, K = [0, 2, 3], 8, 16, 12, 3  # MoE layers 0, 2, 3 (layer 1 dense)


def make_source(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate_up = {l: (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype) for l in L_IDS}  # [E, 2I, H]
    down = {l: (torch.randn(E, H, I, generator=g) * 0.3).to(dtype) for l in L_IDS}  # [E, H, I]
    return ExpertWeights(gate_up, down)


def reference(src, layer, x, ids, w):
    """Every expert on every token, masked by the routing weights."""
    out = torch.zeros_like(x)
    for e in range(E):
        we = (w * (ids == e)).sum(1, keepdim=True)  # [T, 1]
        out += we * expert_mlp(x, src.gate_up(layer, e), src.down(layer, e))
    return out


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return torch.randn(T, H, generator=g), ids, w


@pytest.fixture(scope="module")
def src():
    return make_source()


@pytest.fixture(scope="module")
def pool(src):
    return pool_from_source(src)


def check_table(backend):
    t = backend.cache.table
    for s, o in enumerate(t.owner):
        if o >= 0:
            assert t.resident[o // E, o % E] == s
    assert (np.bincount(t.resident[t.resident >= 0], minlength=t.num_slots) <= 1).all()
    assert not t.locked.any() or backend.streamer.active


@pytest.mark.parametrize("cls", [OffloadBackend, CpuBackend, HybridBackend])
@pytest.mark.parametrize("slots", [1, 3, 2 * E, len(L_IDS) * E])
def test_backend_matches_reference(src, pool, cls, slots):
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)  # hybrid fills a third of the misses (q_balanced)
    # offload streams every prompt (whole layers whenever two buffers fit); the others choose (auto)
    b = cls(pool, slots, "cpu", estimate=est, stream_prefill="on" if cls is OffloadBackend else "auto")
    streamed = False
    for step, T in enumerate([5, 1, 1, 7, 1, 40, 1]):
        b.begin_forward(T, K)
        streamed |= b.streamer.active
        for layer in L_IDS:
            x, ids, w = routing(T, seed=step * 10 + layer)
            got = b.forward(layer, x, ids, w)
            torch.testing.assert_close(got, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
            check_table(b)
    if cls is OffloadBackend:  # a 40-token extend streams whole layers when 2 buffers fit
        assert streamed == (slots >= 2 * E)
    tot = b.stats()["total"]
    assert tot["hits"] + tot["misses"] > 0
    if cls is CpuBackend:
        assert tot["cpu_runs"] == tot["misses"]
    if cls is OffloadBackend:
        assert tot["cpu_runs"] == 0 and tot["fills"] >= tot["misses"]
    if cls is HybridBackend:  # both paths get work
        assert tot["fills"] > 0 and tot["cpu_runs"] > 0 and b.stats()["split"]["arms"]["split"] > 0
    b.close()


def test_hybrid_measurements_reach_the_policy_tagged_as_issued(pool):
    """A fill's timing is read at a later layer call (on CUDA once its event completed, here every other
    call): it reaches the split policy marked with whether CPU runs went alongside when it was issued."""
    b = HybridBackend(pool, 3, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, min_bytes=0))
    chosen, copies, issued, seen = [], [], [], []  # choices; with_cpu of each admit that copied; observations
    admit, take, observe = b.cache.admit, b.cache.take_fill_timings, b.policy.observe

    def cycle(m, busy=0, cpu_extra=0.0, per=1.0):  # every choice in turn, whatever the measured rates say
        options = b.policy.options(m, busy, cpu_extra, per) if m else [b.policy.best(m)]
        chosen.append(options[len(chosen) % len(options)])
        return chosen[-1]

    def spy_admit(*args, **kw):
        slots = admit(*args, **kw)
        if slots:
            copies.append(kw["with_cpu"])
            issued.append(kw["with_cpu"] == (chosen[-1].arm == "split"))  # CPU runs alongside: a split
        return slots

    def spy_observe(path, nbytes, seconds, together, per=1.0):
        seen.append((path, together, copies[-1] if copies else None, chosen[-1].arm))
        observe(path, nbytes, seconds, together, per)

    b.policy.choose, b.cache.admit, b.policy.observe = cycle, spy_admit, spy_observe
    b.cache.take_fill_timings = lambda: take() if len(chosen) % 2 else []
    for step in range(20):
        for layer in L_IDS:
            b.forward(layer, *routing(4, seed=300 + 10 * step + layer))
    b.close()
    assert {arm for _, _, _, arm in seen} >= {"split", "fill", "cpu"} and all(issued)
    fills = [(together, copy) for path, together, copy, _ in seen if path == "fill"]
    assert fills and all(together == copy for together, copy in fills)  # the tag of the latest copy
    assert {together for together, _ in fills} == {True, False}
    cpu = [(together, arm) for path, together, _, arm in seen if path == "cpu"]
    assert all(together == (arm == "split") for together, arm in cpu)  # measured in the call that chose
    assert all(arm != "fill" for _, arm in cpu)


def test_the_split_counts_copies_still_in_flight_as_busy(pool):
    """A layer call's fills queue behind the copies the copy stream is still moving: the split gets them as
    busy, in experts, estimated at the rate the split policy measured for fills beside the CPU."""
    b = HybridBackend(pool, 3, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, min_bytes=0))
    rates, calls = [], []
    b.cache.copy_backlog = lambda rate: rates.append(rate) or 5.4 * pool.expert_bytes
    split = b.split
    b.split = lambda m, busy=0, per=1.0: calls.append((m, busy)) or split(m, busy, per)
    b.forward(L_IDS[0], *routing(6, seed=11))
    b.close()
    assert calls and all(busy == 5 for m, busy in calls if m) and rates == [b.policy.fill_rate()] * len(rates)


def test_copies_ahead_leave_the_cpu_more_behind_copies_in_flight(pool):
    """The next layer's copies ahead queue behind the copies in flight too: hybrid copies fewer of its misses
    ahead the longer that queue, down to none; a routed prompt's plan passes the queue it measured."""
    b = HybridBackend(pool, 3, "cpu", estimate=BandwidthEstimate(bp=50e9, bh=50e9, frozen=True),
                      stream_prefill="off", lookahead="on")
    counts = [b.ahead_fills(200.0, 1000, behind=n) for n in (0, 50, 100, 400)]
    assert counts[0] == 100 and counts == sorted(counts, reverse=True) and counts[-1] == 0
    seen = []
    fills = b.ahead_fills
    b.ahead_fills = lambda expected, likely, per=1.0, behind=0: seen.append(behind) or fills(expected, likely, per,
                                                                                             behind)
    b.cache.copy_backlog = lambda rate: 7 * pool.expert_bytes
    b.call_log = []
    x, ids, w = routing(40, seed=5)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    b.end_forward()
    b.close()
    assert seen and set(seen) == {7}
    assert b.call_log and {c.behind for c in b.call_log} == {7}  # the layer-call log shows what the plan counted


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
@pytest.mark.parametrize("slots", [3, 2 * E, len(L_IDS) * E])
def test_grouped_device_experts_match_one_at_a_time(pool, cls, slots):
    """The grouped Triton kernels reading the slots in place (the CUDA default; here under Triton's
    interpreter) against one expert at a time through torch, on fresh routing: same outputs to fp32 rounding,
    the same experts counted, every miss served. With 3 slots a 40-token step fills in rounds and takes the torch
    path. (Hits may differ: a wholly resident layer's grouped call counts its experts' use only at the forward's
    end, settle(), so a later layer's fills in the same forward may evict other slots than the torch path's.)"""
    pytest.importorskip("triton")
    est = dict(estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True))
    grouped, single = cls(pool, slots, "cpu", grouped=True, **est), cls(pool, slots, "cpu", grouped=False, **est)
    seed = int(torch.randint(1 << 30, ()))
    for step, T in enumerate([5, 1, 1, 7, 1, 40, 1]):
        for b in (grouped, single):
            b.begin_forward(T, K)
        for layer in L_IDS:
            x, ids, w = routing(T, seed=seed + step * 10 + layer)
            torch.testing.assert_close(grouped.forward(layer, x, ids, w), single.forward(layer, x, ids, w),
                                       rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    for b in (grouped, single):
        b.settle()
        check_table(b)
    got, want = grouped.stats()["total"], single.stats()["total"]
    assert got["hits"] + got["misses"] == want["hits"] + want["misses"]
    for tot in (got, want):
        assert tot["fills"] + tot["cpu_runs"] >= tot["misses"] > 0
    for b in (grouped, single):
        b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, CpuBackend, HybridBackend])
@pytest.mark.parametrize("grouped", [False, True])
def test_pairs_routed_to_no_expert_read_zero_and_never_reach_the_cache(pool, src, cls, grouped):
    """Padding rows route to id -1 (route_topk's valid flag; a graph's warm-up runs such rows): no expert
    runs for them, their outputs are zero, the cache neither counts nor fills an expert for them (-1 used to
    index the last expert); also in a streamed layer (40 tokens), which looks the slots up on the device."""
    if grouped:
        pytest.importorskip("triton")
    if cls is CpuBackend and grouped:
        pytest.skip("the cpu backend runs no device experts")
    kw = {} if cls is CpuBackend else dict(grouped=grouped)
    b = cls(pool, 2 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), **kw)
    seed = int(torch.randint(1 << 30, ()))
    for step, T in enumerate([4, 1, 40, 6, 1]):
        b.begin_forward(T, K)
        for layer in L_IDS:
            x, ids, w = routing(T, seed=seed + step * 10 + layer)
            ids[0] = -1  # a whole padding row
            if T > 1:
                ids[1, 0] = -1  # and one lone pair
            before = dict(b.stats()["total"])
            got = b.forward(layer, x, ids, w)
            torch.testing.assert_close(got, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5,
                                       msg=f"seed {seed}")
            assert torch.count_nonzero(got[0]) == 0
            b.settle()  # a streamed layer is counted after its forward
            now = b.stats()["total"]
            assert now["hits"] + now["misses"] - before["hits"] - before["misses"] == len(ids[ids >= 0].unique())
            check_table(b)
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_bit_identical(dtype, monkeypatch):
    """With one expert implementation on both sides, where an expert runs changes no bit of the output."""
    monkeypatch.setattr(cpu_jobs, "run_on_cpu", cpu_runner._torch_run_on_cpu)
    pool = pool_from_source(make_source(dtype=dtype))
    outs = []
    for cls, slots in [(OffloadBackend, 2), (CpuBackend, 5), (HybridBackend, 17), (OffloadBackend, 24)]:
        b = cls(pool, slots, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=3e9, frozen=True))
        res = []
        for step in range(4):
            b.begin_forward(4, K)
            for layer in L_IDS:
                x, ids, w = routing(4, seed=100 + step * 7 + layer)
                res.append(b.forward(layer, x.to(dtype), ids, w.to(dtype)))
        outs.append(torch.stack(res))
        b.close()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_a_job_as_flat_pairs_runs_as_its_per_expert_jobs(pool):
    """Routing.pairs (a prompt's CPU job as two flat arrays) against [(positions, expert)] built one expert at a
    time, on fresh routing with padding pairs and a random subset of the experts: the same positions and outputs
    on the runner the engine uses and on the torch reference; Pairs.jobs gives the per-expert form back."""
    T = 9
    x, ids, _ = routing(T, seed=int(torch.randint(1 << 30, ())))
    ids[0, 1] = -1  # a padding pair: never an expert's
    r = Routing.of(ids)
    pick = sorted(np.random.default_rng().choice(len(r.experts), size=len(r.experts) // 2 + 1, replace=False))
    pairs = cpu_runner.Pairs(*r.pairs(pick))
    jobs = [(r.position(i), r.experts[i]) for i in pick]
    assert [(p.tolist(), e) for p, e in pairs.jobs()] == [(p.tolist(), e) for p, e in jobs]
    host = pool.wait_layer(0)
    for run in (cpu_runner.run_on_cpu, cpu_runner._torch_run_on_cpu):
        (pos_p, y_p), (pos_j, y_j) = run(x, host, pairs, pool.layout, K), run(x, host, jobs, pool.layout, K)
        assert torch.equal(pos_p, pos_j) and torch.equal(y_p, y_j)
    empty = cpu_runner.Pairs(*r.pairs([]))
    assert len(cpu_runner.run_on_cpu(x, host, empty, pool.layout, K)[0]) == 0


@pytest.mark.skipif(not cpu_runner.NATIVE, reason="native CPU kernels not built")
def test_native_cpu_runner_matches_torch(pool):
    x, ids, _ = routing(6, seed=5)
    host = pool.wait_layer(2)
    jobs = [(torch.nonzero(ids.reshape(-1) == e).flatten(), e) for e in range(E)]
    pos_t, y_t = cpu_runner._torch_run_on_cpu(x, host, jobs, pool.layout, K)
    table = cpu_runner.layer_table(host, pool.layout)
    for tab in (table, None):  # the table kept with the layer, or one built for the call
        pos_n, y_n = cpu_runner.run_on_cpu(x, host, jobs, pool.layout, K, tab)
        assert torch.equal(pos_n, pos_t)
        torch.testing.assert_close(y_n, y_t, rtol=1e-5, atol=1e-5)
    for run in (cpu_runner.run_on_cpu, cpu_runner._torch_run_on_cpu):  # into a caller's (page-locked) buffer
        buf = torch.full((len(pos_t) + 5, H), float("nan"))
        pos_b, y_b = run(x, host, jobs, pool.layout, K, table, out=buf)
        assert torch.equal(pos_b, pos_t) and y_b.data_ptr() == buf.data_ptr() and len(y_b) == len(pos_t)
        torch.testing.assert_close(y_b, y_t, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_runner.NATIVE, reason="native CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,layout", [(1, "contiguous"), (1, "strided"), (9, "contiguous"), (9, "strided")])
def test_native_engine_path_matches_the_torch_reference_on_fresh_inputs(dtype, T, layout):
    """run_on_cpu's one native call (gather, kernels, conversion) against the slow torch path: decode steps
    (one position an expert) and extends (several), x contiguous or not, in the pool's dtype; fresh random
    values each run. An fp16 x (no native format) goes through f32 and matches too."""
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    src = pool_from_source(make_source(seed, dtype))
    host = src.wait_layer(0)
    table = cpu_runner.layer_table(host, src.layout)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    x = torch.randn(T, 2 * H if layout == "strided" else H, generator=g).to(dtype)
    x = x[:, ::2] if layout == "strided" else x  # [T, H]
    jobs = [(torch.nonzero(ids.reshape(-1) == e).flatten(), e) for e in torch.randperm(E, generator=g).tolist()]
    jobs = [j for j in jobs if len(j[0])]
    pos_t, y_t = cpu_runner._torch_run_on_cpu(x, host, jobs, src.layout, K)
    pos_n, y_n = cpu_runner.run_on_cpu(x, host, jobs, src.layout, K, table)
    assert torch.equal(pos_n, pos_t) and y_n.dtype == y_t.dtype == dtype and y_n.shape == y_t.shape, seed
    # Judged against the same inputs in float64, with a tolerance on the output's scale: the torch path
    # rounds its intermediates to bf16 (up to ~1.2% of max|y| off in a 400-seed sweep), the native one
    # keeps them in f32 (~0.6%); an elementwise rtol on small outputs flakes, a wrong expert is off by ~100%.
    _, ref = cpu_runner._torch_run_on_cpu(x.double(), host.double(), jobs, src.layout, K)  # [N, H]
    scale = ref.abs().max().item()

    def close(y, rel):
        err = (y.double() - ref).abs().max().item()
        assert err <= rel * scale, f"seed {seed}: max error {err:.3g} > {rel} x max|y| {scale:.3g}"

    close(y_n, 1e-5 if dtype == torch.float32 else 1.5e-2)
    close(y_t, 1e-5 if dtype == torch.float32 else 3e-2)
    pos_h, y_h = cpu_runner.run_on_cpu(x.half(), host, jobs, src.layout, K, table)
    assert torch.equal(pos_h, pos_t) and y_h.dtype == torch.float16
    close(y_h, 4e-3 if dtype == torch.float32 else 1.5e-2)  # x and y rounded to fp16 on the way


@pytest.mark.parametrize("slots,resident", [(2 * E, [0, E, E]), (3 * E, [E, E, E])])
def test_long_prefill_double_buffers_whole_layers(pool, slots, resident):
    """Layer l+1 streams into the LRU slots while l runs: with 2E slots two buffers alternate, with room
    to spare the streamed layers stay resident for the decode that follows."""
    b = OffloadBackend(pool, slots, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True))
    x, ids, w = routing(40, seed=1)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    assert b.streamer.active
    assert [b.cache.resident_count(layer) for layer in L_IDS] == resident
    st = b.stats()
    assert all(st["layers"][layer]["fills"] == E and st["layers"][layer]["misses"] == 0 for layer in L_IDS)
    b.close()


def test_the_next_layer_streams_from_the_first_piece_of_this_one(pool):
    """A layer-major prompt runs each layer in pieces: the first layer's copy is issued when the forward begins,
    the next layer's when this layer starts
    (behind this layer's own copy; issued after its last piece it waited for the pieces' host round trips,
    and copies and compute added up), into a window this layer does not use, and every piece's output is as
    if it ran alone. Grouped (the CUDA path, here under Triton's interpreter): a streamed layer's pieces look
    their slots up on the device, so nothing but the streamer waits for copies."""
    pytest.importorskip("triton")
    b = OffloadBackend(pool, 2 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), grouped=True)
    events, prefetch = [], b.streamer._prefetch

    def traced(layer, after=None):
        events.append(("copy", layer))
        slots = prefetch(layer, after)
        events.append(("window", sorted(slots) == list(range(min(slots), min(slots) + E))))
        return slots

    b.streamer._prefetch = traced
    ready = b.cache.ready
    b.cache.ready = lambda: events.append(("ready",)) or ready()
    x, ids, w = routing(40, seed=2)
    b.begin_forward(40, K, hold=True)
    for layer in L_IDS:
        for a, z in ((0, 24), (24, 40)):
            events.append(("piece", layer))
            y = b.forward(layer, x[a:z], ids[a:z], w[a:z])
            src = b.pool
            ref = torch.zeros_like(y)
            for t in range(z - a):
                for k in range(K):
                    e = int(ids[a + t, k])
                    ref[t] += w[a + t, k] * expert_mlp(x[a + t], *src.weights(layer, e))
            assert torch.allclose(y, ref, atol=1e-5)
    b.end_forward()
    assert b.streamer.streamed_forwards == 1
    ok, ready = ("window", True), ("ready",)
    # the compute waits for a layer's copy once, before the next layer's is issued: a later piece waiting
    # again would wait for the next layer's copy too (the compute stream waits for the whole copy stream)
    # the first layer's copy goes at begin_forward, before its first piece's mixer
    assert events == [("copy", 0), ok, ("piece", 0), ready, ("copy", 2), ok, ("piece", 0), ("piece", 2), ready,
                      ("copy", 3), ok, ("piece", 2), ("piece", 3), ready, ("piece", 3)]
    b.close()


@pytest.mark.parametrize("stream", ["on", "off"])
def test_a_prompt_leaves_its_popular_experts_the_hottest(pool, stream):
    """A prompt's layer call weighs each expert by the tokens routed to it (streamed or not): after a skewed
    prompt the experts it used most are the hottest, and the decode history before it has faded by its length.
    Counted one use per distinct expert, a long prompt left every expert it touched equally hot."""
    b = OffloadBackend(pool, 2 * E, "cpu", stream_prefill=stream, slot_policy="lfu")
    t = b.cache.table
    b.begin_forward(1, K)  # a decode token routed to experts 5, 6, 7
    for layer in L_IDS:
        x, _, w = routing(1, seed=layer)
        b.forward(layer, x, torch.tensor([[5, 6, 7]]), w)
    b.end_forward()
    T = 200
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.tensor([0, 1, 2]) if i % 4 else torch.randperm(E, generator=g)[:K] for i in range(T)])
    x, _, w = routing(T, seed=9)
    b.begin_forward(T, K, hold=True, span=T)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    b.end_forward()
    assert b.streamer is None or b.streamer.streamed_forwards == (stream == "on")
    for layer in L_IDS:
        heat = t.heat[pool.row[layer]] / t._inc
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=E)
        assert set(np.argsort(-heat)[:3]) == {0, 1, 2}
        want = prompt_use_weights(counts, T, half_life=t.half_life)
        # (up to the layer ticks after the call's own; 5-7 also carry the faded decode use)
        np.testing.assert_allclose(heat[:5], want[:5], rtol=5e-3)
        assert heat[5] - want[5] < 2.0 ** (-(T - 1) / t.half_life) * 1.01


def test_bad_streaming_and_prefetch_options_name_the_fix(pool):
    with pytest.raises(ValueError, match="--prefill-stream must be one of auto, on, off"):
        OffloadBackend(pool, 2 * E, "cpu", stream_prefill="always")
    for cls, decode in ((OffloadBackend, "host"), (CpuBackend, "auto")):
        with pytest.raises(ValueError, match="--moe-prefetch on works inside the mapped decode"):
            cls(pool, 2 * E, "cpu", decode=decode, prefetch=True)
    b = HybridBackend(pool, 2 * E, "cpu", decode="auto", prefetch=True)  # mapped by default: accepted
    assert b.prefetch and b.streamer.mode == "auto"
    b.close()
    with pytest.raises(ValueError, match="--moe-prefetch must be one of auto, on, off"):
        OffloadBackend(pool, 2 * E, "cpu", prefetch="always")
    with pytest.raises(ValueError, match="--moe-lookahead must be one of auto, on, off, got 'ahead'"):
        OffloadBackend(pool, 2 * E, "cpu", lookahead="ahead")
    with pytest.raises(ValueError, match="--moe-decode must be one of auto, mapped, host, got True"):
        OffloadBackend(pool, 2 * E, "cpu", decode=True)
    b = OffloadBackend(pool, 2 * E, "cpu", stream_prefill=False, lookahead=True, refresh=False)
    assert b.streamer is None and b.lookahead and not b.refresh_idle
    b.close()
    # auto (the default): on where a mapped decode overlaps PCIe (CUDA), never with a host decode, off on a CPU
    for cls, decode, device in ((OffloadBackend, "auto", "cpu"), (OffloadBackend, "host", "cuda"),
                                (CpuBackend, "auto", "cuda"), (HybridBackend, "mapped", "cuda")):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        b = cls(pool, 2 * E, device, decode=decode, prefetch="auto")
        assert b.prefetch == (device == "cuda" and decode != "host" and cls is not CpuBackend)
        b.close()


def _deep_pool(layers=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    src = ExpertWeights({l: torch.randn(E, 2 * I, H, generator=g) * 0.3 for l in range(layers)},
                        {l: torch.randn(E, H, I, generator=g) * 0.3 for l in range(layers)})
    return src, pool_from_source(src)


def _prompt(b, layers, T, seed):
    x, ids, w = routing(T, seed)
    b.begin_forward(T, K, hold=True, span=T)
    for layer in layers:
        b.forward(layer, x, ids, w)
    b.end_forward()


def test_a_streamed_prompt_keeps_its_first_layers_in_place_for_the_next():
    """With room for W >= 3 layers, the first W - 2 layers of a streamed prompt keep their windows: the next
    streamed prompt copies every layer but those, and its output is the reference's."""
    src, deep = _deep_pool()
    layers = list(range(6))
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="on", slot_policy="lfu")
    _prompt(b, layers, 40, seed=1)
    assert b.cache.lookup(0, range(E)).tolist() == list(range(2 * E, 3 * E))  # layer 0 in window 2
    # the stream's price counts what it will copy: nothing of layer 0, a few experts once some left its window
    assert b.cache.stream_copies(0, 2) == 0 and b.cache.stream_copies(1, 0) == E
    b.cache.table.release([2 * E + 3, 2 * E + 4])
    assert b.cache.stream_copies(0, 2) == 2
    before = b.stats()["total"]["bytes_moved"]
    x, ids, w = routing(40, seed=2)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in layers:
        y = b.forward(layer, x, ids, w)
        torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
    b.end_forward()
    assert b.stats()["total"]["bytes_moved"] - before == (5 * E + 2) * deep.expert_bytes
    check_table(b)
    b.close()


@pytest.mark.parametrize("layout", ["first and last two", "last three"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_routed_prompt_fills_into_the_slots_of_layers_it_has_run(layout, keep, monkeypatch):
    """A routed prompt's fills leave the residents of layers still to run alone while slots no hotter remain
    (OffloadBackend.keep_bonus): with the first layer and the last two resident, a prompt touching every
    expert fills only the three layers between; with the last three resident, the first layer's fills must
    take a later layer's residents. routed_fills predicts both; without the bonus the first layer's fills took
    residents either way. Outputs equal the reference's."""
    if not keep:
        monkeypatch.setattr(OffloadBackend, "keep_bonus", lambda self, layer: None)
    src, deep = _deep_pool()
    layers = list(range(6))
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="off", slot_policy="lfu")
    kept = [0, 4, 5] if layout == "first and last two" else [3, 4, 5]
    for layer in kept:
        b.cache.admit(layer, list(range(E)))
        b.cache.table.unlock_all()
    before = b.stats()["total"]
    x, ids, w = routing(40, seed=3)
    assert len(set(ids.reshape(-1).tolist())) == E  # every expert touched (the same routing in every layer)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in layers:
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
    b.end_forward()
    fills = b.stats()["total"]["fills"] - before["fills"]
    missing = [0 if layer in kept else E for layer in layers]
    model = routed_fills(missing, [E - m for m in missing], 3 * E)
    if keep:
        assert fills == model == (3 * E if layout == "first and last two" else 4 * E)
    else:
        assert fills > model
    check_table(b)
    b.close()


@pytest.mark.parametrize("done_heat,taken", [(1.0, 0), (1000.0, 2)])
def test_a_later_layers_resident_goes_first_only_against_a_far_hotter_slot(done_heat, taken):
    """keep_bonus: while layer 1 of a routed prompt fills, a resident of layer 2 (still to run) counts KEEP_RATIO x
    its heat at the forward's end; layer 0's slots (already run) count their heat. As hot as layer 2's, layer 0's
    slots go first; a thousand times hotter (a decode's popular experts), layer 2's go first."""
    src, deep = _deep_pool(layers=3)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu")
    t = b.cache.table
    for layer, heat in ((0, done_heat), (2, 1.0)):
        b.cache.admit(layer, list(range(E)))
        t.unlock_all()
        t.note_use(layer, np.arange(E), weights=np.full(E, heat))
    b.begin_forward(40, K, hold=True, span=40)
    victims = t.victims(E, bonus=b.keep_bonus(1))
    assert set((t.owner[victims] // E).tolist()) == {taken}
    b.end_forward()
    b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_a_routed_prompt_copies_the_next_layers_likely_misses_ahead(cls):
    """--moe-lookahead on: while a layer of a routed prompt runs, the next layer's likely misses are copied
    into slots no layer still to run holds (here the one free layer of slots, then the slots of the layers
    already run), so the layers between the resident first and last two find them in place. Outputs equal the
    reference's with and without it; the residents of the last two layers are never taken; every copy ahead is
    counted as a fill and as `ahead`, the ones the layer then read as `ahead_used`. The call log (profile_decode
    --extend) has each layer call's plan: its misses filled or run on the CPU (none in the wholly resident
    layers), the copies ahead as the stats count them."""
    src, deep = _deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    got = {}
    for look in ("off", "on"):
        b = cls(deep, 4 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead=look)
        b.call_log = []
        for layer in (0, 4, 5):
            b.cache.admit(layer, list(range(E)))
            b.cache.table.unlock_all()
        kept = {s: b.cache.table.owner[s] for s in range(4 * E) if b.cache.table.owner[s] // E in (4, 5)}
        x, ids, w = routing(40, seed=3)
        b.begin_forward(40, K, hold=True, span=40)
        for layer in range(6):
            y = b.forward(layer, x, ids, w)
            torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
            assert all(b.cache.table.owner[s] == o for s, o in kept.items())
        b.end_forward()
        got[look] = b.stats()["total"]
        calls = b.call_log
        assert [c.layer for c in calls] == list(range(6))
        routed = [c for c in calls if c.kind == "routed"]  # all (the unread path is the grouped kernels')
        assert len(routed) == 6 and [c.misses for c in calls if c.layer in (0, 4, 5)] == [0, 0, 0]
        assert all(c.fills + c.cpu == c.misses and 0 <= c.routed_ms <= c.end_ms for c in routed)
        assert sum(c.misses for c in routed) == got[look]["misses"]
        assert sum(c.cpu for c in routed) == got[look]["cpu_runs"]
        assert all((c.cpu_start_ms >= c.routed_ms) == (c.cpu > 0) for c in routed)
        assert sum(c.ahead for c in calls) == got[look]["ahead"]
        assert all(c.behind == 0 for c in calls)  # a CPU device copies in line: nothing is ever in flight
        check_table(b)
        b.close()
    off, on = got["off"], got["on"]
    assert off["ahead"] == 0
    assert on["ahead"] > 0 and on["ahead_used"] == on["ahead"]  # every expert is routed to: no wrong copy
    assert on["fills"] >= on["ahead"] and on["hits"] > off["hits"]
    if cls is OffloadBackend:  # every miss is filled either way; ahead of its layer they are hits there
        assert on["ahead"] == 3 * E and on["fills"] == off["fills"] == 3 * E and on["misses"] == 0
    else:  # the copies ahead take the fill share; the CPU runs the rest
        assert on["cpu_runs"] > 0 and on["misses"] + on["ahead"] == off["misses"]


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_a_wholly_resident_layer_runs_without_its_routing_and_the_next_layers_copies_take_its_slots(
        cls, monkeypatch):
    """Grouped (the CUDA path, here under Triton's interpreter): in a routed prompt a layer with every expert in a
    slot (layers 0, 4 and 5, as a streamed prompt leaves them, and any its copies ahead made so) never reads its
    routing back (the host queues the next layer meanwhile; it is counted at settle). Either path: the copies
    ahead of the next layer may take the running layer's slots, queued after its kernels: with every slot full,
    layer 1's likely misses are copied ahead during layer 0, where its locked hits left no room before. Outputs
    equal the reference's and one expert at a time's (the torch path, which reads every layer's routing back);
    hits, misses and ahead_used are counted as before."""
    pytest.importorskip("triton")
    from engine.experts import compute

    src, deep = _deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    read_back, of = [], compute.Routing.of
    monkeypatch.setattr(compute.Routing, "of", staticmethod(lambda ids: read_back.append(ids.shape) or of(ids)))
    seed = int(torch.randint(1 << 30, ()))
    got = {}
    for grouped in (True, False):
        b = cls(deep, 3 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead="on",
                grouped=grouped)
        b.call_log = []
        for layer in (0, 4, 5):
            b.cache.admit(layer, list(range(E)))
            b.cache.table.unlock_all()
        kept = {s: b.cache.table.owner[s] for s in range(3 * E) if b.cache.table.owner[s] // E in (4, 5)}
        x, ids, w = routing(40, seed=seed)  # 120 picks of 8 experts: every expert is routed to
        read_back.clear()
        b.begin_forward(40, K, hold=True, span=40)
        outs, resident = [], []
        for layer in range(6):
            resident.append(bool((b.cache.table.resident[layer] >= 0).all()))
            outs.append(b.forward(layer, x, ids, w))
            torch.testing.assert_close(outs[-1], reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5,
                                       msg=f"seed {seed}")
            assert all(b.cache.table.owner[s] == o for s, o in kept.items())  # later layers' residents stay
        b.end_forward()
        got[grouped] = outs
        st = b.stats()["layers"]
        for layer in (0, 4, 5):
            assert st[layer]["hits"] == E and st[layer]["misses"] == 0
        # layer 1's likely misses were copied ahead into layer 0's slots (no other slot was free)
        assert st[1]["ahead"] > 0 and st[1]["ahead_used"] == st[1]["ahead"]
        if grouped:  # (offload copies all of a layer's misses ahead, so every layer finds itself resident)
            assert resident[0] and resident[4] and resident[5]
            assert len(read_back) == resident.count(False)
            assert [c.kind == "unread" for c in b.call_log] == resident  # the call log says which ran unread
            assert b.call_log[0].ahead == st[1]["ahead"] and b.call_log[0].hits == -1
        else:
            assert len(read_back) == 6
        check_table(b)
        b.close()
    for a, z in zip(got[True], got[False]):
        torch.testing.assert_close(a, z, rtol=1e-5, atol=1e-5)


def test_the_cpus_handoff_moves_hybrids_copies_ahead_and_its_split_to_the_copy_engine(pool):
    """With copies ahead the copy engine works through a layer's handoff while the CPU waits: the longer the
    handoff (measured per routed prompt layer call, an EMA), the more of the next layer's misses hybrid copies
    ahead and the fewer of this layer's it runs on the CPU; a routed prompt with CPU work measures it."""
    est = BandwidthEstimate(bp=50e9, bh=50e9, frozen=True)
    b = HybridBackend(pool, 3, "cpu", estimate=est, stream_prefill="off", lookahead="on")
    ahead, fills = [], []
    for h in (0.0, 0.002, 0.004, 0.05):
        b.handoff_clock.seconds = h
        ahead.append(b.ahead_fills(200.0, 1000))
        # a layer whose copies ahead came (200 - ahead[-1] misses left) copying the next one's: all on the CPU
        assert b.split(200 - ahead[-1], busy=ahead[-1]) == 0 or ahead[-1] == 200
        fills.append(b.split(200, busy=50))
    assert ahead[0] == 100 and ahead == sorted(ahead) and ahead[-1] == 200  # half, then more, then all
    assert fills == sorted(fills) and fills[-1] > fills[0]
    b.handoff_clock.seconds = 0.0
    x, ids, w = routing(40, seed=3)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    b.end_forward()
    assert b.stats()["total"]["cpu_runs"] > 0 and b.handoff > 0
    b.close()


def test_a_wrong_copy_ahead_shows_as_ahead_not_used():
    """The heat says layer 1's experts 0-3 are hot; the prompt routes elsewhere: they are copied ahead and
    counted as ahead, not ahead_used, and the outputs still equal the reference's."""
    src, deep = _deep_pool(layers=2)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="on")
    b.cache.table.note_use(1, np.arange(4), weights=np.full(4, 1000.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] + 4 for _ in range(40)])  # experts 4-7 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in range(2):
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
    b.end_forward()
    st = b.stats()["layers"][1]
    assert st["ahead"] == 4 and st["ahead_used"] == 0 and st["fills"] == 8  # 4 wrong copies, then the 4 misses
    check_table(b)
    b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_the_first_layers_likely_misses_copy_in_at_the_forwards_start(cls):
    """begin_forward of a routed prompt with lookahead copies the first MoE layer's likely misses (its hot
    experts, not resident) before any layer runs: counted as that layer's fills and `ahead`, read as hits
    there (ahead_used, no miss); outputs equal the reference's. Without lookahead nothing moves before."""
    src, deep = _deep_pool(layers=2)
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    for look in ("off", "on"):
        b = cls(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead=look)
        b.cache.table.note_use(0, np.arange(4), weights=np.full(4, 1000.0))
        b.begin_forward(40, K, hold=True, span=40)
        before = b.stats()["layers"][0]
        for layer in range(2):
            torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                       rtol=1e-5, atol=1e-5)
        b.end_forward()
        st = b.stats()["layers"][0]
        if look == "on":
            assert before["ahead"] == before["fills"] > 0
            assert st["ahead_used"] == st["ahead"] == before["ahead"] and st["hits"] >= st["ahead"]
            if cls is OffloadBackend:
                assert st["ahead"] == 4 and st["misses"] == 0
        else:
            assert before["fills"] == 0 and st["ahead"] == 0 and st["misses"] == 4
        check_table(b)
        b.close()


def test_a_copy_ahead_takes_cold_residents_and_those_of_a_layer_done():
    """All slots full (layers 0 and 2): the copy ahead for layer 1's likely experts 0-3 takes slots whose
    experts the prompt will likely not read, here layer 0's untouched ones once its only piece ran and layer
    2's cold ones, never layer 2's hot ones. Outputs equal the reference's."""
    src, deep = _deep_pool(layers=3)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="on")
    t = b.cache.table
    for layer in (0, 2):
        b.cache.admit(layer, list(range(E)))
        t.unlock_all()
    for row in range(3):
        t.note_use(row, np.arange(4), weights=np.full(4, 1000.0))
    hot2 = {int(t.resident[2, e]) for e in range(4)}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in range(3):
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
        assert all(t.owner[s] // E == 2 for s in hot2)
    b.end_forward()
    st = b.stats()["layers"]
    assert st[1]["ahead"] == st[1]["ahead_used"] == 4 and st[1]["misses"] == 0 and st[2]["misses"] == 0
    check_table(b)
    b.close()


def test_cpu_outputs_through_the_reused_buffers_equal_the_reference_in_inference_mode():
    """The CPU job writes a routed prompt's outputs and positions into buffers the backend keeps (page-locked
    on CUDA, read in place by scatter_rows): made by the engine's thread in inference mode, written by the
    worker thread, reused layer after layer and prompt after prompt. Outputs equal the reference's."""
    src, deep = _deep_pool(layers=3)
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    b = HybridBackend(deep, 4, "cpu", estimate=est, stream_prefill="off", lookahead="on")
    b.cpu_jobs.zero_copy = True  # the buffers as on CUDA (the scatter itself: tests/kernels/test_mailbox.py)
    with torch.inference_mode():
        for step, T in enumerate((40, 7, 40)):
            x, ids, w = routing(T, seed=50 + step)
            b.begin_forward(T, K, hold=True, span=T)
            for layer in range(3):
                torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                           rtol=1e-5, atol=1e-5)
            b.end_forward()
    assert b.stats()["total"]["cpu_runs"] > 0 and b.cpu_jobs._out
    b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_idle_refresh_moves_the_hottest_experts_into_the_coldest_slots(cls):
    """OffloadBackend.refresh (idle time): slots full of layer 0's cold experts, the heat says layer 1's experts
    0-3 are hot: 2 calls of budget 2 move them in (into layer 0's coldest slots), a third finds nothing to move;
    each is counted as a fill and as `refreshed`; the copies hold the pool's weights (a prompt then finds
    them as hits and its output is the reference's). A newcomer only slightly hotter than every resident
    (under REFRESH_RATIO) stays out; with refresh off nothing moves."""
    src, deep = _deep_pool(layers=2)
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    b = cls(deep, E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", refresh="on")
    t = b.cache.table
    b.cache.admit(0, list(range(E)))
    t.unlock_all()
    t.note_use(0, np.arange(E), weights=np.arange(1.0, E + 1))  # layer 0's expert e: heat e + 1
    t.note_use(1, np.arange(4), weights=np.full(4, 1000.0))
    assert [b.refresh(2), b.refresh(2), b.refresh(2)] == [2, 2, 0]
    assert (t.resident[1, :4] >= 0).all() and (t.resident[0, :4] < 0).all() and (t.resident[0, 4:] >= 0).all()
    st = b.stats()["layers"][1]
    assert st["refreshed"] == st["fills"] == 4 and b.stats()["layers"][0]["refreshed"] == 0
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    torch.testing.assert_close(b.forward(1, x, ids, w), reference(src, 1, x, ids, w), rtol=1e-5, atol=1e-5)
    b.end_forward()
    assert b.stats()["layers"][1]["misses"] == 0
    check_table(b)
    b.close()
    for refresh, hot in (("on", 1.2 * E), ("off", 1000.0)):  # 1.2 x the hottest resident's heat: under 1.25
        b = cls(deep, E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", refresh=refresh)
        b.cache.admit(0, list(range(E)))
        b.cache.table.unlock_all()
        b.cache.table.note_use(0, np.arange(E), weights=np.full(E, float(E)))
        b.cache.table.note_use(1, np.arange(4), weights=np.full(4, hot))
        assert b.refresh() == 0 and b.stats()["total"]["refreshed"] == 0 and (b.cache.table.resident[1] < 0).all()
        b.close()


def test_the_refresh_mode_is_checked():
    with pytest.raises(ValueError, match="--moe-refresh must be one of auto, on, off"):
        OffloadBackend(_deep_pool(layers=1)[1], E, "cpu", refresh="sometimes")


def test_idle_refresh_leaves_the_windows_a_streamed_prompt_keeps():
    """With 3 windows a streamed prompt keeps window 2 for its first layer (PrefillStreamer.window_for): the
    refresh never takes a slot there, however cold its experts, so the next streamed prompt still finds that
    layer in place; the hot experts go to windows 0 and 1."""
    src, deep = _deep_pool(layers=4)
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="auto", slot_policy="lfu", refresh="on")
    t = b.cache.table
    b.cache.place(0, list(range(E)), list(range(2 * E, 3 * E)))  # layer 0 in its kept window, cold
    b.cache.place(1, list(range(E)), list(range(E)))
    b.cache.place(2, list(range(E)), list(range(E, 2 * E)))
    t.note_use(0, np.arange(E), weights=np.full(E, 1.0))
    t.note_use(1, np.arange(E), weights=np.full(E, 5.0))
    t.note_use(2, np.arange(E), weights=np.full(E, 5.0))
    t.note_use(3, np.arange(E), weights=np.full(E, 100.0))
    assert b.refresh(2 * E) == E and (t.resident[3] >= 0).all() and b.refresh() == 0
    assert (t.resident[3] < 2 * E).all() and (t.resident[0] == np.arange(2 * E, 3 * E)).all()
    assert not t.locked.any()
    check_table(b)
    b.close()


def test_idle_refresh_never_waits_for_the_pools_loader():
    """A layer the background loader has not filled yet is left out of the refresh (it would block the engine
    thread, and a request arriving meanwhile, until the load): its experts move once the layer is loaded."""
    import threading

    src, deep = _deep_pool(layers=2)
    b = OffloadBackend(deep, E, "cpu", stream_prefill="off", slot_policy="lfu", refresh="on")
    b.cache.table.note_use(1, np.arange(4), weights=np.full(4, 100.0))
    deep._ready[1].clear()  # as while the loader is still on layer 1
    try:
        moved = []
        worker = threading.Thread(target=lambda: moved.append(b.refresh()))
        worker.start()
        worker.join(5)
        assert not worker.is_alive() and moved == [0] and not deep.layer_ready(1)
    finally:
        deep._ready[1].set()
    assert b.refresh() == 4 and (b.cache.table.resident[1, :4] >= 0).all()
    b.close()


def test_a_prompts_cpu_experts_run_on_the_prompt_threads(pool, src, monkeypatch):
    """A layer call of PROMPT_TOKENS tokens or more runs its CPU share with prompt=True (the runner of
    cpu_runner.prompt_threads()), a decode-sized one without; outputs equal the reference either way."""
    seen = []
    real = cpu_jobs.run_on_cpu

    def spy(*a, prompt=False, **kw):
        seen.append(prompt)
        return real(*a, prompt=prompt, **kw)

    monkeypatch.setattr(cpu_jobs, "run_on_cpu", spy)
    b = CpuBackend(pool, 1, "cpu")
    for T in (cpu_jobs.PROMPT_TOKENS, 3):
        x, ids, w = routing(T, seed=T)
        torch.testing.assert_close(b.forward(0, x, ids, w), reference(src, 0, x, ids, w), rtol=1e-5, atol=1e-5)
    assert seen == [True, False]
    b.close()


def test_prompt_threads_default_to_the_expert_threads_and_take_their_own_runner(monkeypatch):
    monkeypatch.setattr(cpu_runner, "_threads", [3])
    monkeypatch.setattr(cpu_runner, "_prompt_threads", [None])
    assert cpu_runner.prompt_threads() == 3
    cpu_runner.set_prompt_threads(2)
    assert cpu_runner.prompt_threads() == 2 and cpu_runner.expert_threads() == 3
    with pytest.raises(ValueError, match=">= 1"):
        cpu_runner.set_prompt_threads(0)
    if cpu_runner.NATIVE:
        host = (torch.randn(2, 3 * I * H) * 0.3).bfloat16()
        layout = ExpertLayout(H, I, 2)
        x = torch.randn(4, H).bfloat16()
        jobs = [(torch.tensor([0, 4]), 0), (torch.tensor([1]), 1)]
        pos, y = cpu_runner.run_on_cpu(x, host, jobs, layout, 2, prompt=True)
        ref_pos, ref = cpu_runner._torch_run_on_cpu(x, host, jobs, layout, 2)
        assert torch.equal(pos, ref_pos) and 2 in cpu_runner._runners
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_an_unread_layer_counts_its_routing_as_it_was_when_called():
    """A wholly resident layer's routing is counted at settle(), after the call: a caller that writes the next
    piece's routing into the same tensor meanwhile (the fast path's bucket graphs do) changes nothing there."""
    pytest.importorskip("triton")
    src, deep = _deep_pool(layers=2)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="off", grouped=True)
    b.cache.admit(0, list(range(E)))
    b.cache.table.unlock_all()
    x, ids, w = routing(6, seed=int(torch.randint(1 << 30, ())))
    routed, kept = sorted(set(ids.reshape(-1).tolist())), ids.clone()
    b.begin_forward(6, K, hold=True, span=6)
    out = b.forward(0, x, ids, w)
    ids.fill_(0)  # the caller's buffer, reused before the forward ends
    b.end_forward()
    torch.testing.assert_close(out, reference(src, 0, x, kept, w), rtol=1e-5, atol=1e-5)
    assert b.stats()["layers"][0]["hits"] == len(routed)
    heat = b.cache.table.heat[b.pool.row[0]]
    assert np.flatnonzero(heat).tolist() == routed
    b.close()
