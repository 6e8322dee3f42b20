"""Every mistake a user can make with a model directory is a ValueError naming the file or key and the fix."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.models import load_model


@pytest.fixture
def model_copy(checkpoints, tmp_path):
    """A private copy of the tiny qwen3_5_moe checkpoint to break."""
    return shutil.copytree(checkpoints["qwen3_5_moe", "fused"], tmp_path / "model")


def text_shard(model_dir):
    return model_dir / "model-00001-of-00002.safetensors"


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope'} does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config_json(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json not found"):
        Engine.from_pretrained(model_copy)


def test_unsupported_architecture(model_copy):
    raw = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(dict(raw, model_type="mixtral")))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture.*'mixtral'.*qwen3_5_moe"):
        load_model(model_copy)


def test_tensor_shape_mismatch_names_key_expected_and_got(model_copy):
    raw = json.loads((model_copy / "config.json").read_text())
    raw["text_config"]["moe_intermediate_size"] = 48  # config no longer matches the weights
    (model_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'model\.language_model\.layers\.0\.mlp\.experts\.gate_up_proj' "
                                         r"has shape \(8, 64, 64\), expected \(8, 96, 64\)"):
        load_model(model_copy)


def test_missing_tensor_names_the_key(model_copy):
    shard = text_shard(model_copy)
    tensors = load_file(shard)
    del tensors["model.language_model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=r"'model\.language_model\.layers\.1\.self_attn\.k_norm\.weight' is missing"):
        load_model(model_copy)


def test_corrupt_safetensors_header(model_copy):
    text_shard(model_copy).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors: not a readable safetensors file"):
        load_model(model_copy)


def test_truncated_safetensors_file(model_copy):
    shard = text_shard(model_copy)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors.*re-download"):
        load_model(model_copy)


def test_missing_shard_listed_in_index(model_copy):
    text_shard(model_copy).unlink()
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors is listed in .* but missing"):
        load_model(model_copy)


def test_visual_and_mtp_tensors_are_skipped(checkpoints):
    files = checkpoints["qwen3_5_moe", "fused"].glob("*.safetensors")
    on_disk = {k for f in files for k in load_file(f)}
    assert any(k.startswith("model.visual.") for k in on_disk) and any(k.startswith("mtp.") for k in on_disk)
    model = load_model(checkpoints["qwen3_5_moe", "fused"])
    assert model.forward([(torch.tensor([1, 2, 3]), model.new_state())])[0].shape == (1, 256)
