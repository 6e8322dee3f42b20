"""Load a Hugging Face checkpoint directory: config.json + safetensors (one file, or shards with an index).

    cfg, tensors, experts = load_checkpoint(path, device, dtype, expert_device=None)

`tensors` holds every non-expert tensor of the text model under its full name; `experts` is the
ExpertWeights source (fused [E, 2I, H] / [E, H, I] per MoE layer, whatever the layout on disk), on
`expert_device` (default: `device`; "cpu" for backends that keep the pool in host RAM). Tensors the
text model does not use (`model.visual.*`, `mtp.*`) are never read. Every problem a user can cause raises
ValueError naming the file or key and what to do about it. `CheckpointReader` (name -> tensor across the
safetensors files) is also what fills a host expert pool straight from disk (experts/safetensors_fill.py).
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import FULL, ModelConfig, load_config
from engine.experts.source import ExpertWeights
from engine.weight_names import fused_expert_shapes, layer_prefix, non_expert_shapes, per_expert_shapes

INDEX = "model.safetensors.index.json"


def load_checkpoint(path, device="cpu", dtype=torch.float32, expert_device=None):
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist; pass the folder of a Hugging Face checkpoint")
    cfg = load_config(model_dir)
    with ExitStack() as stack:
        reader = CheckpointReader(model_dir, stack, torch.device(device), dtype)
        tensors = {name: reader.get(name, shape) for name, shape in non_expert_shapes(cfg).items()}
        if cfg.arch == "qwen3_next":
            _ungroup_qwen3_next(cfg, tensors)
        experts = _load_experts(cfg, reader, torch.device(expert_device or device))
    return cfg, tensors, experts


def _ungroup_qwen3_next(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite Qwen3-Next's grouped DeltaNet input projections, in place, into Qwen3.5's four.

    On disk the rows are grouped per key head g: in_proj_qkvz = [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)]
    and in_proj_ba = [b_g (r), a_g (r)], r = value heads per key head. Value head g*r + j reads key head g in
    both models, so regrouping rows is all it takes (the conv channels stay q | k | v).
    """
    nk, dk = cfg.linear_num_k_heads, cfg.linear_k_head_dim
    r = cfg.linear_num_v_heads // nk
    rv = r * cfg.linear_v_head_dim  # value channels per key head
    for layer in range(cfg.num_layers):
        p = f"{layer_prefix(cfg, layer)}linear_attn."
        if cfg.layer_types[layer] == FULL:
            continue
        qkvz = tensors.pop(p + "in_proj_qkvz.weight")
        H = qkvz.shape[-1]
        q, k, v, z = qkvz.view(nk, -1, H).split([dk, dk, rv, rv], dim=1)
        tensors[p + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, H) for t in (q, k, v)])
        tensors[p + "in_proj_z.weight"] = z.reshape(-1, H).contiguous()
        b, a = tensors.pop(p + "in_proj_ba.weight").view(nk, 2 * r, H).split([r, r], dim=1)
        tensors[p + "in_proj_b.weight"] = b.reshape(-1, H).contiguous()
        tensors[p + "in_proj_a.weight"] = a.reshape(-1, H).contiguous()


def _load_experts(cfg: ModelConfig, reader: CheckpointReader, device: torch.device) -> ExpertWeights:
    gate_up, down = {}, {}
    for layer in cfg.moe_layers:
        (gu_name, gu_shape), (d_name, d_shape) = fused_expert_shapes(cfg, layer).items()
        if reader.has(gu_name):
            gate_up[layer], down[layer] = reader.get(gu_name, gu_shape, device), reader.get(d_name, d_shape, device)
            continue
        per = [[reader.get(n, s, device) for n, s in per_expert_shapes(cfg, layer, e).items()]
               for e in range(cfg.num_experts)]
        if not per:
            raise ValueError(f"{reader.where(gu_name)}: config says num_experts=0; this engine needs MoE layers")
        gate_up[layer] = torch.stack([torch.cat([g, u]) for g, u, _ in per])  # [E, 2I, H], gate rows first
        down[layer] = torch.stack([d for _, _, d in per])  # [E, H, I]
    if not gate_up:
        raise ValueError(f"{reader.model_dir}/config.json describes no MoE layer; this engine serves MoE models")
    return ExpertWeights(gate_up, down)


class CheckpointReader:
    """Name -> tensor across the checkpoint's safetensors files, with user-facing errors."""

    def __init__(self, model_dir: Path, stack: ExitStack, device: torch.device, dtype: torch.dtype):
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.file_of: dict[str, Path] = {}
        self._handles = {}
        for file in self._files():
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for broken headers
                raise ValueError(f"{file}: not a readable safetensors file ({e}); re-download or re-convert it") from e
            self._handles[file] = handle
            self.file_of.update({k: file for k in handle.keys()})

    def _files(self) -> list[Path]:
        index = self.model_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e}); re-download it") from e
            files = sorted({self.model_dir / f for f in weight_map.values()})
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"{missing[0]} is listed in {index} but missing; download every shard")
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.model_dir} holds no *.safetensors files; download the checkpoint weights")
        return files

    def has(self, name: str) -> bool:
        return name in self.file_of

    def where(self, name: str) -> str:
        return str(self.file_of.get(name, self.model_dir))

    def get(self, name: str, shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
        if name not in self.file_of:
            raise ValueError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint; "
                             "the weights do not match config.json (incomplete download or wrong model)")
        file = self.file_of[name]
        try:
            tensor = self._handles[file].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({e}); the file is corrupt, re-download it") from e
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} "
                             "from config.json; the weights and config.json belong to different models")
        return tensor.to(device=device or self.device, dtype=self.dtype)
