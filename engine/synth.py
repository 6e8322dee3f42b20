"""Seeded random checkpoints in the real Hugging Face layouts (no network, no transformers, seconds).

    synth_checkpoint(out_dir, arch="qwen3_5_moe", layout="fused", size="tiny", seed=0, vocab_size=None,
                     tokenizer=None, router_zipf=None) -> Path

Writes config.json, two safetensors shards with an index (the text model in the first; the `model.visual.*`
and `mtp.*` tensors a real Qwen3.5 release carries, which the loader must skip, in the second) and, when
`tokenizer` names a directory or tokenizer.json, a copy of the tokenizer files. Values are bf16 (so exact in
any dtype we load them into); norm weights are randomised so a `1 + w` vs `w` mix-up changes the output.

router_zipf=a (> 0) skews routing: each MoE layer's router rows are scaled (engine/experts/zipf.py) so expert
popularity follows a Zipf law of exponent a over a seeded order of that layer's experts, the same scales
whichever device draws the values; None or 0 leaves the checkpoint byte for byte as without it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import FULL, LINEAR, config_from_dict
from engine.flags import SYNTH_SIZES
from engine.weight_names import (FUSED, LAYOUTS, fused_expert_shapes, layer_prefix, non_expert_shapes,
                                 per_expert_shapes)

ARCHS = ("qwen3_5_moe", "qwen3_moe", "qwen3_next")
SIZES = SYNTH_SIZES
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

_TEXT_SIZES = {
    # tiny: what the tests compare against transformers; demo: the embedded default model (still CPU-fast)
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "demo": dict(vocab_size=8192, hidden_size=128, num_hidden_layers=8, full_attention_interval=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
                 linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64),
    # the released model's widths (40 layers, 248k vocab: a 70 GB checkpoint; pick fewer layers with
    # `layers=`); the engine benchmarks and the peer comparison run on it
    "qwen3.6-35b-a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, full_attention_interval=4,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512),
}


def synth_config(arch: str = "qwen3_5_moe", size: str = "tiny", vocab_size: int | None = None,
                 layers: int | None = None) -> dict:
    """The raw config.json of a synthetic checkpoint (layers: override the size's layer count)."""
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"synth: arch must be one of {ARCHS}, size one of {SIZES}")
    if layers is not None and layers < 1:
        raise ValueError(f"synth: layers must be at least 1, got {layers}")
    dims = dict(_TEXT_SIZES[size], **({"vocab_size": vocab_size} if vocab_size else {}))
    if layers is not None:
        dims["num_hidden_layers"] = layers
    make = {"qwen3_5_moe": _qwen3_5_moe_config, "qwen3_moe": _qwen3_moe_config, "qwen3_next": _qwen3_next_config}
    return make[arch](dims)


def synth_checkpoint(out_dir, arch: str = "qwen3_5_moe", layout: str = FUSED, size: str = "tiny", seed: int = 0,
                     vocab_size: int | None = None, tokenizer=None, layers: int | None = None,
                     device: str = "cpu", router_zipf: float | None = None) -> Path:
    """device: where values are drawn (a CUDA generator makes the large sizes fast; other values, same
    distributions)."""
    if layout not in LAYOUTS:
        raise ValueError(f"synth: layout must be one of {LAYOUTS}")
    raw = synth_config(arch, size, vocab_size, layers)
    _check_zipf(router_zipf, raw)
    tokenizer_files = _tokenizer_files(tokenizer) if tokenizer is not None else []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_dict(raw)
    gen = torch.Generator(device).manual_seed(seed)
    text = {k: v.cpu() for k, v in _skew_routers(_text_tensors(cfg, layout, gen), cfg, router_zipf, seed).items()}
    cpu_gen = torch.Generator().manual_seed(seed + 1) if gen.device.type != "cpu" else gen
    extra = _visual_tensors(raw["vision_config"], cpu_gen) | _mtp_tensors(cfg, cpu_gen) if arch == "qwen3_5_moe" else {}
    _write_shards(out, [text, extra] if extra else [text])
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for file in tokenizer_files:
        shutil.copyfile(file, out / file.name)
    return out


def _tokenizer_files(src) -> list[Path]:
    """The tokenizer files of a directory (or of the directory holding a given tokenizer.json)."""
    src = Path(src)
    folder = src.parent if src.is_file() else src
    files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not any(f.name == "tokenizer.json" for f in files):
        raise ValueError(f"{folder} has no tokenizer.json; pass the shipped tokenizer directory")
    return files


def _qwen3_5_moe_config(d: dict) -> dict:
    n, interval = d["num_hidden_layers"], d["full_attention_interval"]
    text = {k: v for k, v in d.items() if k != "full_attention_interval"}
    text.update(
        model_type="qwen3_5_moe_text", hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144,
        attention_bias=False, linear_conv_kernel_dim=4, full_attention_interval=interval,
        layer_types=[FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        mtp_num_hidden_layers=1, tie_word_embeddings=False, eos_token_id=d["vocab_size"] - 1,
    )
    v = d["vocab_size"]
    vision = dict(model_type="qwen3_5_moe_vision", depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  in_channels=3, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=d["hidden_size"], num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")
    return dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                text_config=text, vision_config=vision, tie_word_embeddings=False,
                image_token_id=v - 4, video_token_id=v - 3, vision_start_token_id=v - 6, vision_end_token_id=v - 5)


def _qwen3_moe_config(d: dict) -> dict:
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_experts_per_tok", "moe_intermediate_size")
    raw = {k: d[k] for k in keep}
    # Older spellings on purpose (real Qwen3-MoE configs): num_experts and a top-level rope_theta.
    raw.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
               num_experts=d["num_experts"], rope_theta=1000000.0, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[1], intermediate_size=3 * d["hidden_size"], hidden_act="silu", rms_norm_eps=1e-6,
               max_position_embeddings=40960, use_sliding_window=False, attention_bias=False,
               tie_word_embeddings=False, eos_token_id=d["vocab_size"] - 1)
    return raw


def _qwen3_next_config(d: dict) -> dict:
    raw = dict(d)  # full_attention_interval instead of layer_types, top-level rope keys: the other spellings
    raw.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_act="silu", rms_norm_eps=1e-6,
               max_position_embeddings=262144, attention_bias=False, linear_conv_kernel_dim=4, rope_theta=10000000.0,
               partial_rotary_factor=0.25, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[d["num_hidden_layers"] - 2], intermediate_size=3 * d["hidden_size"],
               tie_word_embeddings=False, eos_token_id=d["vocab_size"] - 1)
    return raw


def _value(name: str, shape: tuple[int, ...], gen: torch.Generator, zero_centered: bool) -> torch.Tensor:
    """One tensor, scaled so activations stay O(1) through a few layers; rounded to bf16, drawn and left on
    the generator's device (in slices along dim 0, so a large tensor needs no fp32 copy of itself)."""
    dev = gen.device
    if name.endswith("A_log"):
        return torch.empty(shape, device=dev).uniform_(0.5, 8.0, generator=gen).log().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return (torch.randn(shape, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        # zero-centred norms store w and scale by 1 + w; the gated DeltaNet norm always scales by w
        centred = zero_centered and not name.endswith("linear_attn.norm.weight")
        return (torch.randn(shape, generator=gen, device=dev) * 0.3 + (0.0 if centred else 1.0)).to(torch.bfloat16)
    # routers get twice the scale so top-k choices are clear-cut, not near-ties that rounding could flip
    scale = (2.0 if name.endswith("mlp.gate.weight") else 1.0) / shape[-1] ** 0.5
    out = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    step = max(1, (1 << 26) // max(1, out[0].numel()))
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        out[i : i + n] = torch.randn((n, *shape[1:]), generator=gen, device=dev) * scale
    return out


def _text_tensors(cfg, layout: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in non_expert_shapes(cfg).items():
        out[name] = _value(name, shape, gen, cfg.zero_centered_norm)
    for layer in cfg.moe_layers:
        fused = {n: _value(n, s, gen, False) for n, s in fused_expert_shapes(cfg, layer).items()}
        if layout == FUSED:
            out.update(fused)
            continue
        gate_up, down = fused.values()  # [E, 2I, H], [E, H, I]
        I = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            gate_name, up_name, down_name = per_expert_shapes(cfg, layer, e)
            out[gate_name], out[up_name] = gate_up[e, :I].clone(), gate_up[e, I:].clone()
            out[down_name] = down[e].clone()
    return out


def _visual_tensors(v: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The vision tower of a tiny Qwen3.5 checkpoint: present on disk, never used by the text engine."""
    h, m, c, p = v["hidden_size"], v["intermediate_size"], v["in_channels"], v["patch_size"]
    t, out = v["temporal_patch_size"], v["out_hidden_size"]
    merged = h * v["spatial_merge_size"] ** 2
    shapes = {"patch_embed.proj.weight": (h, c, t, p, p), "patch_embed.proj.bias": (h,),
              "pos_embed.weight": (v["num_position_embeddings"], h),
              "merger.norm.weight": (h,), "merger.norm.bias": (h,),
              "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
              "merger.linear_fc2.weight": (out, merged), "merger.linear_fc2.bias": (out,)}
    for b in range(v["depth"]):
        bp = f"blocks.{b}."
        shapes.update({bp + "norm1.weight": (h,), bp + "norm1.bias": (h,), bp + "norm2.weight": (h,),
                       bp + "norm2.bias": (h,), bp + "attn.qkv.weight": (3 * h, h), bp + "attn.qkv.bias": (3 * h,),
                       bp + "attn.proj.weight": (h, h), bp + "attn.proj.bias": (h,),
                       bp + "mlp.linear_fc1.weight": (m, h), bp + "mlp.linear_fc1.bias": (m,),
                       bp + "mlp.linear_fc2.weight": (h, m), bp + "mlp.linear_fc2.bias": (h,)})
    return {"model.visual." + n: _value(n, s, gen, False) for n, s in shapes.items()}


def _mtp_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A few multi-token-prediction head tensors, as the real release ships them (the engine skips them)."""
    H = cfg.hidden_size
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.layers.0.input_layernorm.weight": (H,)}
    return {n: _value(n, s, gen, True) for n, s in shapes.items()}


def _check_zipf(a: float | None, raw: dict) -> None:
    if a is None or a == 0:
        return
    cfg = config_from_dict(raw)
    if a < 0 or not 0 < cfg.top_k <= cfg.num_experts // 2:
        raise ValueError(f"synth: --router-zipf takes an exponent > 0 and a model whose top-k is at most half its "
                         f"experts (got {a}, top-{cfg.top_k} of {cfg.num_experts})")


def _skew_routers(tensors: dict[str, torch.Tensor], cfg, a: float | None, seed: int) -> dict[str, torch.Tensor]:
    """Router rows [E, H] of every MoE layer scaled in place of the dict (fp32 product, rounded to bf16: the same
    bits on any device) so expert popularity follows a Zipf law of exponent a; a None or 0: unchanged."""
    if not a:
        return tensors
    from engine.experts.zipf import layer_row_scales

    for layer in cfg.moe_layers:
        name = layer_prefix(cfg, layer) + "mlp.gate.weight"
        w = tensors[name]
        scales = torch.as_tensor(layer_row_scales(cfg.num_experts, cfg.top_k, a, seed, layer), dtype=torch.float32)
        tensors[name] = (w.float() * scales.to(w.device)[:, None]).to(w.dtype)
    return tensors


def _write_shards(out: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def synth_model(size: str = "qwen3.6-35b-a3b", layers: int | None = None, device: str = "cuda",
                dtype=torch.bfloat16, seed: int = 0, arch: str = "qwen3_5_moe", router_zipf: float | None = None,
                experts=None, expert_device: str | None = None):
    """A Model with seeded random weights drawn straight on `device`: a synthetic checkpoint of a real
    model's widths without writing (or reading) it (router_zipf: as synth_checkpoint's). experts and
    expert_device as load_model's: a backend factory over the routed experts (default: all resident) and
    where their values are kept once drawn ("cpu" for a host-RAM pool). -> (Model, raw config dict)."""
    from engine.experts.fused import FusedExperts
    from engine.experts.source import ExpertWeights
    from engine.models.qwen import Model

    raw = synth_config(arch, size, None, layers)
    _check_zipf(router_zipf, raw)
    cfg = config_from_dict(raw)
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {n: _value(n, s, gen, cfg.zero_centered_norm) for n, s in non_expert_shapes(cfg).items()}
    tensors = {n: v.to(dtype) for n, v in _skew_routers(tensors, cfg, router_zipf, seed).items()}
    gate_up, down = {}, {}
    keep = expert_device or device
    for layer in cfg.moe_layers:
        gu, dn = (_value(n, s, gen, False).to(keep, dtype) for n, s in fused_expert_shapes(cfg, layer).items())
        gate_up[layer], down[layer] = gu, dn
    backend = (experts or FusedExperts)(ExpertWeights(gate_up, down))
    return Model(cfg, tensors, backend, torch.device(device), dtype), raw
