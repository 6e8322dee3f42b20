"""Our engine against transformers 5 (float32, CPU) on the synthetic checkpoints: logits within 1e-3."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.conftest import ARCHS
from tests.engine.util import prompt, reference_logits

TOL = 1e-3


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < TOL, f"max |ours - reference| = {err:.2e}"


def test_no_kernel_packages_reroute_the_reference():
    # With any of these importable, transformers silently swaps in Triton kernels that fail on CPU.
    for name in ("fla", "causal_conv1d", "kernels"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be installed in the CPU test env"


@pytest.mark.parametrize("arch", ARCHS)
def test_one_pass_logits(arch, engine_for, reference_for):
    ids = prompt(40)
    close(engine_for(arch).score(ids), reference_logits(reference_for(arch), ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_25_plus_15(arch, engine_for, reference_for):
    model, ids = engine_for(arch).model, prompt(40, seed=2)
    state = model.new_state()
    first = model.forward([(ids[:25], state)], logits="all")[0]
    second = model.forward([(ids[25:], state)], logits="all")[0]
    assert state.length == 40
    close(torch.cat([first, second]), reference_logits(reference_for(arch), ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_stepwise_decode(arch, engine_for, reference_for):
    model, ids = engine_for(arch).model, prompt(24, seed=3)
    state = model.new_state()
    rows = [model.forward([(ids[:8], state)], logits="last")[0]]
    rows += [model.forward([(ids[t : t + 1], state)], logits="last")[0] for t in range(8, 24)]
    close(torch.cat(rows), reference_logits(reference_for(arch), ids)[7:])


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_longer_than_two_chunks(arch, engine_for, reference_for):
    ids = prompt(150, seed=4)  # 64 + 64 + 22: the chunked delta rule carries state across chunks
    close(engine_for(arch).score(ids), reference_logits(reference_for(arch), ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_sixteen_greedy_tokens(arch, engine_for, reference_for):
    ids = prompt(20, seed=5)
    ours = engine_for(arch).generate(ids, max_new_tokens=16)
    ref_model, seq, expected = reference_for(arch), ids, []
    for _ in range(16):  # greedy by full recomputation: independent of any cache
        logits = reference_logits(ref_model, seq)
        expected.append(int(logits[-1].argmax()))
        seq = torch.cat([seq, torch.tensor(expected[-1:])])
    assert ours == expected
    close(engine_for(arch).score(seq), reference_logits(ref_model, seq))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_per_expert_layouts_agree(arch, engine_for):
    ids = prompt(30, seed=6)
    assert torch.equal(engine_for(arch, "fused").score(ids), engine_for(arch, "per_expert").score(ids))


def test_bf16_error_no_worse_than_transformers(checkpoints, engine_for, reference_for):
    """bf16 rounding drifts a random tiny MoE by ~14%; ours must drift no more than the reference does."""
    import transformers

    from engine import Engine

    ids = prompt(60, seed=7)
    exact = reference_logits(reference_for("qwen3_5_moe"), ids)
    ours = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], dtype="bfloat16").score(ids)
    ref_bf16 = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        checkpoints["qwen3_5_moe", "fused"], dtype=torch.bfloat16, experts_implementation="eager").eval()
    theirs = reference_logits(ref_bf16, ids)
    rel = lambda a: ((a - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(ours) < 1.5 * rel(theirs) + 1e-3, (rel(ours), rel(theirs))
