"""The synthetic checkpoint generator: deterministic, bf16-exact, real layouts, demo size, tokenizer copy."""
from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from engine import Engine
from engine.config import load_config
from engine.synth import synth_checkpoint


def tensors_of(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, checkpoints):
    again = synth_checkpoint(tmp_path / "again", arch="qwen3_5_moe", layout="fused", seed=0)
    first = checkpoints["qwen3_5_moe", "fused"]
    for f in first.glob("*"):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = tensors_of(synth_checkpoint(tmp_path / "other", seed=1))
    assert not torch.equal(other["lm_head.weight"], tensors_of(first)["lm_head.weight"])


def test_real_layout_names_and_bf16_values(checkpoints):
    fused = tensors_of(checkpoints["qwen3_5_moe", "fused"])
    p = "model.language_model.layers.0.mlp.experts."
    assert fused[p + "gate_up_proj"].shape == (8, 64, 64) and fused[p + "down_proj"].shape == (8, 64, 32)
    assert all(t.dtype == torch.bfloat16 for t in fused.values())
    per = tensors_of(checkpoints["qwen3_5_moe", "per_expert"])
    assert torch.equal(per[p + "3.up_proj.weight"], fused[p + "gate_up_proj"][3, 32:])
    assert torch.equal(per[p + "3.down_proj.weight"], fused[p + "down_proj"][3])
    qwen3 = tensors_of(checkpoints["qwen3_moe", "per_expert"])
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in qwen3 and "model.layers.1.mlp.gate_proj.weight" in qwen3


def test_norm_weights_are_randomised(checkpoints):
    t = tensors_of(checkpoints["qwen3_5_moe", "fused"])
    centred = t["model.language_model.layers.0.input_layernorm.weight"].float()  # used as 1 + w
    assert centred.std() > 0.1 and centred.mean().abs() < 0.3
    gated = t["model.language_model.layers.0.linear_attn.norm.weight"].float()  # used as w
    assert gated.std() > 0.1 and (gated.mean() - 1).abs() < 0.3
    plain = tensors_of(checkpoints["qwen3_moe", "fused"])["model.norm.weight"].float()  # qwen3_moe: w
    assert plain.std() > 0.1 and (plain.mean() - 1).abs() < 0.3


def test_demo_size_is_fast_and_takes_the_vocab_and_tokenizer(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    start = time.perf_counter()
    out = synth_checkpoint(tmp_path / "demo", size="demo", vocab_size=1000, tokenizer=tok)
    assert time.perf_counter() - start < 10
    cfg = load_config(out)
    assert cfg.vocab_size == 1000 and cfg.layer_types.count("full_attention") == 2 and cfg.num_layers == 8
    assert (out / "tokenizer.json").read_text() == '{"model": {}}' and (out / "chat_template.jinja").is_file()
    eng = Engine.from_pretrained(out)
    assert len(eng.generate([1, 2, 3], max_new_tokens=4)) == 4
    assert json.loads((out / "config.json").read_text())["text_config"]["eos_token_id"] == 999


def test_bad_arguments_and_missing_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        synth_checkpoint(tmp_path / "x", arch="llama")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        synth_checkpoint(tmp_path / "y", tokenizer=tmp_path)
    assert not (tmp_path / "y").exists()  # checked before anything is written
