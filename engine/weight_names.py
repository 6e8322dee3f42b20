"""Tensor names and shapes of the Hugging Face checkpoints we read (and that engine.synth writes).

One place knows the on-disk naming, so the loader's checks and the generator cannot drift apart.
H = hidden, V = vocab, E = experts, I = expert width, S = shared-expert width, D = dense MLP width.
"""
from __future__ import annotations

from engine.config import FULL, ModelConfig

FUSED = "fused"  # mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I] (Qwen3.5 release)
PER_EXPERT = "per_expert"  # mlp.experts.{e}.gate_proj/up_proj/down_proj.weight (Qwen3-MoE release)
LAYOUTS = (FUSED, PER_EXPERT)


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"{cfg.weight_prefix}layers.{layer}."


def non_expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text model needs except the routed experts, full name -> shape."""
    H, V, p = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    shapes: dict[str, tuple[int, ...]] = {f"{p}embed_tokens.weight": (V, H), f"{p}norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for layer in range(cfg.num_layers):
        lp = layer_prefix(cfg, layer)
        shapes[lp + "input_layernorm.weight"] = (H,)
        shapes[lp + "post_attention_layernorm.weight"] = (H,)
        mixer = _attention_shapes(cfg) if cfg.layer_types[layer] == FULL else _deltanet_shapes(cfg)
        mlp = _dense_shapes(cfg) if layer in cfg.dense_layers else _moe_shapes(cfg)
        shapes.update({lp + k: v for k, v in {**mixer, **mlp}.items()})
    return shapes


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)  # gate rides along q, per head
    return {
        "self_attn.q_proj.weight": (q_out, H),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, H),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, H),
        "self_attn.o_proj.weight": (H, cfg.num_heads * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }


def _deltanet_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, Hv, vd = cfg.hidden_size, cfg.linear_num_v_heads, cfg.linear_value_dim
    if cfg.arch == "qwen3_next":  # grouped per key head on disk: see ungroup_qwen3_next
        inputs = {"linear_attn.in_proj_qkvz.weight": (cfg.conv_dim + vd, H),
                  "linear_attn.in_proj_ba.weight": (2 * Hv, H)}
    else:
        inputs = {"linear_attn.in_proj_qkv.weight": (cfg.conv_dim, H), "linear_attn.in_proj_z.weight": (vd, H),
                  "linear_attn.in_proj_b.weight": (Hv, H), "linear_attn.in_proj_a.weight": (Hv, H)}
    return {
        **inputs,
        "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
        "linear_attn.dt_bias": (Hv,),
        "linear_attn.A_log": (Hv,),
        "linear_attn.norm.weight": (cfg.linear_v_head_dim,),
        "linear_attn.out_proj.weight": (H, vd),
    }


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, S = cfg.hidden_size, cfg.shared_expert_intermediate_size
    shapes = {"mlp.gate.weight": (cfg.num_experts, H)}
    if S:
        shapes.update({
            "mlp.shared_expert.gate_proj.weight": (S, H),
            "mlp.shared_expert.up_proj.weight": (S, H),
            "mlp.shared_expert.down_proj.weight": (H, S),
            "mlp.shared_expert_gate.weight": (1, H),
        })
    return shapes


def _dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.intermediate_size
    return {"mlp.gate_proj.weight": (D, H), "mlp.up_proj.weight": (D, H), "mlp.down_proj.weight": (H, D)}


def fused_expert_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    lp = layer_prefix(cfg, layer)
    return {lp + "mlp.experts.gate_up_proj": (E, 2 * I, H), lp + "mlp.experts.down_proj": (E, H, I)}


def per_expert_shapes(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[int, ...]]:
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    ep = f"{layer_prefix(cfg, layer)}mlp.experts.{expert}."
    return {ep + "gate_proj.weight": (I, H), ep + "up_proj.weight": (I, H), ep + "down_proj.weight": (H, I)}

