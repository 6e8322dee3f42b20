"""The small documented entry point over Model, for users and tests.

    from engine import Engine
    eng = Engine.from_pretrained(path, device="cpu", dtype="float32")
    eng.score(ids)                                   # FloatTensor [T, V]: logits at every prompt position
    eng.generate(ids, max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop_ids=(),
                 frequency_penalty=0.0, presence_penalty=0.0)
                                                     # -> list[int], the new tokens (a stop token included)
"""
from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.experts.registry import is_expert_cache
from engine.models import load_model
from engine.penalties import PenaltyPool
from engine.sampling import Sampler

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds activation memory on long prompts
FAST_CONTEXT = 32768  # tokens per sequence in the fast path's KV slots (longer prompts run eagerly)


class Engine:
    def __init__(self, model):
        self.model = model
        self._reserve = 0  # tokens generate() will add after the prompt (so the state it gets fits them)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype="float32", experts=None, expert_device=None,
                        fast: bool | None = None) -> "Engine":
        """fast: the Triton/CUDA-graph path (default: on where it is available, i.e. CUDA with every expert
        resident); False keeps the eager reference path everywhere."""
        model = load_model(path, device=device, dtype=dtype, experts=experts, expert_device=expert_device)
        if fast or (fast is None and model.device.type == "cuda"):
            from engine.models.fast_support import fast_unsupported

            if fast or fast_unsupported(model) is None:
                model.enable_fast(slots=2, capacity=FAST_CONTEXT)
        if is_expert_cache(model.experts):
            model.piece_tokens = PREFILL_CHUNK  # an expert cache: a prompt in one layer-major forward
        return cls(model)

    @property
    def config(self):
        return self.model.config

    def score(self, ids) -> torch.Tensor:
        ids = self._ids(ids)
        state = self.model.new_state(len(ids))
        return torch.cat([self.model.forward([(c, state)], logits="all")[0] for c in self._chunks(ids)])

    def prefill(self, ids, state=None):
        """Run the prompt in chunks (one layer-major forward with an expert cache); -> (logits of the last
        position [V], state)."""
        ids = self._ids(ids)
        state = state or self.model.new_state(len(ids) + self._reserve)
        for chunk in self._chunks(ids):
            logits = self.model.forward([(chunk, state)], logits="last")[0][-1]
        return logits, state

    def _chunks(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forwards of PREFILL_CHUNK tokens, or all of them at once when the model runs layers in pieces."""
        return (ids,) if self.model.piece_tokens else ids.split(PREFILL_CHUNK)

    def generate(self, ids, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop_ids=(), frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0) -> list[int]:
        params = SamplingParams(temperature, top_p, top_k, seed, frequency_penalty, presence_penalty)
        sampler = Sampler(params, self.model.device)
        penalties = PenaltyPool(self.model.config.vocab_size, self.model.device)
        penalties.add("generate", params)
        stop = set(stop_ids)
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        self._reserve = max_new_tokens
        logits, state = self.prefill(ids)
        self._reserve = 0
        while True:
            (row,), counted = penalties.apply(["generate"], [logits])
            drawn = sampler.sample(row)
            penalties.count(counted, drawn[None])
            token = int(drawn)
            out.append(token)
            if token in stop or len(out) >= max_new_tokens:
                return out
            step = torch.tensor([token])
            logits = self.model.forward([(step, state)], logits="last")[0][-1]

    def _ids(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.model.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("ids is empty: pass at least one prompt token")
        vocab = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
        return ids
