"""The model runner: the one owner of per-request device state, driven by EngineCore's thread.

Per step it reads: prepare (token slices + each sequence's state) -> forward (all sequences in one batch) ->
checkpoint at the positions the chunk carries and at its end -> sample (or take the forced id).
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.api import GenerateRequest
from engine.sampling import Sampler
from engine.scheduler import Sequence, Work


SMALL_STEP = 128  # tokens: below this a CPU step runs single-threaded (see ModelRunner.__init__)


class StateCache(Protocol):
    """The prefix cache as the runner sees it (engine/cache/store.PrefixStore implements it)."""

    def acquire(self, tokens: list[int]) -> tuple[object, object | None]: ...  # (match, restored state)

    def release(self, match) -> None: ...

    def insert(self, tokens: list[int], state, session_key: str | None = None) -> None: ...

    def set_budgets(self, device: int | None = None, host: int | None = None) -> None: ...

    def stats(self) -> dict: ...


class ModelRunner:
    def __init__(self, model, context_length: int | None = None, cache: StateCache | None = None) -> None:
        self.model = model
        self.cache = cache
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length or 32768
        self._states: dict[str, object] = {}
        self._samplers: dict[str, Sampler] = {}
        self._matches: dict[str, object] = {}
        self.steps = 0
        # On CPU, steps of a few tokens run on one intra-op thread: their ops are too small to split, and
        # torch's other threads only fight the proxy's event loop for the cores (a 40-token step took 2x
        # as long on 2 threads next to a streaming proxy). Long prefill chunks get every thread.
        self._cpu_threads = torch.get_num_threads() if self.model.device.type == "cpu" else 0

    def validate(self, req: GenerateRequest) -> None:
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size}); got {bad[:5]}")

    def admit(self, seq: Sequence) -> None:
        state = None
        if self.cache is not None:
            match, state = self.cache.acquire(seq.tokens[: seq.num_prompt])
            self._matches[seq.request_id] = match
            if state is not None:
                seq.num_computed = seq.reused = state.length
                seq.cache_tier = match.tier
        self._states[seq.request_id] = state if state is not None else self.model.new_state()
        self._samplers[seq.request_id] = Sampler(seq.req.sampling, self.model.device)

    @torch.inference_mode()
    def step(self, work: list[Work]) -> list[int | None]:
        device = self.model.device
        items = [(torch.tensor(w.seq.tokens[w.start : w.end], dtype=torch.long, device=device),
                  self._states[w.seq.request_id]) for w in work]
        if self._cpu_threads > 1:
            torch.set_num_threads(self._cpu_threads if sum(w.end - w.start for w in work) >= SMALL_STEP else 1)
        if self.cache is not None:
            for w, (_, state) in zip(work, items):
                state.marks = w.marks  # snapshots inside the chunk, taken in the same pass
        logits = self.model.forward(items, logits="last")  # per item [1, V]
        self.steps += 1
        out: list[int | None] = []
        for w, lg in zip(work, logits):
            seq, state = w.seq, self._states[w.seq.request_id]
            if self.cache is not None:
                for position in state.marks:
                    self.cache.insert(seq.tokens[:position], state.at(position))
                    seq.checkpoints_kept.append(position)
                state.drop_marks()
                if w.checkpoint_here:
                    self.cache.insert(seq.tokens[: w.end], state)
                    seq.checkpoints_kept.append(w.end)
            if not w.samples or seq.req.max_new_tokens == 0:
                out.append(None)
                continue
            forced = seq.req.forced_output_ids
            out.append(forced[seq.num_output] if forced is not None else self._samplers[seq.request_id](lg[-1]))
        return out

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        self._samplers.pop(seq.request_id, None)
        match = self._matches.pop(seq.request_id, None)
        if self.cache is None:
            return
        try:
            if state is not None and seq.finish_reason in ("stop", "length") and state.length >= seq.num_prompt:
                self._cache_turn(seq, state)
        finally:  # whatever happened above, the path this request locked at admission is unlocked
            if match is not None:
                self.cache.release(match)

    @torch.inference_mode()
    def _cache_turn(self, seq: Sequence, state) -> None:
        """Cache prompt + reply, the last emitted (or stop) token included, and pin it for the session.

        That token was sampled but never fed; the agent's next prompt repeats it (e.g. `<|im_end|>`), so one
        more forward step here makes the next turn reuse exactly up to its edit point instead of one short."""
        tokens = seq.tokens + ([seq.stop_token] if seq.stop_token is not None else [])
        if state.length == len(tokens) - 1:
            last = torch.tensor(tokens[-1:], dtype=torch.long, device=self.model.device)
            self.model.forward([(last, state)], logits="last")
        self.cache.insert(tokens[: state.length], state, seq.req.session_key)
        seq.checkpoints_kept.append(state.length)

    def reconfigure(self, moe_slots: int | None = None, kv_tokens: int | None = None,
                    prefix_device_bytes: int | None = None, prefix_host_bytes: int | None = None) -> dict:
        """Resize caches between steps (EngineCore.call); every value is checked before anything changes."""
        experts = self.model.experts
        if moe_slots is not None and not hasattr(experts, "resize"):
            raise ValueError("this engine keeps every expert resident (--moe-backend fused): there is no "
                             "expert cache to resize; start it with --moe-backend offload|cpu|hybrid")
        if kv_tokens is not None and kv_tokens < 16:
            raise ValueError(f"the KV budget must be at least 16 tokens, got {kv_tokens}")
        if (prefix_device_bytes or prefix_host_bytes) and self.cache is None:
            raise ValueError("the prefix cache is off (--no-prefix-cache): there is no budget to change")
        if moe_slots is not None:
            experts.resize(moe_slots)  # checks the size before it frees anything
        if prefix_device_bytes is not None or prefix_host_bytes is not None:
            self.cache.set_budgets(device=prefix_device_bytes, host=prefix_host_bytes)
        if kv_tokens is not None:
            self.context_length = kv_tokens
        return self.stats()

    def stats(self) -> dict:
        out = {"live_states": len(self._states), "steps": self.steps, "context_length": self.context_length}
        experts = getattr(self.model, "experts", None)
        if experts is not None and hasattr(experts, "stats"):
            out["experts"] = experts.stats()
        if self.cache is not None:
            out.update(self.cache.stats())
        return out
