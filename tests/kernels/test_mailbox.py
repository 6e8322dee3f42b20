"""The graphed decode step's CPU share (engine/kernels/mailbox_triton.py + the native Mailbox thread): pairs
marked LOC_CPU are skipped by the expert kernels, run by the thread from the host pool and joined into the
layer's output with their routing weights; the others are untouched, bit for bit."""
from types import SimpleNamespace

import pytest
import torch

from engine.experts import cpu_runner
from engine.experts.block_layout import ExpertLayout
from engine.experts.host_pool import HostPool
from engine.experts.policy import BandwidthEstimate
from engine.kernels.mailbox_triton import join, publish
from engine.kernels.moe_pairs_triton import LOC_CPU, LOC_SHARED, ExpertMap
from engine.kernels.moe_triton import run_experts_routed

pytestmark = pytest.mark.skipif(not cpu_runner.NATIVE, reason="the CPU share runs on the native kernels")


@pytest.mark.parametrize("shared", [True, False])
def test_cpu_pairs_are_run_by_the_thread_and_joined_with_their_weights(dev, shared):
    from engine.experts.graph_cpu import CpuShare

    g = torch.Generator().manual_seed(7 + shared)
    N, E, K, H, I = 4, 12, 4, 64, 32
    lay = ExpertLayout(H, I, 4)
    pool = HostPool([0], E, lay, torch.float32).load(
        lambda layer, buf: buf.copy_(torch.randn(buf.shape, generator=g) * 0.2))
    host = pool.wait_layer(0)
    backend = SimpleNamespace(name="hybrid", pool=pool, device=torch.device(dev), estimate=BandwidthEstimate())
    kp = K + shared
    box = CpuShare(backend, n_max=4, kp=kp, dtype=torch.float32, share=0.5)
    try:
        def split(buf):
            return buf[..., : 2 * I * H].unflatten(-1, (2 * I, H)), buf[..., 2 * I * H:].unflatten(-1, (H, I))

        shared_block = (torch.randn(3 * I * H, generator=g) * 0.2).to(dev)
        slots = torch.zeros(3, 3 * I * H, device=dev)
        table = torch.full((1, E), -1, dtype=torch.int32)
        for s, e in enumerate((2, 5, 9)):
            slots[s], table[0, e] = host[e].to(dev), s
        marked = box.mark(table.numpy())[0]
        assert (marked == LOC_CPU).sum() > 0 and (marked == -1).sum() > 0 and (marked[[2, 5, 9]] >= 0).all()
        loc = torch.tensor(list(marked) + [LOC_SHARED], dtype=torch.int32, device=dev)
        emap = ExpertMap(loc, *split(host), *(split(shared_block) if shared else (None, None)))
        stacked = torch.cat([host.to(dev), shared_block[None]]) if shared else host.to(dev)
        x = (torch.randn(N, H, generator=g) * 0.5).to(dev)
        logits = torch.randn(N, E + shared, generator=g).to(dev)
        valid = torch.tensor([1, 1, 1, 0], dtype=torch.int8, device=dev)  # a padding row routes nowhere
        ref_ids, ref_w = torch.empty(N, kp, dtype=torch.int32, device=dev), torch.empty(N, kp, device=dev)
        ref = run_experts_routed(x, *split(stacked), logits, K, True, shared, valid, ref_ids, ref_w)
        for step in range(2):  # the protocol's counters carry over from one step to the next
            ids, w = torch.empty(N, kp, dtype=torch.int32, device=dev), torch.empty(N, kp, device=dev)
            publish(box, 0, x, logits, valid, K, True, shared)
            y = run_experts_routed(x, *split(slots), logits, K, True, shared, valid, ids, w, mapped=emap)
            join(box, 0, y, ids, w, loc)
            assert torch.equal(ids.cpu(), ref_ids.cpu()) and int(box.err[0]) == 0
            cpu = (ids >= 0) & (ids < E) & (loc[ids.clamp(min=0).long()] == LOC_CPU)
            gpu = (ids >= 0) & ~cpu
            assert cpu.any() and gpu.any()
            assert torch.equal(y[gpu].cpu(), ref[gpu].cpu())  # the device's pairs as without a CPU share
            torch.testing.assert_close(y[cpu].cpu(), ref[cpu].cpu(), rtol=1e-4, atol=1e-5)  # the thread's
        st = box.stats()
        assert st["publishes"] == 2 and st["pairs"] == 2 * int(cpu.sum())
    finally:
        box.close()
    assert not box.box.running
    box.wake()  # a later engine over the same backend: the thread runs again, and close() ends it again
    assert box.box.running
    box.close()
    box.close()
    assert not box.box.running


def test_scatter_rows_reads_host_rows_in_place_into_their_positions(dev):
    """scatter_rows: y[pos[i]] = src[i] with pos and src in page-locked host memory (on the CPU under the
    interpreter), converted to y's dtype; rows not named keep what they held."""
    from engine.kernels.mailbox_triton import scatter_rows

    g = torch.Generator().manual_seed(3)
    pin = dev == "cuda"
    for n, R, H in ((5, 12, 2048), (1, 3, 100), (0, 4, 8)):
        src = torch.randn(n, H, generator=g).to(torch.bfloat16)
        pos = torch.randperm(R, generator=g)[:n]
        if pin:
            src, pos = src.pin_memory(), pos.pin_memory()
        y = torch.randn(R, H, generator=g).to(dev)
        want = y.clone()
        want[pos.to(dev)] = src.to(dev, y.dtype)
        scatter_rows(y, pos, src)
        assert torch.equal(y, want)
    with pytest.raises(ValueError, match="scatter_rows"):
        scatter_rows(torch.zeros(4, 8, device=dev), torch.zeros(2, dtype=torch.long), torch.zeros(2, 9))


def test_wait_flag_holds_the_stream_until_a_cpu_thread_raises_the_flag(dev, monkeypatch):
    """wait_flag: the kernels queued after it run once a host thread has written the flag (its rows are there
    to read); a flag already raised passes at once; one never raised stops at WAIT_LIMIT reads with err set."""
    import threading

    from engine.kernels import mailbox_triton
    from engine.kernels.mailbox_triton import scatter_rows, wait_flag

    pin = dev == "cuda"
    flag = torch.zeros(1, dtype=torch.long, pin_memory=pin)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    src = torch.zeros(3, 8, pin_memory=pin)
    pos = torch.tensor([2, 0, 1], pin_memory=pin)
    y = torch.zeros(3, 8, device=dev)

    def cpu_job():
        src.copy_(torch.arange(24.0).view(3, 8))
        flag[0] = 7

    late = threading.Timer(0.2, cpu_job)
    late.start()
    wait_flag(flag, 7, err)  # (under the interpreter this call spins on the host until the timer has run)
    scatter_rows(y, pos, src)
    late.join()
    assert torch.equal(y.cpu()[pos], torch.arange(24.0).view(3, 8)) and int(err[0]) == 0
    wait_flag(flag, 6, err)
    assert int(err[0]) == 0
    monkeypatch.setattr(mailbox_triton, "WAIT_LIMIT", 1000)
    wait_flag(flag, 8, err)
    assert int(err[0]) == 1
    with pytest.raises(ValueError, match="wait_flag"):
        wait_flag(torch.zeros(1, dtype=torch.int32), 1, err)


def test_counts_that_change_call_to_call_make_no_new_kernel_variant(dev):
    """The kernels a routed prompt's layer call launches with a count that changes from call to call (a joined CPU
    job's sequence number, the pairs and their blocks) mark it not to specialize on: Triton compiles or loads a
    variant for an int equal to 1 or divisible by 16, which held a layer call ~10 ms when the first such count came
    mid-run. On CUDA: wait_flag at targets 2, 16, 17, 32 after 1 compiles no other variant."""
    from engine.kernels import mailbox_triton, moe_pairs_triton, moe_triton
    from engine.kernels.mailbox_triton import wait_flag

    unspecialized = {
        mailbox_triton._wait_flag_kernel: {"target"}, mailbox_triton._wait_kernel: {"P"},
        mailbox_triton._publish_kernel: {"N", "row"}, moe_triton._expert_up_kernel: {"P", "done_target"},
        moe_triton._expert_down_kernel: {"P"}, moe_pairs_triton._expert_blocks_kernel: {"P", "NB"}}
    for kernel, names in unspecialized.items():
        if hasattr(kernel, "params"):  # compiled
            marked = {p.name for p in kernel.params if p.do_not_specialize}
        else:  # under Triton's interpreter: the decorator's arguments, each one of the kernel's
            marked = set(kernel.kwargs.get("do_not_specialize") or ())
            assert marked <= set(kernel.arg_names)
        assert marked == names, kernel.fn.__name__
    if dev != "cuda":
        return
    flag = torch.full((1,), 100, dtype=torch.long, pin_memory=True)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    compiled = mailbox_triton._wait_flag_kernel.device_caches[torch.cuda.current_device()][0]
    wait_flag(flag, 1, err)  # (variants of other tests' arguments, a flag's alignment among them, may be there)
    variants = len(compiled)
    for target in (2, 16, 17, 32):
        wait_flag(flag, target, err)
    torch.cuda.synchronize()
    assert int(err[0]) == 0
    assert len(compiled) == variants
