"""The tile path (KernelTable::tile): calls whose experts average tile_tokens tokens or more run up to 16 tokens
a pass over each expert's weights, activations packed in bf16 pairs. On 'scalar' (its reference tile kernel,
every machine) and on 'amx' where this machine has it, against the float64 reference and the vector path."""
import os

import pytest
import torch

from engine.experts import cpu_kernels as ck
from engine.experts.cpu_kernels import CpuExpertRunner
from engine.experts.cpu_tasks import reference_experts

if os.environ.get("KILLICK_REQUIRE_NATIVE") == "1":
    assert ck.native_available(), "KILLICK_REQUIRE_NATIVE=1 but native/_cpu_experts is not built"
pytestmark = pytest.mark.skipif(not ck.native_available(), reason="native extension not built")

TILE_ISAS = [isa for isa in ("scalar", "amx") if isa in ck.supported_isas()]
BF16_TOL = 1e-2  # x and the SwiGLU output go through bf16 on the tile path


def make_table(n, hidden, inter, gen):
    blocks = (torch.randn(n, 3 * inter * hidden, generator=gen) * 0.1).bfloat16()
    return ck.ExpertTable.from_blocks(blocks, hidden, inter)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def routed(n_experts, tokens, per_token, gen):
    """Token-major top-k routing: each token's experts distinct, popular experts take many tokens."""
    experts, toks, weights = [], [], []
    for t in range(tokens):
        for e in torch.randperm(n_experts, generator=gen)[:per_token].tolist():
            experts.append(e)
            toks.append(t)
            weights.append(0.2 + 0.1 * (e % 5))
    return experts, toks, weights


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 64), (160, 96)])
@pytest.mark.parametrize("tokens", [5, 16, 37])
def test_tile_path_matches_reference(isa, hidden, inter, tokens):
    """Experts with 1 to ~30 tokens (passes of 16 and a remainder), tasks token by token, added into y."""
    gen = torch.Generator().manual_seed(hidden + tokens)
    table = make_table(4, hidden, inter, gen)
    experts, toks, weights = routed(4, tokens, 3, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    y0 = torch.randn(tokens, hidden, generator=gen)
    y = y0.clone()
    runner = CpuExpertRunner(threads=3, isa=isa, tile_tokens=2, claim_rows=16)
    runner.run_routed(table, experts, toks, weights, x, y)
    assert runner.last_call_tiles
    ref = reference_experts(table.tasks(experts, toks, weights), x)
    assert rel_err(y - y0, ref) < BF16_TOL


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_tile_gather_reads_and_writes_both_formats_and_follows_the_vector_path(isa):
    """run_gather (the engine's call) on the tile path: x in f32 or bf16, out in f32 or bf16, each task's row
    overwritten; within bf16 rounding of the vector path on the same tasks."""
    gen = torch.Generator().manual_seed(3)
    hidden, inter = 128, 64
    table = make_table(6, hidden, inter, gen)
    experts, toks, _ = routed(6, 24, 4, gen)
    x = torch.randn(24, hidden, generator=gen)
    tiles = CpuExpertRunner(threads=2, isa=isa, tile_tokens=4)
    vector = CpuExpertRunner(threads=2, isa=isa, tile_tokens=0)
    ref = reference_experts(table.tasks(experts, toks, [1.0] * len(experts)), x)
    for xin in (x, x.bfloat16()):
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((len(experts), hidden), float("nan"), dtype=dtype)
            tiles.run_gather(table, experts, toks, xin, out)
            assert tiles.last_call_tiles
            want = torch.empty(len(experts), hidden, dtype=dtype)
            vector.run_gather(table, experts, toks, xin, want)
            assert not vector.last_call_tiles
            assert not out.isnan().any()
            assert rel_err(out.float(), want.double()) < BF16_TOL
            summed = torch.zeros(24, hidden, dtype=torch.float64).index_add_(0, torch.tensor(toks), out.double())
            assert rel_err(summed, ref) < BF16_TOL


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_worker_count_and_claim_size_leave_tile_results_bit_identical(isa):
    """Claims of odd sizes split the SwiGLU outputs' bf16 pairs between workers (each writes its half of a
    word): any worker count and claim size give the same bits."""
    gen = torch.Generator().manual_seed(5)
    hidden, inter = 96, 96
    table = make_table(5, hidden, inter, gen)
    experts, toks, weights = routed(5, 30, 2, gen)
    x = torch.randn(30, hidden, generator=gen)
    ys = []
    for threads, claim_rows in ((1, 64), (2, 7), (3, 13), (4, 1)):
        y = torch.zeros(30, hidden)
        runner = CpuExpertRunner(threads=threads, isa=isa, tile_tokens=2, claim_rows=claim_rows)
        runner.run_routed(table, experts, toks, weights, x, y)
        assert runner.last_call_tiles
        ys.append(y)
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_tile_path_only_where_it_applies(isa):
    """Too few tokens an expert, sizes that are not multiples of 32, fp32 weights or tile_tokens=0: the vector
    kernels, with the same results as a runner that never tiles."""
    gen = torch.Generator().manual_seed(9)
    runner = CpuExpertRunner(threads=2, isa=isa, tile_tokens=6)
    table = make_table(8, 64, 32, gen)
    x = torch.randn(8, 64, generator=gen)
    experts, toks, weights = routed(8, 8, 4, gen)  # 32 tasks on <= 8 experts: ~4 tokens an expert
    y = torch.zeros(8, 64)
    runner.run_routed(table, experts, toks, weights, x, y)
    assert not runner.last_call_tiles
    y_vec = torch.zeros(8, 64)
    CpuExpertRunner(threads=2, isa=isa, tile_tokens=0).run_routed(table, experts, toks, weights, x, y_vec)
    assert torch.equal(y, y_vec)
    many = [e for e in range(2) for _ in range(8)], [t for _ in range(2) for t in range(8)]
    runner.run_routed(table, *many, [0.5] * 16, x, torch.zeros(8, 64))
    assert runner.last_call_tiles
    odd = make_table(2, 72, 32, gen)  # hidden 72: not a multiple of 32
    runner.run_routed(odd, *many, [0.5] * 16, torch.randn(8, 72, generator=gen), torch.zeros(8, 72))
    assert not runner.last_call_tiles
    f32 = ck.ExpertTable.from_blocks(torch.randn(2, 3 * 32 * 64, generator=gen) * 0.1, 64, 32)
    runner.run_routed(f32, *many, [0.5] * 16, x, torch.zeros(8, 64))
    assert not runner.last_call_tiles
    never = CpuExpertRunner(threads=2, isa=isa, tile_tokens=0)
    never.run_routed(table, *many, [0.5] * 16, x, torch.zeros(8, 64))
    assert not never.last_call_tiles


def test_tile_tokens_is_checked_and_defaults_by_isa():
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ValueError, match="tile_tokens"):
            CpuExpertRunner(threads=1, tile_tokens=bad)
    assert CpuExpertRunner(threads=1, isa="scalar").tile_tokens == 0  # the reference only when asked
    best = CpuExpertRunner(threads=1)
    assert best.tile_tokens == (ck.TILE_TOKENS if best.isa == "amx" else 0)
