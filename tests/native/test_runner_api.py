"""CpuExpertRunner: async submit/wait, GIL release, input checks, and the torch fallback."""
import threading
import time
import warnings

import pytest
import torch

from engine.experts import cpu_kernels as ck
from engine.experts.cpu_kernels import CpuExpertRunner, reference_experts

native = pytest.mark.skipif(not ck.native_available(), reason="native extension not built")


def big_batch(n_experts=12, hidden=1024, inter=512):
    gen = torch.Generator().manual_seed(0)
    experts = [((torch.randn(2 * inter, hidden, generator=gen) * 0.05).float(),
                (torch.randn(hidden, inter, generator=gen) * 0.05).float()) for _ in range(n_experts)]
    x = torch.randn(4, hidden, generator=gen)
    return [(*experts[e], e % 4, 1.0) for e in range(n_experts)], x


@native
def test_submit_returns_before_done_and_wait_releases_the_gil():
    tasks, x = big_batch()
    runner = CpuExpertRunner(threads=1, isa="scalar")  # slowest path: the job lasts long enough to observe
    counter, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        y = torch.zeros_like(x)
        fut = runner.submit(tasks, x, y)
        submitted_done = fut.done()
        before = counter[0]
        t0 = time.perf_counter()
        fut.wait()
        elapsed, during = time.perf_counter() - t0, counter[0] - before
    finally:
        stop.set()
        worker.join()
    assert not submitted_done
    assert fut.done()
    assert elapsed > 0.01 and during > 1000  # the Python thread ran while wait() blocked
    ref = reference_experts(tasks, x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-4


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
