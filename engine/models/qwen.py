"""The Qwen MoE family (Qwen3.5-MoE hybrid, Qwen3-MoE) as one decoder: embeddings -> layers -> norm -> head.

Each layer: x += mixer(norm(x)); x += mlp(norm(x)). The mixer is gated full attention or gated DeltaNet;
the MLP is the MoE block (or a dense MLP on Qwen3-MoE's mlp_only layers). Sequences of a batch are
concatenated along the token axis; only the mixers look at sequence boundaries.
N = tokens in the batch, H = hidden, V = vocab.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from engine.config import FULL, ModelConfig
from engine.experts.registry import is_expert_cache
from engine.layers.attention import Attention
from engine.layers.deltanet import GatedDeltaNet
from engine.layers.mlp import DenseMLP
from engine.layers.moe import MoE
from engine.layers.norm import rms_norm
from engine.layers.rope import Rope
from engine.models.pieces import last_rows, one_expert_pass, piece_spans, row_pieces
from engine.models.slots import SlotState
from engine.models.state import KVCache, LinearState, SequenceState, StateCheckpoint


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], rope: Rope, experts):
        self.cfg = cfg
        self.is_attention = cfg.layer_types[layer] == FULL
        self.mixer = Attention(cfg, w, rope) if self.is_attention else GatedDeltaNet(cfg, w)
        if layer in cfg.dense_layers:
            self.mlp = DenseMLP(w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        else:
            self.mlp = MoE(cfg, layer, w, experts)
        self.input_norm, self.post_norm = w["input_layernorm.weight"], w["post_attention_layernorm.weight"]

    def __call__(self, x: torch.Tensor, spans: list) -> torch.Tensor:
        x = x + self.mixer(self._norm(x, self.input_norm), spans)
        return x + self.mlp(self._norm(x, self.post_norm))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w, self.cfg.rms_norm_eps, self.cfg.zero_centered_norm)


class Model:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], experts, device, dtype):
        self.config, self.device, self.dtype, self.experts = cfg, torch.device(device), dtype, experts
        p = cfg.weight_prefix
        self.embed = tensors[p + "embed_tokens.weight"]  # [V, H]
        self.final_norm = tensors[p + "norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
        rope = Rope(cfg.rotary_dim, cfg.rope_theta, self.device)
        self.layers = []
        for layer in range(cfg.num_layers):
            lp = f"{p}layers.{layer}."
            w = {k[len(lp) :]: v for k, v in tensors.items() if k.startswith(lp)}
            self.layers.append(DecoderLayer(cfg, layer, w, rope, experts))
        self.fast = None  # FastPath once enable_fast() ran: slot states, Triton kernels, CUDA graphs
        self.decode_steps = None  # its decode steps in batch buckets (graph-captured on CUDA)
        # Layer-major forwards: a batch of more rows than this runs each layer over all of them in pieces
        # of this many before the next layer starts (None: every layer takes the batch whole). With an
        # expert cache the engine hands a whole prompt to one forward, so its experts stream once per
        # prompt rather than once per chunk, while activations and attention stay piece-sized.
        self.piece_tokens: int | None = None

    def enable_fast(self, slots: int, capacity: int, graphs: bool | None = None) -> None:
        """Serve slot states through the fast path: `slots` sequences of up to `capacity` tokens each in a
        static pool; decode steps replayed as CUDA graphs (default: on CUDA). States beyond the pool, and
        every state made before this call, keep using the eager path."""
        from engine.models.fast_support import make_fast_path

        self.fast, self.decode_steps = make_fast_path(self, slots, capacity, graphs)

    def new_state(self, tokens: int = 0) -> SequenceState:
        """A state for a sequence of up to `tokens` tokens (0: unknown); a fast-path slot when one is free
        and the sequence fits it."""
        if self.fast is not None and tokens <= self.fast.pool.capacity:
            state = self.fast.pool.new_state()
            if state is not None:
                return state
        cfg = self.config
        layers = []
        for layer in self.layers:
            if layer.is_attention:
                layers.append(KVCache(cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device))
            else:
                conv = torch.zeros(cfg.conv_dim, cfg.conv_kernel - 1, dtype=self.dtype, device=self.device)
                rec = torch.zeros(cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim,
                                  dtype=torch.float32, device=self.device)
                layers.append(LinearState(conv, rec))
        return SequenceState(layers)

    def restore(self, ckpt: StateCheckpoint) -> SequenceState:
        """A fresh state continuing from `ckpt` (which stays valid for further restores)."""
        if self.fast is not None:
            state = self.fast.pool.restore(ckpt)
            if state is not None:
                return state
        layers = [
            (KVCache if layer.is_attention else LinearState).from_snapshot(*snap, dtype=self.dtype, device=self.device)
            for layer, snap in zip(self.layers, ckpt.layers)
        ]
        return SequenceState(layers, ckpt.length)

    @torch.inference_mode()
    def forward(self, items: list, logits: Literal["last", "all"] = "last") -> list[torch.Tensor]:
        """items: [(token ids: list or LongTensor [T_i], SequenceState)] -> per item FloatTensor [1, V] or
        [T_i, V]. Host-side ids (lists, CPU tensors) let a decode step start without waiting for the device."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        if not items:
            raise ValueError("forward needs at least one (token_ids, state) item")
        if self.fast is not None and all(isinstance(st, SlotState) for _, st in items):
            return self._forward_fast(items, logits)
        ids = [torch.as_tensor(t, dtype=torch.long, device=self.device).reshape(-1) for t, _ in items]
        if any(t.numel() == 0 for t in ids):
            raise ValueError("every sequence in a forward batch needs at least one token")
        lengths = [t.numel() for t in ids]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        x = F.embedding(torch.cat(ids), self.embed)  # [N, H]
        pieces = row_pieces(x.shape[0], self.piece_tokens)
        states = [st for _, st in items]
        with one_expert_pass(self.experts, x.shape[0], self.config.top_k, max(lengths)):
            for index, layer in enumerate(self.layers):
                for a, b in pieces:  # layer-major: every piece of the batch through this layer, then the next
                    spans = piece_spans(states, offsets, lengths, index, a, b)
                    if len(pieces) == 1:
                        x = layer(x, spans)
                    else:
                        x[a:b] = layer(x[a:b], spans)
        for n, (_, state) in zip(lengths, items):
            state.length += n
        if logits == "last":
            x = last_rows(x, offsets, lengths)
            lengths = [1] * len(lengths)
        x = rms_norm(x, self.final_norm, self.config.rms_norm_eps, self.config.zero_centered_norm)
        return list(F.linear(x, self.lm_head).float().split(lengths))

    @torch.inference_mode()
    def warm_up(self, chunk: int) -> None:
        """Run the fast path once through what serving hits — prefill chunks of full and odd lengths with
        checkpoints inside, a prompt in each token bucket of a short run (token_graphs.BUCKETS), then a decode
        step at every batch bucket — so Triton compiles its kernel variants and each decode graph and each
        bucket's graphs are captured before the first request instead of during it. An expert cache's buffers for
        its CPU share are sized for a prompt piece of `chunk` tokens (OffloadBackend.reserve)."""
        if self.fast is not None:
            chunk = max(min(chunk, self.fast.pool.capacity - 1), 16)  # a slot holds capacity tokens, no more
        if is_expert_cache(self.experts):
            self.experts.reserve(chunk, self.config.top_k, self.dtype)
        if self.fast is None:
            return
        from engine.models.token_graphs import BUCKETS

        g = torch.Generator().manual_seed(0)
        buckets = [(b - 1, ()) for b in BUCKETS if b - 1 <= chunk]
        for n, inside in ((chunk, ()), (chunk // 2 + 7, (chunk // 4 + 3,)), (13, (5,)), *buckets):
            state = self.fast.pool.new_state()
            if state is None:
                return
            state.checkpoint_positions = inside
            self.forward([(torch.randint(0, self.config.vocab_size, (n,), generator=g).tolist(), state)])
            state.drop_checkpoints()
            state.release()
        for size in self.decode_steps.sizes:
            states = [self.fast.pool.new_state() for _ in range(size)]
            live = [s for s in states if s is not None]
            if len(live) == size:
                self.forward([([7], s) for s in live])
            for s in live:
                s.release()

    def _forward_fast(self, items: list, logits: str) -> list[torch.Tensor]:
        sizes = [len(t) if isinstance(t, list) else torch.as_tensor(t).numel() for t, _ in items]
        if all(n == 1 for n in sizes) and len(items) <= self.decode_steps.max_batch:
            # lists: read on the host; tensors (a chained step's ids, the tokens the step before drew, still
            # on the device) stay tensors, copied into the step's inputs on the device: no sync either way
            if all(isinstance(t, torch.Tensor) for t, _ in items):
                ids = torch.cat([t.reshape(-1) for t, _ in items])
            else:
                ids = [int(torch.as_tensor(t).reshape(-1)[0]) if isinstance(t, torch.Tensor) else t[0]
                       for t, _ in items]
            out = self.decode_steps.run(ids, [st.slot for _, st in items], [st.length for _, st in items])
            for _, st in items:
                st.advance(1)
            return list(out.split(1))
        return self.fast.forward(items, logits)
