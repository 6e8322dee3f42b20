"""Native CPU expert kernels against a float64 reference, on every ISA path this machine supports."""
import os

import pytest
import torch

from engine.experts import cpu_kernels as ck
from engine.experts.cpu_kernels import CpuExpertRunner
from engine.experts.cpu_tasks import reference_experts, split_expert_block

if os.environ.get("KILLICK_REQUIRE_NATIVE") == "1":
    assert ck.native_available(), "KILLICK_REQUIRE_NATIVE=1 but native/_cpu_experts is not built"
pytestmark = pytest.mark.skipif(not ck.native_available(), reason="native extension not built")

ISAS = ck.supported_isas() or ["none"]
DTYPES = [torch.bfloat16, torch.float32]


def tolerance(isa: str, dtype: torch.dtype) -> float:
    # With bf16 weights the VDPBF16PS and AVX2 paths take the activations in bf16 as well (x and the SwiGLU
    # output): bf16-level error; elsewhere fp32 accumulation only.
    return 1e-2 if isa in ("amx", "avx512bf16", "avx2") and dtype == torch.bfloat16 else 1e-4


def make_experts(n, hidden, inter, dtype, gen):
    return [((torch.randn(2 * inter, hidden, generator=gen) * 0.1).to(dtype),
             (torch.randn(hidden, inter, generator=gen) * 0.1).to(dtype)) for _ in range(n)]


def rel_err(y, y0, ref):
    return ((y.double() - y0.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden,inter", [(67, 29), (130, 45), (256, 96)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("row_block", [0, 1, 2, 3])
def test_matches_float64_reference(isa, dtype, hidden, inter, tokens, row_block):
    check_against_reference(isa, dtype, hidden, inter, tokens, row_block)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("claim_rows", [1, 7, 16, 64])
@pytest.mark.parametrize("least", [8, 4, 3, None], ids=["guided", "guided-4", "guided-3", "fixed"])
def test_claim_size_does_not_change_results(isa, claim_rows, least):
    """Workers claim rows dynamically; any claim size (odd ones too), fixed or shrinking towards the end of
    a phase to any least size, covers every row exactly once."""
    kw = dict(claim_rows=claim_rows, guided=least is not None, least_rows=least or 8)
    check_against_reference(isa, torch.bfloat16, 130, 45, 3, 0, threads=3, **kw)
    check_against_reference(isa, torch.bfloat16, 700, 300, 1, 0, threads=5, **kw)
    check_against_reference(isa, torch.bfloat16, 700, 300, 2, 2, threads=5, **kw)
    check_against_reference(isa, torch.bfloat16, 700, 300, 1, 3, threads=4, **kw)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("row_block", [2, 3])
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_stream_walks_take_experts_in_twos_and_fours(isa, row_block, tokens):
    """Seven experts with as many tokens each: the down phase walks them 4 + 2 + 1 (quad) or 2 + 2 + 2 + 1."""
    gen = torch.Generator().manual_seed(17 + tokens)
    experts = make_experts(7, 200, 90, torch.bfloat16, gen)
    x = torch.randn(tokens, 200, generator=gen)
    tasks = [(*experts[e], t, 0.1 + e / 10) for e in range(7) for t in range(tokens)]
    y = torch.zeros(tokens, 200)
    CpuExpertRunner(threads=3, isa=isa, row_block=row_block, claim_rows=16).run(tasks, x, y)
    assert rel_err(y, torch.zeros(tokens, 200), reference_experts(tasks, x)) < tolerance(isa, torch.bfloat16)


def check_against_reference(isa, dtype, hidden, inter, tokens, row_block, claim_rows=64, threads=2, guided=True,
                            least_rows=8):
    gen = torch.Generator().manual_seed(hidden * 10 + tokens)
    experts = make_experts(5, hidden, inter, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    # top-3 per token, duplicates across tokens: expert 0 is used by every token
    tasks = [(*experts[e], t, float(torch.rand(1, generator=gen)))
             for t in range(tokens) for e in {0, (t + 1) % 5, (2 * t + 3) % 5}]
    y0 = torch.randn(tokens, hidden, generator=gen)  # accumulated into, not overwritten
    y = y0.clone()
    CpuExpertRunner(threads=threads, isa=isa, row_block=row_block, claim_rows=claim_rows,
                    guided=guided, least_rows=least_rows).run(tasks, x, y)
    assert rel_err(y, y0, reference_experts(tasks, x)) < tolerance(isa, dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hint", ["t0", "t1", "t2", "nta"])
@pytest.mark.parametrize("row_block", [0, 1, 2, 3])
def test_prefetch_hint_does_not_change_results(isa, hint, row_block):
    gen = torch.Generator().manual_seed(11)
    experts = make_experts(3, 300, 70, torch.bfloat16, gen)
    x = torch.randn(2, 300, generator=gen)
    tasks = [(*experts[e], t, 0.5) for t in range(2) for e in range(3)]
    y, y0 = torch.zeros(2, 300), torch.zeros(2, 300)
    CpuExpertRunner(threads=2, isa=isa, row_block=row_block, prefetch_bytes=256, prefetch_hint=hint).run(tasks, x, y)
    CpuExpertRunner(threads=2, isa=isa, row_block=row_block, prefetch_bytes=256, prefetch_hint="t0").run(tasks, x, y0)
    assert torch.equal(y, y0)  # a hint moves lines earlier, never changes what is computed
    assert rel_err(y, torch.zeros(2, 300), reference_experts(tasks, x)) < tolerance(isa, torch.bfloat16)


def test_the_runner_takes_its_prefetch_hint_from_the_cpus_walk(monkeypatch):
    walk = ck.default_walk()
    assert walk[3] in ck.PREFETCH_HINTS
    assert CpuExpertRunner(threads=1).prefetch_hint == walk[3]
    other = "t0" if walk[3] != "t0" else "nta"
    monkeypatch.setattr(ck, "default_walk", lambda: (*walk[:3], other))
    assert CpuExpertRunner(threads=1).prefetch_hint == other
    assert CpuExpertRunner(threads=1, prefetch_hint="t2").prefetch_hint == "t2"


def test_the_walk_follows_the_cpus_vendor_and_its_avx512():
    zen = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma bmi2\n"
    zen4 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16\n"
    xeon = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f amx_tile amx_bf16\n"
    assert ck.walk_for(zen) == (3, ck.PREFETCH_BYTES, 64, "nta")
    assert ck.walk_for(zen4) == (3, 0, 64, "nta")  # its hardware prefetchers alone
    assert ck.walk_for(xeon) == (0, ck.PREFETCH_BYTES, 32, "t0")
    assert ck.walk_for("") == ck.walk_for(xeon)  # no /proc/cpuinfo: the Xeon's walk
    assert ck.walk_for(zen.replace("avx2", "avx512fake")) == ck.walk_for(zen)  # a whole flag, not a prefix
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            here = fh.read()
    except OSError:
        here = ""
    assert ck.default_walk() == ck.walk_for(here)


def test_unknown_prefetch_hint_and_least_claim_are_refused():
    with pytest.raises(ValueError, match="prefetch_hint"):
        CpuExpertRunner(threads=1, prefetch_hint="t3")
    for least in (0, 65):
        with pytest.raises(ValueError, match="least_rows"):
            CpuExpertRunner(threads=1, least_rows=least)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("row_block", [0, 2, 3])
def test_many_tokens_on_one_expert_and_untouched_rows(isa, threads, row_block):
    gen = torch.Generator().manual_seed(threads)
    (gu, dn), = make_experts(1, 96, 40, torch.bfloat16, gen)
    x = torch.randn(8, 96, generator=gen)
    tasks = [(gu, dn, t, 0.5 + t) for t in range(7)]  # 7 tokens: two passes of <= 4; row 7 has no task
    y0 = torch.randn(8, 96, generator=gen)
    y = y0.clone()
    CpuExpertRunner(threads=threads, isa=isa, row_block=row_block).run(tasks, x, y)
    assert torch.equal(y[7], y0[7])
    assert rel_err(y, y0, reference_experts(tasks, x)) < tolerance(isa, torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("row_block", [0, 3])
def test_experts_with_many_tokens_in_any_task_order(isa, threads, row_block):
    """Three experts with 11 tokens each (three passes of <= 4 tokens apiece): tasks given token by token (each
    expert's groups formed apart) add the same y, bit for bit, as the same tasks given expert by expert (each
    token meets its experts in the same order either way), and match the reference."""
    gen = torch.Generator().manual_seed(29 + threads)
    experts = make_experts(3, 130, 45, torch.bfloat16, gen)
    x = torch.randn(12, 130, generator=gen)
    token_major = [(*experts[e], t, 0.3 + 0.1 * e) for t in range(11) for e in range(3)]
    expert_major = [(*experts[e], t, 0.3 + 0.1 * e) for e in range(3) for t in range(11)]
    y0 = torch.randn(12, 130, generator=gen)
    ys = []
    for tasks in (token_major, expert_major):
        y = y0.clone()
        CpuExpertRunner(threads=threads, isa=isa, row_block=row_block).run(tasks, x, y)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])
    assert torch.equal(ys[0][11], y0[11])
    assert rel_err(ys[0], y0, reference_experts(expert_major, x)) < tolerance(isa, torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("row_block", [0, 1, 2, 3])
def test_worker_count_and_claim_size_leave_y_bit_identical(isa, row_block):
    """Every output row is one worker's, its sums in a fixed order: any worker count and claim size give the
    same bits (a prompt's experts run on more workers than decode's, cpu_runner.prompt_threads)."""
    gen = torch.Generator().manual_seed(41 + row_block)
    experts = make_experts(5, 130, 45, torch.bfloat16, gen)
    x = torch.randn(12, 130, generator=gen)
    tasks = [(*experts[e], t, 0.3 + 0.05 * t) for e in range(5) for t in range(0, 12, 1 + e % 3)]
    ys = []
    for threads, claim_rows in ((1, 64), (2, 7), (3, 32), (5, 16)):
        y = torch.zeros(12, 130)
        CpuExpertRunner(threads=threads, isa=isa, row_block=row_block, claim_rows=claim_rows).run(tasks, x, y)
        ys.append(y)
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("isa", ISAS)
def test_expert_block_layout_and_strided_x(isa):
    gen = torch.Generator().manual_seed(7)
    hidden, inter = 64, 33
    blocks = (torch.randn(3, 3 * inter * hidden, generator=gen) * 0.1).bfloat16()  # host pool: gate_up, down
    experts = [split_expert_block(blocks[e], hidden, inter) for e in range(3)]
    x = torch.randn(2, 2 * hidden, generator=gen)[:, ::2]  # non-unit inner stride: the wrapper copies
    tasks = [(*experts[e], t, 0.25) for t in range(2) for e in range(3)]
    y = torch.zeros(2, hidden)
    CpuExpertRunner(threads=2, isa=isa).run(tasks, x, y)
    ref = reference_experts(tasks, x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < tolerance(isa, torch.bfloat16)


def test_no_tasks_leaves_y_alone():
    y = torch.randn(2, 16)
    y0 = y.clone()
    CpuExpertRunner(threads=1).run([], torch.randn(2, 16), y)
    assert torch.equal(y, y0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_read_kernel_xors_every_word(isa, streams):
    buf = torch.randint(-2**62, 2**62, (100_003,), dtype=torch.int64)  # not a multiple of a page
    expect = 0
    for v in buf.view(torch.uint8).numpy().view("<u8"):
        expect ^= int(v)
    for threads in (1, 3):
        runner = CpuExpertRunner(threads=threads, isa=isa)
        for chunk in (0, 64, 4096, 1 << 16):  # static split, and chunks claimed in turn (the last one short)
            assert runner.read_bandwidth_pass(buf, streams, chunk) == expect


def test_read_streams_chunks_and_walk_are_checked():
    with pytest.raises(ValueError, match="streams"):
        CpuExpertRunner(threads=1).read_bandwidth_pass(torch.zeros(64), streams=3)
    with pytest.raises(ValueError, match="multiple of 64"):
        CpuExpertRunner(threads=1).read_bandwidth_pass(torch.zeros(64), chunk_bytes=100)
    with pytest.raises(ValueError, match="row_block"):
        CpuExpertRunner(threads=1, row_block=4)
