"""ModelConfig: one frozen, normalised view of a Hugging Face config.json.

Real checkpoints and transformers-5 re-saves spell the same things differently (`num_experts` vs
`num_local_experts`, top-level `rope_theta` vs `rope_parameters`, `layer_types` vs
`full_attention_interval`); everything past this file sees only our own field names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("qwen3_5_moe", "qwen3_moe", "qwen3_next")

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHITECTURES
    weight_prefix: str  # where the text model's tensors live: "model.language_model." or "model."
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # LINEAR (gated DeltaNet) or FULL (attention), one per layer
    rms_norm_eps: float
    zero_centered_norm: bool  # RMSNorm scales by (1 + w) instead of w (Qwen3.5 / Qwen3-Next)
    tie_word_embeddings: bool
    # full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading part of each head that RoPE rotates (partial RoPE)
    rope_theta: float
    attn_output_gate: bool  # q_proj also yields a per-channel sigmoid gate on the attention output
    # gated DeltaNet (unused when there are no linear layers)
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    conv_kernel: int
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    dense_layers: tuple[int, ...]  # layers with a dense MLP instead of MoE (Qwen3-MoE mlp_only_layers)
    intermediate_size: int  # dense MLP width (dense_layers only)
    eos_token_ids: tuple[int, ...] = ()
    max_positions: int = 0  # max_position_embeddings: the longest sequence the model declares (0: not said)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def conv_dim(self) -> int:  # channels through the causal conv: q, k and v side by side
        return 2 * self.linear_key_dim + self.linear_value_dim


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json`; raises ValueError naming the file on anything we cannot serve."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: a model directory needs the config.json of its Hugging Face checkpoint")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore the file from the original checkpoint") from e
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "qwen3_5_moe":
        text = dict(raw.get("text_config") or {})
        return _qwen3_5_moe(text, top=raw, source=source)
    if model_type == "qwen3_5_moe_text":
        return _qwen3_5_moe(dict(raw), top=raw, source=source, prefix="model.")
    if model_type == "qwen3_moe":
        return _qwen3_moe(raw, source)
    if model_type == "qwen3_next":
        return _qwen3_next(raw, source)
    raise ValueError(
        f"{source}: unsupported architecture model_type={model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _get(raw: dict, source: str, *names: str, default=None):
    """First present spelling of a key; ValueError naming the file when none is and there is no default."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    if default is None:
        raise ValueError(f"{source}: missing key {names[0]!r}; the config.json looks truncated or not a HF config")
    return default


def _rope(raw: dict, source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from either `rope_parameters` or the older top-level keys."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{source}: missing rope_theta (top level or inside rope_parameters)")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    return float(theta), partial


def _eos(raw: dict, top: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", top.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _layer_types(raw: dict, num_layers: int, source: str) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f"{source}: layer_types must list {num_layers} of {LINEAR!r}/{FULL!r}, got {types}")
    return tuple(types)


def _attention(raw: dict, source: str, hidden: int, default_partial: float) -> dict:
    if raw.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported by this engine")
    heads = int(_get(raw, source, "num_attention_heads"))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    theta, partial = _rope(raw, source)
    partial = default_partial if partial is None else float(partial)
    return dict(
        num_heads=heads,
        num_kv_heads=int(_get(raw, source, "num_key_value_heads", default=heads)),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=theta,
    )


def _moe(raw: dict, source: str) -> dict:
    return dict(
        num_experts=int(_get(raw, source, "num_experts", "num_local_experts")),
        top_k=int(_get(raw, source, "num_experts_per_tok")),
        moe_intermediate_size=int(_get(raw, source, "moe_intermediate_size")),
    )


def _qwen3_5_moe(text: dict, top: dict, source: str, prefix: str = "model.language_model.") -> ModelConfig:
    if not text:
        raise ValueError(f"{source}: model_type qwen3_5_moe needs a 'text_config' section")
    hidden = int(_get(text, source, "hidden_size"))
    layers = int(_get(text, source, "num_hidden_layers"))
    tie = bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return ModelConfig(
        arch="qwen3_5_moe",
        weight_prefix=prefix,
        vocab_size=int(_get(text, source, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        layer_types=_layer_types(text, layers, source),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=True,
        tie_word_embeddings=tie,
        attn_output_gate=True,
        **_attention(text, source, hidden, default_partial=0.25),
        linear_num_k_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_v_heads=int(text.get("linear_num_value_heads", 32)),
        linear_k_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_v_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        **_moe(text, source),
        shared_expert_intermediate_size=int(_get(text, source, "shared_expert_intermediate_size")),
        norm_topk_prob=True,  # Qwen3.5-MoE always renormalises; its config has no such key
        dense_layers=(),
        intermediate_size=0,
        eos_token_ids=_eos(text, top),
        max_positions=int(text.get("max_position_embeddings") or 0),
    )


def _dense_layers(raw: dict, layers: int) -> tuple[int, ...]:
    """Layers with a dense MLP: listed in mlp_only_layers, or off the decoder_sparse_step grid."""
    step = int(raw.get("decoder_sparse_step", 1))
    mlp_only = set(raw.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step != 0)


def _qwen3_next(raw: dict, source: str) -> ModelConfig:
    """Qwen3-Next: Qwen3.5-MoE's hybrid text model with Qwen3-MoE's top-level keys and dense-layer options
    (its DeltaNet projections are stored grouped per key head; the loader ungroups them)."""
    cfg = _qwen3_5_moe(dict(raw), top=raw, source=source, prefix="model.")
    dense = _dense_layers(raw, cfg.num_layers)
    return replace(cfg, arch="qwen3_next", norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                   dense_layers=dense, intermediate_size=int(raw.get("intermediate_size", 0)))


def _qwen3_moe(raw: dict, source: str) -> ModelConfig:
    hidden = int(_get(raw, source, "hidden_size"))
    layers = int(_get(raw, source, "num_hidden_layers"))
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported; set it to false")
    dense = _dense_layers(raw, layers)
    return ModelConfig(
        arch="qwen3_moe",
        weight_prefix="model.",
        vocab_size=int(_get(raw, source, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        layer_types=(FULL,) * layers,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attn_output_gate=False,
        **_attention(raw, source, hidden, default_partial=1.0),
        linear_num_k_heads=0,
        linear_num_v_heads=0,
        linear_k_head_dim=0,
        linear_v_head_dim=0,
        conv_kernel=0,
        **_moe(raw, source),
        shared_expert_intermediate_size=0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default when absent
        dense_layers=dense,
        intermediate_size=int(raw.get("intermediate_size", 0)),
        eos_token_ids=_eos(raw, raw),
        max_positions=int(raw.get("max_position_embeddings") or 0),
    )
