"""Host pool loading (background, progress, errors), runtime resize of the slot cache, synthetic pools."""
import pytest
import torch

from engine.experts.block_layout import ExpertLayout, split_block
from engine.experts import host_pool
from engine.experts.host_pool import HUGE, HostPool, bytes_by_node, host_buffer
from engine.experts.offload import OffloadBackend
from engine.experts.synthetic import get_shape, synthetic_pool

LAYOUT = ExpertLayout(hidden=8, inter=4, itemsize=4)


def counting_fill(layer, buf):
    buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).view_as(buf) + 1000 * layer)


def test_background_load_reports_progress_and_serves_layers():
    seen = []
    pool = HostPool([0, 1, 3], 5, LAYOUT, torch.float32).load(counting_fill, background=True, progress=seen.append)
    assert pool.block(3, 2)[0] == 3000 + 2 * LAYOUT.numel  # waits for layer 3
    pool.wait()
    assert [p.done_bytes for p in seen] == [pool.nbytes // 3 * i for i in (1, 2, 3)]
    assert seen[-1].total_bytes == pool.nbytes == 3 * 5 * LAYOUT.nbytes and seen[-1].eta == 0
    gate_up, down = split_block(pool.block(1, 0), LAYOUT)
    assert gate_up.shape == (8, 8) and down.shape == (8, 4) and down[0, 0] == 1000 + 64


def test_loader_error_surfaces_where_the_layer_is_needed():
    def bad(layer, buf):
        if layer == 1:
            raise OSError("disk gone")
        buf.zero_()

    pool = HostPool([0, 1], 2, LAYOUT, torch.float32).load(bad, background=True)
    with pytest.raises(RuntimeError, match="loading the expert pool failed"):
        pool.wait_layer(1)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            text = fh.read()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


def _thp_fallbacks() -> int:
    try:
        with open("/proc/vmstat") as fh:
            return sum(int(line.split()[1]) for line in fh if line.startswith("thp_fault_fallback "))
    except OSError:
        return 0


def _no_mapping(*args, **kwargs):
    raise AssertionError("hugepages=False made a mapping of its own")


def test_pool_layers_sit_in_huge_pages_where_the_kernel_offers_them(monkeypatch):
    layout = ExpertLayout(hidden=256, inter=128, itemsize=2)  # 192 KiB a block, 3 MiB a layer
    fallbacks = _thp_fallbacks()
    huge = HostPool([0, 1], 16, layout, torch.bfloat16).load(counting_fill)
    with monkeypatch.context() as m:  # hugepages=False: plain allocations, no mapping advised by the pool
        m.setattr(host_pool.mmap, "mmap", _no_mapping)
        small = HostPool([0, 1], 16, layout, torch.bfloat16, hugepages=False).load(counting_fill)
        for layer in (0, 1):  # same data either way, huge-page layers start on a 2 MB boundary
            assert torch.equal(huge.wait_layer(layer), small.wait_layer(layer))
            assert huge.wait_layer(layer).data_ptr() % HUGE == 0
    # (its layers may still sit in huge pages another allocator advised: NumPy advises its arrays of 4 MiB and more,
    # and torch reuses that heap once they are freed)
    assert 0 <= small.huge_bytes() <= small.nbytes
    if _thp_mode() in ("always", "madvise"):  # advised: the kernel gave huge pages or said it could not
        assert huge.huge_bytes() > 0 or _thp_fallbacks() > fallbacks
    assert 0 <= huge.huge_bytes() <= huge.nbytes
    tiny = host_buffer((3, 5), torch.float32)  # under 2 MB: plain allocation, any shape and dtype
    assert tiny.shape == (3, 5) and tiny.dtype == torch.float32


def test_bytes_by_node_counts_the_pages_of_the_mappings_that_hold_the_spans():
    maps = ("7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n"  # holds the first span
            "7f0000400000-7f0000600000 rw-p 00000000 00:00 0\n"  # holds none
            "7f1000000000-7f1000800000 rw-p 00000000 00:00 0 \n"  # the second span's end lies inside it
            "55aa00000000-55aa00001000 r-xp 00000000 08:01 12 /usr/bin/python3\n")
    numa_maps = ("7f0000000000 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
                 "7f0000400000 default anon=512 N0=512 kernelpagesize_kB=4\n"
                 "7f1000000000 bind:1 anon=2 N1=2 kernelpagesize_kB=2048\n"
                 "55aa00000000 default file=/usr/bin/python3 mapped=1 N0=1 kernelpagesize_kB=4\n\n")
    spans = [(0x7F0000001000, 0x7F0000002000), (0x7F0FFFFFF000, 0x7F1000000800)]
    assert bytes_by_node(spans, maps, numa_maps) == {0: 2 * 4096, 1: 4096 + 2 * (2 << 20)}
    assert bytes_by_node([], maps, numa_maps) == {}
    assert bytes_by_node(spans, "", numa_maps) == {}  # a mapping's extent unknown: not counted


def test_a_loaded_pool_says_where_its_pages_sit():
    pool = HostPool([0, 1], 16, ExpertLayout(hidden=256, inter=128, itemsize=2), torch.bfloat16).load(counting_fill)
    placed = pool.bytes_by_node()
    try:
        open("/proc/self/numa_maps").close()
    except OSError:
        assert placed == {}
        return
    # every page of both layers was written by the fill; the mappings hold at most a huge page more each
    assert pool.nbytes <= sum(placed.values()) <= pool.nbytes + 2 * HUGE
    assert all(node >= 0 for node in placed)


def test_resize_keeps_residents_and_rejects_impossible_sizes():
    pool = HostPool([0, 1], 4, LAYOUT, torch.float32).load(counting_fill)
    b = OffloadBackend(pool, 6, "cpu")
    x, w = torch.randn(1, 8), torch.ones(1, 2) / 2
    for layer, ids in [(0, [0, 1]), (1, [2, 3]), (0, [2, 3])]:
        b.forward(layer, x, torch.tensor([ids]), w)
    before = b.forward(0, x, torch.tensor([[2, 3]]), w)
    for bad in (0, 9):
        with pytest.raises(ValueError):
            b.resize(bad)
    assert b.cache.num_slots == 6
    b.resize(2)  # keeps the two most recent: layer 0 experts 2, 3
    hits = b.stats()["total"]["hits"]
    assert torch.equal(b.forward(0, x, torch.tensor([[2, 3]]), w), before)
    assert b.stats()["total"]["hits"] == hits + 2
    b.resize(8)
    assert b.cache.num_slots == 8 and b.cache.resident_count(0) == 2
    for layer in (0, 1):
        for e in range(4):
            s = b.cache.lookup(layer, [e])[0]
            if s >= 0:
                assert torch.equal(b.cache.buf[s], pool.block(layer, e))
    b.close()


def test_synthetic_pool_is_seeded_and_shaped():
    shape = get_shape("qwen3.6-35b-a3b", scale_down=True)
    a, b = synthetic_pool(shape, seed=3), synthetic_pool(shape, seed=3)
    assert a.layers == list(range(shape.layers)) and a.buffers[0].shape == (shape.experts, shape.layout.numel)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers, b.buffers))
    assert not torch.equal(a.buffers[0], a.buffers[1])  # layers differ
    full = get_shape("qwen3.6-35b-a3b")
    assert (full.layers, full.experts, full.top_k, full.hidden, full.inter) == (40, 256, 8, 2048, 512)
    assert round(full.pool_bytes / 1e9, 1) == 64.4


def test_pin_failure_falls_back_to_pageable_with_one_warning(monkeypatch):
    """A CUDA runtime that refuses cudaHostRegister (memlock limit): one warning, the pool still loads."""
    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(size)
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    with pytest.warns(RuntimeWarning, match="pinning the expert pool failed") as record:
        pool = HostPool([0, 1, 2], 3, LAYOUT, torch.float32).load(counting_fill)
    assert len(record) == 1 and len(calls) == 1 and not pool.pinned
    assert pool.block(2, 1)[0] == 2000 + LAYOUT.numel
