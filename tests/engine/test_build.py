"""engine.build: the one factory behind serve/demo/replay picks the expert backend and cache as asked."""
import os
import threading

import pytest

from engine.api import GenerateRequest
from engine.build import EngineOptions, build_core
from tests.engine.test_runner import run_all


@pytest.mark.parametrize("backend, cls", [("auto", "FusedExperts"), ("hybrid", "HybridBackend"),
                                          ("offload", "OffloadBackend")])
def test_backend_choice_never_changes_greedy_output(checkpoints, engine_for, backend, cls):
    path = checkpoints["qwen3_5_moe", "fused"]
    core = build_core(path, EngineOptions(moe_backend=backend, moe_slots="25%" if backend != "auto" else None))
    assert type(core.runner.model.experts).__name__ == cls  # auto: every expert fits on this device
    prompt = list(range(3, 40))
    with core:
        (out,), _ = run_all(core, [GenerateRequest(prompt, 8)])
    assert out == engine_for("qwen3_5_moe").generate(prompt, max_new_tokens=8)


def test_auto_with_slots_asked_for_is_an_expert_cache_of_that_size(checkpoints, caplog):
    """--moe-slots caps the device's experts: auto judges whether they fit against the cap (every expert fits on
    this device, so without it auto is fused); fused with --moe-slots says the slots go unused."""
    path = checkpoints["qwen3_5_moe", "fused"]
    experts = build_core(path, EngineOptions(moe_slots="25%")).runner.model.experts
    assert type(experts).__name__ in ("OffloadBackend", "HybridBackend")
    assert experts.cache.num_slots == round(0.25 * len(experts.pool.layers) * experts.pool.num_experts)
    assert type(build_core(path, EngineOptions(moe_slots="100%")).runner.model.experts).__name__ == "FusedExperts"
    with caplog.at_level("WARNING", logger="killick.engine"):
        build_core(path, EngineOptions(moe_backend="fused", moe_slots="25%"))
    assert "--moe-slots 25% left unused" in caplog.text


def test_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="--max-running"):
        EngineOptions(max_running=0)
    with pytest.raises(ValueError, match="--cache-host-mb"):
        EngineOptions(cache_host_mb=0)
    with pytest.raises(ValueError, match="--max-queue must be at least 1"):  # 0 refused every request with a 429
        EngineOptions(max_queue=0)


def test_context_window_follows_the_config_within_memory():
    from engine.build import DEFAULT_CONTEXT, context_window

    # Qwen3.6-35B-A3B on an H200 quarter: 5 sequences x 262144 tokens x 20 KiB + 63 MB each fit in 35 GB
    tokens, why = context_window(262144, 20 << 10, 63 << 20, 5, 35 << 30)
    assert tokens == 262144 and "max_position_embeddings (262144)" in why
    # a 24 GB card's quarter: lowered to what fits, a multiple of 1024, and the log says so
    tokens, why = context_window(262144, 20 << 10, 63 << 20, 5, 6 << 30)
    assert tokens == 59392 and 5 * (tokens * (20 << 10) + (63 << 20)) <= 6 << 30
    assert why.startswith("lowered from") and "--context-length" in why
    assert context_window(0, 1024, 0, 5, 1 << 40)[0] == DEFAULT_CONTEXT       # nothing declared


def test_an_expert_cache_leaves_room_for_states_and_a_prefill_step_on_cuda():
    """--moe-slots unset takes the device memory left after device_reserve: the fast path's state slots and a
    prefill step's transient tensors (else a model larger than the device fills it with slots)."""
    import torch

    from engine.build import ACTIVATION_BYTES_PER_HIDDEN, ACTIVATION_FLOOR, device_reserve, state_bytes
    from engine.config import config_from_dict
    from engine.synth import synth_config

    cfg = config_from_dict(synth_config("qwen3_5_moe", "qwen3.6-35b-a3b", layers=8))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_token, per_sequence = state_bytes(cfg, 2)
    opts = EngineOptions(max_running=3, max_step_tokens=16384)
    states = 4 * (1001 * per_token + per_sequence)
    assert device_reserve(cfg, opts, cuda, 1000, 2) == states + 16384 * cfg.hidden_size * ACTIVATION_BYTES_PER_HIDDEN
    assert device_reserve(cfg, EngineOptions(max_running=3), cuda, 1000, 2) == states + ACTIVATION_FLOOR  # 2048
    assert device_reserve(cfg, EngineOptions(max_running=3, fast_path=False), cuda, 1000, 2) == ACTIVATION_FLOOR
    assert device_reserve(cfg, opts, cpu, 1000, 2) == 0  # a CPU engine's slots are host memory


def test_serve_context_defaults_to_the_declared_window(checkpoints, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="killick.engine"):
        core = build_core(checkpoints["qwen3_5_moe", "fused"], EngineOptions(prefix_cache=False))
    assert core.runner.context_length == 262144                    # synth writes the real family's value
    assert "context length 262144 tokens: the model's max_position_embeddings" in caplog.text
    core = build_core(checkpoints["qwen3_5_moe", "fused"], EngineOptions(prefix_cache=False, context_length=4096))
    assert core.runner.context_length == 4096


def test_a_prompts_cpu_experts_leave_three_cores_on_cuda(monkeypatch):
    """On a 16-core CUDA box a prompt's CPU experts get 13 workers: the engine thread, the job's waiting thread
    and the driver's threads keep three cores (15 or 16 workers ran the box's extends slower than 14, 13 faster);
    decode keeps half the cores, and --prompt-expert-threads overrides."""
    import torch

    from engine.build import expert_threads, prompt_expert_threads
    from engine.experts import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "physical_cores", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cuda = torch.device("cuda")
    assert expert_threads(EngineOptions(), cuda) == 8
    assert prompt_expert_threads(EngineOptions(), cuda) == 13
    assert prompt_expert_threads(EngineOptions(prompt_expert_threads=5), cuda) == 5
    assert prompt_expert_threads(EngineOptions(), torch.device("cpu")) == expert_threads(EngineOptions(),
                                                                                         torch.device("cpu"))


def test_expert_threads_are_the_engines_own_setting(checkpoints):
    """--expert-threads sets the native CPU expert workers; without it a CPU engine gives them every core.
    --prompt-expert-threads sets a prompt's (default: the same on a CPU engine, all cores but three on CUDA);
    --expert-tile-tokens and --cpu-join reach the runner and the CPU jobs."""
    import torch

    from engine.build import expert_threads, prompt_expert_threads
    from engine.experts import cpu_jobs, cpu_runner
    from engine.experts.cpu_kernels import physical_cores

    path = checkpoints["qwen3_5_moe", "fused"]
    before, before_prompt, before_join = cpu_runner._threads[0], cpu_runner._prompt_threads[0], cpu_jobs.JOIN_ON_DEVICE
    try:
        core = build_core(path, EngineOptions(moe_backend="hybrid", moe_slots="25%", expert_threads=1))
        assert cpu_runner.expert_threads() == 1 and cpu_runner.prompt_threads() == 1  # CPU: the same by default
        core.runner.model.experts.close()
        core = build_core(path, EngineOptions(moe_backend="hybrid", moe_slots="25%", expert_threads=1,
                                              prompt_expert_threads=2))
        assert cpu_runner.expert_threads() == 1 and cpu_runner.prompt_threads() == 2
        core.runner.model.experts.close()
        assert expert_threads(EngineOptions(), torch.device("cpu")) == torch.get_num_threads()
        cores, on_cuda = len(os.sched_getaffinity(0)), expert_threads(EngineOptions(), torch.device("cuda"))
        assert 1 <= on_cuda <= max(1, cores // 2) and (on_cuda <= cores - 2 or on_cuda == 1)
        prompt_on_cuda = prompt_expert_threads(EngineOptions(), torch.device("cuda"))
        assert prompt_on_cuda == max(on_cuda, min(physical_cores(), cores) - 3)  # all but three, >= decode's
        # --expert-tile-tokens reaches the runners (0: never; they ignore it where the ISA has no tiles)
        core = build_core(path, EngineOptions(moe_backend="hybrid", moe_slots="25%", expert_threads=1,
                                              expert_tile_tokens=0))
        if cpu_runner.NATIVE:
            assert cpu_runner._tile_tokens[0] == 0 and cpu_runner.native_runner(1).tile_tokens == 0
        core.runner.model.experts.close()
        # --cpu-join: where a prompt's CPU experts join (the device by default)
        assert EngineOptions().cpu_join == "device"
        core = build_core(path, EngineOptions(moe_backend="hybrid", moe_slots="25%", expert_threads=1,
                                              cpu_join="host"))
        assert cpu_jobs.JOIN_ON_DEVICE is False
        core.runner.model.experts.close()
        core = build_core(path, EngineOptions(moe_backend="hybrid", moe_slots="25%", expert_threads=1))
        assert cpu_jobs.JOIN_ON_DEVICE is True
        core.runner.model.experts.close()
    finally:
        cpu_runner.set_threads(before)
        cpu_runner.set_prompt_threads(before_prompt)
        cpu_runner.set_tile_tokens(None)
        cpu_jobs.set_join_on_device(before_join)
    with pytest.raises(ValueError, match="--expert-threads"):
        EngineOptions(expert_threads=0)
    with pytest.raises(ValueError, match="--prompt-expert-threads"):
        EngineOptions(prompt_expert_threads=0)
    with pytest.raises(ValueError, match="--expert-tile-tokens"):
        EngineOptions(expert_tile_tokens=-1)
    with pytest.raises(ValueError, match="--cpu-join must be device or host"):
        EngineOptions(cpu_join="gpu")
    with pytest.raises(ValueError, match="tile tokens"):
        cpu_runner.set_tile_tokens(-2)


def test_overlap_is_on_by_default_on_cuda_only_and_no_overlap_turns_it_off(checkpoints):
    """serve's --no-overlap reaches the runner (EngineOptions.overlap); without it the runner overlaps decode
    steps on CUDA only (on the CPU a queued step runs at once: nothing to overlap)."""
    import argparse

    from engine.build import add_engine_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert options_from_args(p.parse_args([])).overlap is True
    off = options_from_args(p.parse_args(["--no-overlap"]))
    assert off.overlap is False
    path = checkpoints["qwen3_5_moe", "fused"]
    assert build_core(path, EngineOptions(prefix_cache=False, context_length=256)).runner.overlap is False  # CPU
    assert build_core(path, off).runner.overlap is False


def test_stop_ends_the_cpu_expert_worker_and_a_later_core_starts_it_again(checkpoints):
    """An expert cache that runs its misses on the CPU posts its jobs to the native runner (kept with
    the runner's pool, shared by every core) or, without the extension, starts a Python worker thread with its
    first job; EngineCore.stop waits for the last job and ends the worker, and every other thread the core started
    (again: nothing happens); a core built later over the same model runs its jobs again and answers as the first
    did."""
    path = checkpoints["qwen3_5_moe", "fused"]
    opts = EngineOptions(moe_backend="cpu", moe_slots="25%", prefix_cache=False)
    prompt = list(range(3, 40))
    before = set(threading.enumerate())
    core = build_core(path, opts)
    jobs = core.runner.model.experts.cpu_jobs
    with core:
        (out,), _ = run_all(core, [GenerateRequest(prompt, 8)])
        assert _jobs_ran(jobs)
    assert set(threading.enumerate()) <= before
    core.stop()
    assert set(threading.enumerate()) <= before and not _jobs_ran(jobs)
    with build_core(path, opts, model=core.runner.model) as again:
        assert run_all(again, [GenerateRequest(prompt, 8)])[0] == [out] and _jobs_ran(jobs)
    assert not _jobs_ran(jobs)


def _jobs_ran(jobs) -> bool:
    """A CPU job was posted to the native runner (not yet waited for by close()), or a Python worker runs."""
    from engine.experts import cpu_runner

    workers = [t for t in threading.enumerate() if t.name.startswith("experts-cpu")]
    return jobs._posted is not None if cpu_runner.NATIVE else bool(workers)
