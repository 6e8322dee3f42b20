"""Session fixtures: synthetic checkpoints (generated once) and transformers reference models."""
from __future__ import annotations

import pytest
import torch

from engine.synth import synth_checkpoint

ARCHS = ("qwen3_5_moe", "qwen3_moe", "qwen3_next")
LAYOUTS = ("fused", "per_expert")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """(arch, layout) -> checkpoint dir, same seed so both layouts hold identical weights."""
    root = tmp_path_factory.mktemp("ckpt")
    return {(a, lay): synth_checkpoint(root / f"{a}-{lay}", arch=a, layout=lay, seed=0)
            for a in ARCHS for lay in LAYOUTS}


_engines: dict = {}
_references: dict = {}


@pytest.fixture(scope="session")
def engine_for(checkpoints):
    from engine import Engine

    def get(arch: str, layout: str = "fused"):
        if (arch, layout) not in _engines:
            _engines[arch, layout] = Engine.from_pretrained(checkpoints[arch, layout], device="cpu", dtype="float32")
        return _engines[arch, layout]

    return get


@pytest.fixture(scope="session")
def reference_for(checkpoints):
    """transformers' own model on the same files, float32, eager experts (the reference numerics)."""

    def get(arch: str):
        if arch not in _references:
            import transformers

            cls = {"qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
                   "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "qwen3_next": transformers.Qwen3NextForCausalLM}[arch]
            model = cls.from_pretrained(checkpoints[arch, "fused"], dtype=torch.float32,
                                        experts_implementation="eager")
            _references[arch] = model.eval()
        return _references[arch]

    return get
