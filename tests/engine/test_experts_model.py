"""Acceptance on CPU: greedy output of the tiny hybrid (qwen3_5_moe) and qwen3_moe checkpoints is identical
for every slot backend and every slot count from 1 to all experts, and equals the fused reference."""
import pytest
import torch

from engine import Engine
from engine.experts.host_pool import pool_from_source
from engine.experts.policy import BandwidthEstimate
from engine.experts.registry import experts_factory
from engine.loader import load_checkpoint

PROMPT = [(7 * i + 3) % 250 for i in range(40)]  # long enough to stream layers when two buffers fit
NEW = 10


def slot_counts(cfg_layers: int, experts: int) -> list[int]:
    return sorted({1, 2, experts - 1, 2 * experts, cfg_layers * experts})


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
def test_greedy_identical_for_every_backend_and_slot_count(checkpoints, engine_for, arch, backend):
    ref_engine = engine_for(arch)
    ref = ref_engine.generate(PROMPT, NEW)
    source = load_checkpoint(checkpoints[arch, "fused"])[2]
    for slots in slot_counts(len(source.layers), source.num_experts):
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)  # hybrid: a third filled (q_balanced)
        eng = Engine.from_pretrained(checkpoints[arch, "fused"], experts=experts_factory(
            backend, slots=slots, estimate=est), expert_device="cpu")
        assert eng.generate(PROMPT, NEW) == ref, f"{backend} with {slots} slots"
        stats = eng.model.experts.stats()
        st = stats["total"]
        if backend == "offload":  # the 40-token prompt streams whole layers whenever two buffers fit
            assert (stats["streamed_forwards"] > 0) == (slots >= 2 * source.num_experts)
        assert st["hits"] + st["misses"] > 0 and 0.0 <= st["hit_rate"] <= 1.0
        if backend == "cpu":
            assert st["cpu_runs"] == st["misses"]
        eng.model.experts.close()


def test_pool_identical_for_fused_and_per_expert_checkpoints(checkpoints):
    pools = [pool_from_source(load_checkpoint(checkpoints["qwen3_moe", lay])[2])
             for lay in ("fused", "per_expert")]
    assert pools[0].layers == pools[1].layers == [0, 2]  # layer 1 is a dense mlp_only layer
    for a, b in zip(pools[0].buffers, pools[1].buffers):
        assert torch.equal(a, b)


def test_auto_picks_fused_when_experts_fit(checkpoints):
    eng = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], experts=experts_factory("auto"))
    assert eng.model.experts.name == "fused"
    small = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], expert_device="cpu",
                                   experts=experts_factory("auto", slots=3, free_bytes=1, profile={}))
    assert small.model.experts.name == "offload"
    small.model.experts.close()


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_pool_filled_straight_from_safetensors(checkpoints, engine_for, layout):
    """expert_device="meta": the loader keeps only shapes; the pool reads the files itself."""
    path = checkpoints["qwen3_moe", layout]
    eng = Engine.from_pretrained(path, expert_device="meta", experts=experts_factory(
        "hybrid", slots=3, checkpoint=path, background=True))
    direct = eng.model.experts.pool.wait()
    loaded = pool_from_source(load_checkpoint(path)[2])
    assert all(torch.equal(a, b) for a, b in zip(direct.buffers, loaded.buffers))
    assert eng.generate(PROMPT, NEW) == engine_for("qwen3_moe").generate(PROMPT, NEW)
    eng.model.experts.close()


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_greedy_identical_after_the_idle_refresh(checkpoints, engine_for, backend):
    """--moe-refresh on: idle time between two requests moves the hottest experts into the slots (lru kept the
    latest ones there); the next request's greedy tokens are the reference's (what the slots hold never
    changes the output)."""
    ref = engine_for("qwen3_5_moe").generate(PROMPT, NEW)
    source = load_checkpoint(checkpoints["qwen3_5_moe", "fused"])[2]
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    eng = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], experts=experts_factory(
        backend, slots=source.num_experts, estimate=est, refresh="on", slot_policy="lru"), expert_device="cpu")
    assert eng.generate(PROMPT, NEW) == ref
    moved = 0
    for _ in range(100):  # bounded: each call moves up to REFRESH_FILLS experts, or none once the slots settled
        n = eng.model.experts.refresh()
        moved += n
        if n == 0:
            break
    assert moved > 0 and eng.model.experts.stats()["total"]["refreshed"] == moved
    assert eng.generate(PROMPT, NEW) == ref
    eng.model.experts.close()


@pytest.mark.parametrize("backend", ["cpu", "hybrid", "offload"])
def test_warm_up_sizes_the_cpu_shares_buffers_so_a_prompt_grows_none(checkpoints, backend):
    """warm_up reserves the CPU share's output buffers for a prompt piece (OffloadBackend.reserve): a prompt's CPU
    job then writes into them, none grown during the request. Offload runs nothing on the CPU and reserves
    nothing. Greedy output as the fused engine's."""
    ref = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"]).generate(PROMPT, NEW)
    made = {}
    for warm in (False, True):
        eng = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], expert_device="cpu", experts=experts_factory(
            backend, slots=3, estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), stream_prefill="off"))
        jobs = eng.model.experts.cpu_jobs
        if warm:
            eng.model.warm_up(64)
        before = {k: v[1].data_ptr() for k, v in jobs._out.items()}
        assert eng.generate(PROMPT, NEW) == ref
        made[warm] = {k: v[1].data_ptr() for k, v in jobs._out.items()}
        if warm:
            assert made[warm] == before  # (the same buffers, or none for offload)
            assert (len(before) > 0) == (backend != "offload")
            assert all(v[0].shape[0] >= 64 * eng.model.config.top_k for v in jobs._out.values())
        eng.model.experts.close()
    if backend != "offload" and not made[False]:
        pytest.skip("the CPU jobs ran without the native runner's output buffers")
