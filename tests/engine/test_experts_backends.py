"""Every slot backend equals a per-token reference for every slot count; bookkeeping stays consistent; the
CPU's share of the misses runs as the split and the prompt threads say."""
import numpy as np
import pytest
import torch

from engine.experts import cpu_jobs, cpu_runner
from engine.experts.block_layout import ExpertLayout
from engine.experts.compute import Routing
from engine.experts.cpu import CpuBackend
from engine.experts.host_pool import pool_from_source
from engine.experts.hybrid import HybridBackend
from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate

from tests.engine.backends_util import E, H, I, K, L_IDS, check_table, deep_pool, make_source, reference, routing
from tests.engine.backends_util import pool, src  # noqa: F401 (pytest fixtures)


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

    def cycle(m, busy=0, cpu_extra=0.0, per=1.0, fill_lag=0.0):  # every choice in turn, whatever the rates say
        options = b.policy.options(m, busy, cpu_extra, per, fill_lag) if m else [b.policy.best(m)]
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
    b.split = lambda m, busy=0, per=1.0, tail=False: calls.append((m, busy)) or split(m, busy, per, tail)
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
    for c in b.call_log:  # the host's steps in their order, in ms from the call's start
        if c.kind != "unread":
            assert 0 <= c.routed_ms <= c.planned_ms <= c.ran_ms <= c.queued_ms <= c.end_ms


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
@pytest.mark.parametrize("slots", [3, 2 * E, len(L_IDS) * E])
def test_grouped_device_experts_match_one_at_a_time(pool, cls, slots):
    """The grouped Triton kernels reading the slots in place (the CUDA default; here under Triton's
    interpreter) against one expert at a time through torch, on fresh routing: same outputs to fp32 rounding,
    the same experts counted, every miss served. With 3 slots a 40-token step fills in rounds and takes the torch
    path; a 64-token step's grouped calls take blocks made on the host (SlotRunner.launch_blocks), and hybrid's
    40- and 64-token calls with fills and a CPU job run hits and fills in one launch pair after the copies. (Hits may
    differ: a wholly resident layer's grouped call counts its experts' use only at the forward's end, settle(),
    so a later layer's fills in the same forward may evict other slots than the torch path's.)"""
    pytest.importorskip("triton")
    est = dict(estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True))
    grouped, single = cls(pool, slots, "cpu", grouped=True, **est), cls(pool, slots, "cpu", grouped=False, **est)
    seed = int(torch.randint(1 << 30, ()))
    for step, T in enumerate([5, 1, 1, 7, 1, 40, 1, 64]):
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
    monkeypatch.setattr(cpu_jobs, "native_runner", lambda threads: None)  # (its jobs would take the native kernels)
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


def test_cpu_outputs_through_the_reused_buffers_equal_the_reference_in_inference_mode():
    """The CPU job writes a routed prompt's outputs and positions into buffers the backend keeps (page-locked
    on CUDA, read in place by scatter_rows): made by the engine's thread in inference mode, written by the
    worker thread, reused layer after layer and prompt after prompt. Outputs equal the reference's."""
    src, deep = deep_pool(layers=3)
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


def test_a_prompts_cpu_experts_run_on_the_prompt_threads(pool, src, monkeypatch):
    """A layer call of PROMPT_TOKENS tokens or more runs its CPU share with prompt=True (the runner of
    cpu_runner.prompt_threads()), a decode-sized one without; outputs equal the reference either way."""
    seen = []
    if cpu_runner.NATIVE:  # the runner a job goes to, chosen in start()
        threads = cpu_jobs.job_threads
        monkeypatch.setattr(cpu_jobs, "job_threads", lambda prompt: seen.append(prompt) or threads(prompt))
    else:
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


@pytest.mark.skipif(not cpu_runner.NATIVE, reason="native CPU kernels not built")
def test_a_cpu_job_starts_before_the_engine_thread_goes_on(pool, monkeypatch):
    """On the Python worker thread (a job the native runner does not take), CpuJobs.start returns once its
    job is at the native call, which needs no GIL: the engine thread, going on to queue the device's work in
    Python, would otherwise hold the GIL the job's Python needs for up to the interpreter's switch interval. A job
    that fails still lets start return, and its error comes from result()."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced switch in this test: only the handshake orders the two threads
    try:
        returned, seen = threading.Event(), []

        class Runner:
            def run_gather(self, table, experts, rows, x, y):
                seen.append(returned.is_set())
                y.zero_()

        monkeypatch.setattr(cpu_runner, "native_runner", lambda threads: Runner())
        monkeypatch.setattr(cpu_jobs, "native_runner", lambda threads: None)
        jobs = cpu_jobs.CpuJobs(pool, torch.device("cpu"), zero_copy=False)
        x, ids, _ = routing(6, seed=int(torch.randint(1 << 30, ())))
        r = Routing.of(ids)
        for _ in range(3):
            returned.clear()
            pending = jobs.start(L_IDS[0], x, r, list(range(len(r.experts))))
            returned.set()
            assert pending.result().vals.shape[0] == int(r.counts.sum())
        assert seen == [False] * 3

        def fail(*a, **k):
            raise RuntimeError("a job that fails")

        monkeypatch.setattr(cpu_jobs, "run_on_cpu", fail)
        pending = jobs.start(L_IDS[0], x, r, [0])
        with pytest.raises(RuntimeError, match="a job that fails"):
            pending.result()
        jobs.close()
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.skipif(not cpu_runner.NATIVE, reason="native CPU kernels not built")
def test_a_jobs_outputs_are_sized_for_every_pair_of_its_call_from_the_first_job(src, pool):
    """The buffers a job writes are grown, at the first job of a call size, for every (token, expert) pair of
    that call: a later call of the size whose split sends more of its experts to the CPU writes into the same
    buffers (page-locking a grown one held the engine thread between a split and its job on the GPU box). Fresh
    random routing; each job's rows are the reference's."""
    jobs = cpu_jobs.CpuJobs(pool, torch.device("cpu"), zero_copy=False)
    T = 400  # T * K = 1200 pairs, past the least capacity (1024 rows)
    x, ids, w = routing(T, seed=int(torch.randint(1 << 30, ())))
    r = Routing.of(ids)
    layer = L_IDS[1]
    first = jobs.start(layer, x, r, [0]).result()
    buf = jobs._out[x.dtype]
    assert first.vals.shape[0] == int(r.counts[0]) < 1024 <= T * K <= buf[0].shape[0]
    done = jobs.start(layer, x, r, list(range(len(r.experts)))).result()
    assert jobs._out[x.dtype] is buf and done.vals.shape[0] == T * K
    y = torch.zeros(T * K, H)
    jobs.place(y, done)
    out = (y.view(T, K, H) * w[..., None]).sum(1)
    torch.testing.assert_close(out, reference(src, layer, x, ids, w), rtol=1e-4, atol=1e-4)
    jobs.close()
