"""Config normalisation: both spellings of every key, per-architecture defaults, unsupported models."""
from __future__ import annotations

import json

import pytest

from engine.config import FULL, LINEAR, config_from_dict, load_config

QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 rope_theta=1e6)

QWEN35_TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def test_expert_count_spellings_agree():
    new = dict(QWEN3_MOE, num_local_experts=4)
    del new["num_experts"]
    assert config_from_dict(new) == config_from_dict(QWEN3_MOE)


def test_rope_spellings_agree():
    new = dict(QWEN3_MOE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del new["rope_theta"]
    assert config_from_dict(new) == config_from_dict(QWEN3_MOE)
    old = dict(QWEN35_TEXT, rope_theta=1e7, partial_rotary_factor=0.25)
    del old["rope_parameters"]
    wrap = lambda text: {"model_type": "qwen3_5_moe", "text_config": text}  # noqa: E731
    assert config_from_dict(wrap(old)) == config_from_dict(wrap(QWEN35_TEXT))
    assert config_from_dict(wrap(QWEN35_TEXT)).rotary_dim == 4


def test_layer_type_spellings_agree():
    wrap = lambda text: {"model_type": "qwen3_5_moe", "text_config": text}  # noqa: E731
    by_interval = config_from_dict(wrap(dict(QWEN35_TEXT, full_attention_interval=4)))
    listed = config_from_dict(wrap(dict(QWEN35_TEXT, layer_types=[LINEAR] * 3 + [FULL] + [LINEAR] * 3 + [FULL])))
    assert by_interval == listed and by_interval.layer_types[3] == FULL and by_interval.layer_types.count(FULL) == 2
    assert config_from_dict(wrap(QWEN35_TEXT)).layer_types == listed.layer_types  # default interval is 4


def test_router_renormalisation_defaults():
    assert config_from_dict(QWEN3_MOE).norm_topk_prob is False  # transformers' default when the key is absent
    assert config_from_dict(dict(QWEN3_MOE, norm_topk_prob=True)).norm_topk_prob is True
    qwen35 = config_from_dict({"model_type": "qwen3_5_moe", "text_config": QWEN35_TEXT})
    assert qwen35.norm_topk_prob is True and qwen35.zero_centered_norm and qwen35.attn_output_gate
    assert qwen35.weight_prefix == "model.language_model."


def test_qwen3_moe_dense_layers():
    cfg = config_from_dict(dict(QWEN3_MOE, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.dense_layers == (0, 2, 3) and cfg.moe_layers == (1,)


def test_unsupported_architecture_names_file_and_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*'llama'.*qwen3_5_moe, qwen3_moe, qwen3_next"):
        load_config(tmp_path)


def test_missing_key_names_the_file():
    broken = dict(QWEN3_MOE)
    del broken["hidden_size"]
    with pytest.raises(ValueError, match="x/config.json.*hidden_size"):
        config_from_dict(broken, source="x/config.json")


def test_qwen3_next_is_the_hybrid_with_top_level_keys():
    raw = dict(QWEN35_TEXT, model_type="qwen3_next", full_attention_interval=2, mlp_only_layers=[0],
               intermediate_size=64)
    cfg = config_from_dict(raw)
    assert cfg.weight_prefix == "model." and cfg.zero_centered_norm and cfg.attn_output_gate
    assert cfg.norm_topk_prob is True and cfg.dense_layers == (0,) and cfg.layer_types[:2] == (LINEAR, FULL)
    assert config_from_dict(dict(raw, norm_topk_prob=False)).norm_topk_prob is False
