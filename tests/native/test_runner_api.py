"""CpuExpertRunner: async submit/wait, GIL release, input checks, and the torch fallback."""
import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from engine.experts import cpu_kernels as ck
from engine.experts.cpu_kernels import CpuExpertRunner
from engine.experts.cpu_tasks import reference_experts

native = pytest.mark.skipif(not ck.native_available(), reason="native extension not built")


def big_batch(n_experts=12, hidden=1024, inter=512):
    gen = torch.Generator().manual_seed(0)
    experts = [((torch.randn(2 * inter, hidden, generator=gen) * 0.05).float(),
                (torch.randn(hidden, inter, generator=gen) * 0.05).float()) for _ in range(n_experts)]
    x = torch.randn(4, hidden, generator=gen)
    return [(*experts[e], e % 4, 1.0) for e in range(n_experts)], x


@native
def test_submit_returns_before_done_and_wait_releases_the_gil():
    """submit() returns before the job ends, and wait() lets another Python thread run while it blocks. Slowest
    path and ~0.2 GB of weights: the job lasts several times what the test needs to observe. The spinning thread
    starts once done() is read, so no Python thread holds the GIL between submit() and done(); on a loaded box
    the job may still end before wait() is entered (the spinner held the GIL meanwhile): such a try shows nothing
    about wait(), and the next one runs (a try observes wait() only when the job was still running as it began)."""
    tasks, x = big_batch(n_experts=36)
    runner = CpuExpertRunner(threads=1, isa="scalar")
    ref = reference_experts(tasks, x)
    observed = []
    for _ in range(4):
        counter, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                counter[0] += 1

        worker = threading.Thread(target=spin)
        try:
            y = torch.zeros_like(x)
            fut = runner.submit(tasks, x, y)
            submitted_done = fut.done()
            worker.start()
            before, running = counter[0], not fut.done()
            t0 = time.perf_counter()
            fut.wait()
            elapsed, during = time.perf_counter() - t0, counter[0] - before
        finally:
            stop.set()
            if worker.is_alive():
                worker.join()
        assert not submitted_done and fut.done()
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-4
        if running and elapsed > 0.01:  # wait() blocked for the job: the Python thread ran meanwhile
            observed.append(during)
            break
    assert observed and observed[0] > 1000, "no try entered wait() while its job ran, or the spinner did not run"


@native
def test_back_to_back_submits_both_land():
    tasks, x = big_batch(n_experts=4, hidden=128, inter=64)
    runner = CpuExpertRunner(threads=2)
    y = torch.zeros_like(x)
    runner.submit(tasks, x, y)
    runner.submit(tasks, x, y)  # waits for the first before starting
    runner.wait()
    ref = 2 * reference_experts(tasks, x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("backend", ["torch"] + (["native"] if ck.native_available() else []))
def test_bad_inputs_raise_value_error(backend):
    runner = CpuExpertRunner(threads=1, backend=backend)
    gu, dn, x = torch.randn(8, 16), torch.randn(16, 4), torch.randn(2, 16)
    with pytest.raises(ValueError, match="float32"):
        runner.run([(gu, dn, 0, 1.0)], x, torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shapes"):
        runner.run([(gu, torch.randn(16, 5), 0, 1.0)], x, torch.zeros(2, 16))
    with pytest.raises(ValueError, match="outside"):
        runner.run([(gu, dn, 2, 1.0)], x, torch.zeros(2, 16))
    with pytest.raises(ValueError, match="bf16 or all fp32"):
        runner.run([(gu.half(), dn.half(), 0, 1.0)], x, torch.zeros(2, 16))
    with pytest.raises(ValueError, match="inner stride"):
        runner.run([(gu.t().contiguous().t(), dn, 0, 1.0)], x, torch.zeros(2, 16))


def test_unknown_isa_and_backend_are_rejected():
    with pytest.raises(ValueError):
        CpuExpertRunner(backend="gpu")
    if ck.native_available():
        with pytest.raises(ValueError, match="not available"):
            CpuExpertRunner(isa="avx1024")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_fallback_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    experts = [((torch.randn(58, 45, generator=gen) * 0.1).to(dtype),
                (torch.randn(45, 29, generator=gen) * 0.1).to(dtype)) for _ in range(3)]
    x = torch.randn(3, 45, generator=gen)
    tasks = [(*experts[e], t, 0.3) for t in range(3) for e in (0, (t + 1) % 3)]
    y = torch.zeros(3, 45)
    runner = CpuExpertRunner(threads=1, backend="torch")
    fut = runner.submit(tasks, x, y)
    fut.wait()
    ref = reference_experts(tasks, x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_missing_extension_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(ck, "_native", None)
    monkeypatch.setattr(ck, "_warned", False)
    with pytest.warns(RuntimeWarning, match="not built"):
        first = CpuExpertRunner(threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = CpuExpertRunner(threads=1)
    assert first.backend == second.backend == "torch"
    with pytest.raises(ValueError, match="not built"):
        CpuExpertRunner(backend="native")


@pytest.mark.parametrize("backend", ["torch"] + (["native"] if ck.native_available() else []))
def test_routed_table_path_matches_task_path(backend):
    gen = torch.Generator().manual_seed(11)
    hidden, inter = 72, 20
    blocks = (torch.randn(6, 3 * inter * hidden, generator=gen) * 0.1).bfloat16()  # host pool layout
    table = ck.ExpertTable.from_blocks(blocks, hidden, inter)
    x = torch.randn(3, hidden, generator=gen)
    experts, tokens = torch.tensor([5, 0, 5, 2, 3, 5]), torch.tensor([0, 0, 1, 1, 2, 2])
    weights = torch.rand(6, generator=gen)
    y = torch.zeros(3, hidden)
    runner = CpuExpertRunner(threads=2, backend=backend)
    runner.run_routed(table, experts, tokens, weights, x, y)
    ref = reference_experts(table.tasks(experts.tolist(), tokens.tolist(), weights.tolist()), x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2
    with pytest.raises(ValueError):
        runner.run_routed(table, [6], [0], [1.0], x, y)  # no expert 6
    with pytest.raises(ValueError, match="one entry per task"):
        runner.run_routed(table, [1, 2], [0], [1.0], x, y)


def _rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@native
@pytest.mark.parametrize("threads,joins", [(1, True), (2, True), (2, False), (3, True)])
def test_a_joining_caller_runs_its_share_inside_wait(threads, joins):
    tasks, x = big_batch(n_experts=8, hidden=256, inter=96)
    runner = CpuExpertRunner(threads=threads, caller_joins=joins)
    assert runner.caller_joins is joins
    ref = reference_experts(tasks, x)
    for _ in range(3):  # back to back: each job reuses the caller's barrier sense
        y = torch.zeros_like(x)
        fut = runner.submit(tasks, x, y)
        if joins:
            time.sleep(0.02)
            assert not fut.done()  # worker 0 is the caller: nothing finishes it before wait()
        fut.wait()
        assert fut.done() and _rel_err(y, ref) < 1e-4
    buf = torch.randint(0, 2**62, (1 << 16,), dtype=torch.int64)
    expect = 0
    for v in buf.tolist():
        expect ^= v
    assert runner.read_bandwidth_pass(buf) % 2**64 == expect % 2**64


@native
def test_the_caller_joins_by_default_only_when_the_pool_takes_every_core():
    cores = ck.physical_cores()
    assert CpuExpertRunner(threads=cores).caller_joins
    assert CpuExpertRunner(threads=cores + 1, pin=False).caller_joins
    if cores > 1:
        assert not CpuExpertRunner(threads=cores - 1).caller_joins


@native
def test_two_threads_waiting_on_one_joined_job_both_return():
    tasks, x = big_batch(n_experts=8, hidden=256, inter=96)
    runner = CpuExpertRunner(threads=2, caller_joins=True)
    y = torch.zeros_like(x)
    fut = runner.submit(tasks, x, y)
    waiter = threading.Thread(target=runner.wait)
    waiter.start()
    fut.wait()  # one of the two runs worker 0's share, the other waits for the job
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert _rel_err(y, reference_experts(tasks, x)) < 1e-4


@native
@pytest.mark.parametrize("joins", [True, False])
def test_the_profile_accounts_for_every_core_second(joins):
    tasks, x = big_batch(n_experts=6, hidden=256, inter=96)
    runner = CpuExpertRunner(threads=2, caller_joins=joins)
    runner.run(tasks, x, torch.zeros_like(x))  # not profiled
    runner.set_profile(True)
    assert runner.profile()["jobs"] == 0
    for _ in range(5):
        runner.run(tasks, x, torch.zeros_like(x))
    runner.read_bandwidth_pass(torch.zeros(1 << 20, dtype=torch.uint8))  # a one-phase job
    p = runner.profile()
    assert p["jobs"] == 6
    parts = [p[k] for k in ("dispatch_s", "run_s", "barrier_s", "tail_s", "wake_s")]
    assert min(parts) >= 0 and p["run_s"] > 0
    assert sum(parts) == pytest.approx(p["wall_s"], rel=1e-9)
    assert sum(p["run_phase_s"]) == pytest.approx(p["run_s"], rel=1e-9) and p["run_phase_s"][2] == 0
    runner.set_profile(False)
    runner.run(tasks, x, torch.zeros_like(x))
    assert runner.profile()["jobs"] == 0  # switching zeroes the sums; jobs while off are not counted


@native
def test_an_empty_expert_table_is_refused():
    with pytest.raises(ValueError, match="E >= 1"):
        ck.ExpertTable(torch.zeros(0, 8, 4), torch.zeros(0, 4, 4))


@native
def test_run_routed_converts_x_and_waits_for_a_pending_batch():
    gen = torch.Generator().manual_seed(5)
    hidden, inter = 48, 24
    blocks = (torch.randn(4, 3 * inter * hidden, generator=gen) * 0.1).float()
    table = ck.ExpertTable.from_blocks(blocks, hidden, inter)
    x32 = torch.randn(2, hidden, generator=gen)
    experts, tokens, weights = [3, 1, 3], [0, 0, 1], [0.5, 1.0, 2.0]
    ref = reference_experts(table.tasks(experts, tokens, weights), x32)
    runner = CpuExpertRunner(threads=2)
    y = torch.zeros(2, hidden)
    fut = runner.submit_routed(table, experts, tokens, weights, x32, y)  # pending when run_routed starts
    x_strided = x32.t().contiguous().t()  # inner stride 2: converted to fp32 rows
    runner.run_routed(table, experts, tokens, weights, x_strided, y)
    assert fut.done() and _rel_err(y, 2 * ref) < 1e-5
    y2 = torch.zeros(2, hidden)
    runner.run_routed(table, experts, tokens, weights, x32.double(), y2)  # any float dtype
    assert _rel_err(y2, ref) < 1e-5
    with pytest.raises(ValueError, match="hidden size"):
        runner.run_routed(table, experts, tokens, weights, torch.randn(2, hidden + 1), torch.zeros(2, hidden + 1))


@pytest.mark.parametrize("backend", ["torch"] + (["native"] if ck.native_available() else []))
def test_run_io_matches_run_routed_and_checks_its_buffers(backend):
    gen = torch.Generator().manual_seed(21)
    hidden, inter = 40, 12
    table = ck.ExpertTable.from_blocks((torch.randn(5, 3 * inter * hidden, generator=gen) * 0.1).bfloat16(),
                                       hidden, inter)
    x = torch.randn(3, hidden, generator=gen)
    experts, tokens, weights = [4, 0, 4, 1], [0, 2, 1, 2], [0.5, 1.5, -1.0, 2.0]
    runner = CpuExpertRunner(threads=2, backend=backend)
    y_routed, y_io = torch.zeros(3, hidden), torch.randn(3, hidden, generator=gen)
    y0 = y_io.clone()
    runner.run_routed(table, experts, tokens, weights, x, y_routed)
    io = ck.RoutedIO(x, y_io)
    runner.run_io(table, torch.tensor(experts), torch.tensor(tokens), torch.tensor(weights), io)  # tensors too
    assert torch.equal(y_io - y0, y_routed) or _rel_err(y_io - y0, y_routed.double()) < 1e-6
    with pytest.raises(ValueError, match="float32"):
        ck.RoutedIO(x.double(), torch.zeros(3, hidden))
    for bad_x in (x[0], torch.tensor(1.0), x.double()[None]):  # not [T, H]: named, whatever the dtype
        with pytest.raises(ValueError, match="\\[T, H\\]"):
            runner.run_routed(table, experts, tokens, weights, bad_x, y_routed)
    with pytest.raises(ValueError, match="\\[T, H\\]"):
        ck.RoutedIO(x, torch.zeros(2, hidden))
    with pytest.raises(ValueError, match="hidden size"):
        runner.run_io(table, experts, tokens, weights, ck.RoutedIO(torch.zeros(3, 8), torch.zeros(3, 8)))
    with pytest.raises(ValueError):
        runner.run_io(table, [5], [0], [1.0], io)  # no expert 5
    with pytest.raises(ValueError):
        runner.run_io(table, [0], [3], [1.0], io)  # no row 3
    with pytest.raises(ValueError):
        runner.run_io(table, ["a"], [0], [1.0], io)
    before = y_io.clone()
    runner.run_io(table, [2], [1], [1.0], io)  # still serving after the errors
    assert not torch.equal(before[1], y_io[1]) and torch.equal(before[0], y_io[0])


@native
def test_one_runner_reuses_its_plan_across_batches_of_every_size():
    """The native planner keeps one job and its scratch across calls: batches that grow, shrink, change shape
    and format, and put many tasks on few experts (groups split every four tokens) all match the reference."""
    gen = torch.Generator().manual_seed(31)
    runner = CpuExpertRunner(threads=3)
    shapes = [(64, 16, 6, torch.bfloat16, 1, 1), (96, 40, 60, torch.bfloat16, 7, 300), (64, 16, 6, torch.float32, 2, 3),
              (33, 70, 9, torch.bfloat16, 4, 200), (64, 16, 6, torch.bfloat16, 1, 8), (96, 40, 60, torch.float32, 3, 0)]
    for hidden, inter, n_exp, dtype, T, n_tasks in shapes:
        table = ck.ExpertTable.from_blocks((torch.randn(n_exp, 3 * inter * hidden, generator=gen) * 0.1).to(dtype),
                                           hidden, inter)
        x = torch.randn(T, hidden, generator=gen)
        experts = torch.randint(0, min(n_exp, 1 + n_tasks // 5), (n_tasks,), generator=gen).tolist()  # duplicates
        tokens = torch.randint(0, T, (n_tasks,), generator=gen).tolist()
        weights = torch.randn(n_tasks, generator=gen).tolist()
        y0 = torch.randn(T, hidden, generator=gen)
        y = y0.clone()
        runner.run_io(table, experts, tokens, weights, ck.RoutedIO(x, y))
        ref = reference_experts(table.tasks(experts, tokens, weights), x)
        if n_tasks == 0:
            assert torch.equal(y, y0)
        else:
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            assert _rel_err(y.double() - y0.double(), ref) < tol, (hidden, inter, T, n_tasks)


@native
def test_run_gather_equals_run_io_on_gathered_rows_and_converts_like_torch():
    """The engine path's one call: out[i] = expert[i](x[rows[i]]), overwritten, in f32 or bf16 (rounded as
    torch rounds), x read in f32 or bf16; bad ids and rows raise; a batch still pending is waited for."""
    gen = torch.Generator().manual_seed(41)
    hidden, inter = 48, 20
    table = ck.ExpertTable.from_blocks((torch.randn(6, 3 * inter * hidden, generator=gen) * 0.1).bfloat16(),
                                       hidden, inter)
    x = torch.randn(3, hidden, generator=gen)
    experts, rows = [5, 0, 5, 2, 3], [0, 2, 1, 2, 0]
    runner = CpuExpertRunner(threads=2)
    pending_y = torch.zeros(3, hidden)
    fut = runner.submit_routed(table, [1, 4], [0, 1], [1.0, 1.0], x, pending_y)
    out = torch.full((5, hidden), float("nan"))  # overwritten, not added to
    runner.run_gather(table, experts, rows, x, out)
    assert fut.done() or runner.caller_joins
    fut.wait()
    assert pending_y.abs().sum() > 0
    want = torch.zeros(5, hidden)
    runner.run_io(table, experts, list(range(5)), [1.0] * 5, ck.RoutedIO(x[rows].contiguous(), want))
    assert torch.equal(out, want)
    out_bf = torch.empty(5, hidden, dtype=torch.bfloat16)
    runner.run_gather(table, experts, rows, x, out_bf)
    assert torch.equal(out_bf, want.bfloat16())
    xb = x.bfloat16()
    runner.run_gather(table, experts, rows, xb, out)
    want_b = torch.zeros(5, hidden)
    runner.run_io(table, experts, list(range(5)), [1.0] * 5, ck.RoutedIO(xb.float()[rows].contiguous(), want_b))
    assert torch.equal(out, want_b)
    for bad in ([6], [-1]):
        with pytest.raises(ValueError, match="outside"):
            runner.run_gather(table, bad, [0], x, torch.empty(1, hidden))
    with pytest.raises(ValueError, match="outside"):
        runner.run_gather(table, [0], [3], x, torch.empty(1, hidden))
    with pytest.raises(ValueError, match="out \\["):
        runner.run_gather(table, [0, 1], [0, 0], x, torch.empty(1, hidden))
    with pytest.raises(ValueError, match="f32 or bf16"):
        runner.run_gather(table, [0], [0], x.double(), torch.empty(1, hidden))
    with pytest.raises(ValueError):
        runner.run_gather(table, ["a"], [0], x, torch.empty(1, hidden))
    runner.run_gather(table, [1], [1], x[:, :hidden], out[:1])  # still serving after the errors


def _gather_case(hidden: int, inter: int, num_experts: int, tokens: int, n: int, joins: bool):
    """Fresh random bf16 experts, x [tokens, hidden] and n (expert, row) tasks, a 2-thread runner -> (table, x,
    experts, rows, runner, run_gather's outputs for the tasks)."""
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    table = ck.ExpertTable.from_blocks((torch.randn(num_experts, 3 * inter * hidden, generator=gen) * 0.05)
                                       .bfloat16(), hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    experts = torch.randint(num_experts, (n,), generator=gen).tolist()
    rows = torch.randint(tokens, (n,), generator=gen).tolist()
    runner = CpuExpertRunner(threads=2, caller_joins=joins)
    want = torch.empty(n, hidden, dtype=torch.bfloat16)
    runner.run_gather(table, experts, rows, x, want)
    return table, x, experts, rows, runner, want


@native
@pytest.mark.parametrize("joins", [False, True])
def test_post_gather_runs_run_gathers_job_and_raises_the_flag(joins):
    """post_gather (a prompt's CPU job with no Python thread between: cpu_jobs.CpuJobs): the outputs run_gather
    gives, the flag raised to seq once they are written, wait_gather's start on perf_counter's clock within the
    call; a second post waits for the first, whose outputs stand; bad ids, rows and flags raise and the runner
    serves on. Fresh random inputs; with and without the caller joining the pool (its own thread is then
    worker 0; else the worker that ends the job raises the flag)."""
    hidden = 64
    table, x, experts, rows, runner, want = _gather_case(hidden, 32, 8, 16, 40, joins)
    n = len(experts)
    flag = torch.zeros(1, dtype=torch.long)
    outs = [torch.full((n, hidden), float("nan")).bfloat16() for _ in range(2)]
    t0 = time.perf_counter()
    runner.post_gather(table, experts, rows, x, outs[0], flag, 3)
    runner.post_gather(table, experts[::-1], rows[::-1], x, outs[1], flag, 4)
    assert torch.equal(outs[0], want)  # the first is done once the second is posted
    started, seconds = runner.wait_gather()
    assert int(flag[0]) == 4 and t0 <= started <= time.perf_counter() and seconds > 0
    assert torch.equal(outs[1], want.flip(0))
    with pytest.raises(ValueError, match="outside"):
        runner.post_gather(table, [8], [0], x, outs[0][:1], flag, 5)
    with pytest.raises(ValueError, match="outside"):
        runner.post_gather(table, [0], [16], x, outs[0][:1], flag, 5)
    with pytest.raises(ValueError, match="int64"):
        runner.post_gather(table, [0], [0], x, outs[0][:1], flag.int(), 5)
    with pytest.raises(ValueError, match="one-dimensional"):
        runner.post_gather(table, np.asarray(experts)[:, None], rows, x, outs[0], flag, 5)
    runner.post_gather(table, experts, rows, x, outs[0])  # still serving after the errors; no flag
    runner.wait_gather()
    assert torch.equal(outs[0], want) and int(flag[0]) == 4
    # int64 arrays as the engine passes them (cpu_jobs), a strided view and int32 converted alike
    for e, r in ((np.asarray(experts, np.int64), np.asarray(rows, np.int64)),
                 (np.repeat(np.asarray(experts, np.int64), 2)[::2], np.asarray(rows, np.int32))):
        outs[1].fill_(float("nan"))
        runner.post_gather(table, e, r, x, outs[1], flag, 6)
        runner.wait_gather()
        assert torch.equal(outs[1], want) and int(flag[0]) == 6


@native
@pytest.mark.parametrize("joins", [False, True])
def test_a_posted_job_holds_the_runner_until_its_flag_is_up(joins):
    """A run_gather on the runner from another thread while a post_gather's job runs waits for that job's flag:
    when it returns the flag stands at the posted seq and both outputs are run_gather's (no other job queued
    between the posted job and its flag). Fresh random inputs, a job big enough to be in flight. The one-task
    run's reference is that task run alone: a row's sums depend on how many tokens its expert's group holds (the
    kernels' accumulators and the tile path follow it), so row 0 of the 96-task run may differ in the last bit."""
    hidden = 512
    table, x, experts, rows, runner, want = _gather_case(hidden, 256, 16, 8, 96, joins)
    alone = torch.empty(1, hidden, dtype=torch.bfloat16)
    runner.run_gather(table, experts[:1], rows[:1], x, alone)
    for seq in range(1, 6):
        flag = torch.zeros(1, dtype=torch.long)
        posted, other = torch.empty_like(want), torch.empty(1, hidden, dtype=torch.bfloat16)
        seen = []
        runner.post_gather(table, experts, rows, x, posted, flag, seq)

        def beside():
            runner.run_gather(table, experts[:1], rows[:1], x, other)
            seen.append(int(flag[0]))

        thread = threading.Thread(target=beside)
        thread.start()
        thread.join(60)
        assert seen == [seq]
        runner.wait_gather()
        assert torch.equal(posted, want) and torch.equal(other, alone)


def _threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


@native
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("joins", [False, True])
def test_a_posted_job_is_ended_by_its_workers_unless_the_caller_joins(joins):
    """Where the pool's caller does not join, post_gather starts no thread of its own: the worker that ends the
    job raises the flag and marks it done (nothing to wake between the job's end and the device's wait). Where it
    joins, one thread runs worker 0's share of every posted job. Fresh random inputs, several jobs."""
    hidden = 64
    table, x, experts, rows, runner, want = _gather_case(hidden, 32, 8, 16, 40, joins)
    before = _threads_of_this_process()
    flag = torch.zeros(1, dtype=torch.long)
    for seq in range(1, 4):
        out = torch.full_like(want, float("nan"))
        runner.post_gather(table, experts, rows, x, out, flag, seq)
        started, seconds = runner.wait_gather()
        assert int(flag[0]) == seq and torch.equal(out, want) and seconds > 0
    assert _threads_of_this_process() - before == (1 if joins else 0)


@native
@pytest.mark.parametrize("joins", [False, True])
def test_reading_last_tiles_while_a_posted_job_holds_the_runner_lets_python_run(joins):
    """last_call_tiles waits while a posted job holds the runner (until its flag is up), with the GIL let go: the
    other threads' Python goes on meanwhile (the engine thread queueing the device's work), where holding it
    stopped them until the job's end. Fresh random inputs, a job of ~0.35 s on the dev box."""
    table, x, experts, rows, runner, _ = _gather_case(512, 256, 16, 8, 96, joins)
    experts, rows = experts * 400, rows * 400
    flag = torch.zeros(1, dtype=torch.long)
    out = torch.empty(len(experts), 512, dtype=torch.bfloat16)
    runner.post_gather(table, experts, rows, x, out, flag, 1)
    entered = threading.Event()

    def reader():
        entered.set()
        assert runner.last_call_tiles in (True, False)

    thread = threading.Thread(target=reader)
    thread.start()
    entered.wait()
    time.sleep(0.02)  # the reader is in its wait by now
    seen = int(flag[0])  # Python on this thread while the reader waits: the job is still on
    thread.join(60)
    runner.wait_gather()
    assert seen == 0 and int(flag[0]) == 1
