"""engine.build: the one factory behind serve/demo/replay picks the expert backend and cache as asked."""
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


def test_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="--max-running"):
        EngineOptions(max_running=0)
    with pytest.raises(ValueError, match="--cache-host-mb"):
        EngineOptions(cache_host_mb=0)
