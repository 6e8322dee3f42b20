"""The model runner: the one owner of per-request device state, driven by EngineCore's thread.

Per step it reads: prepare (token slices + each sequence's state) -> forward (all sequences in one batch) ->
checkpoint at the positions the chunk carries and at its end -> sample (or take the forced id).
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from engine.api import GenerateRequest
from engine.config import FULL
from engine.sampling import Sampler, argmax_rows, wait_for_device
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

    def readmit(self, seq: Sequence) -> None:
        """Admit again a sequence that computed nothing yet: the prefill it waited for cached a longer prefix."""
        self._drop_state(seq)
        seq.num_computed = seq.reused = 0
        seq.cache_tier = "none"
        self.admit(seq)

    @torch.inference_mode()
    def step(self, work: list[Work]) -> list[int | None]:
        # token ids stay host-side lists: the model moves them (a decode step reads them as ints)
        items = [(w.seq.tokens[w.start : w.end], self._states[w.seq.request_id]) for w in work]
        if self._cpu_threads > 1:
            torch.set_num_threads(self._cpu_threads if sum(w.end - w.start for w in work) >= SMALL_STEP else 1)
        if self.cache is not None:
            for w, (_, state) in zip(work, items):
                state.checkpoint_positions = w.checkpoint_positions  # snapshots inside the chunk, same pass
        logits = self.model.forward(items, logits="last")  # per item [1, V]
        self.steps += 1
        for w in work:
            seq, state = w.seq, self._states[w.seq.request_id]
            if self.cache is not None:
                for position in state.checkpoint_positions:
                    self.cache.insert(seq.tokens[:position], state.at(position))
                    seq.checkpoints_kept.append(position)
                state.drop_checkpoints()
                if w.checkpoint_here:
                    self.cache.insert(seq.tokens[: w.end], state)
                    seq.checkpoints_kept.append(w.end)
        return self._sample(work, logits)

    def _sample(self, work: list[Work], logits: list[torch.Tensor]) -> list[int | None]:
        """A token per sampling item: forced ids as given, greedy rows in one batched argmax (one wait for
        the device per step), the others through their own Sampler."""
        out: list[int | None] = [None] * len(work)
        greedy = []
        for i, (w, lg) in enumerate(zip(work, logits)):
            seq = w.seq
            if not w.samples or seq.req.max_new_tokens == 0:
                continue
            if seq.req.forced_output_ids is not None:
                out[i] = seq.req.forced_output_ids[seq.num_output]
            elif seq.req.sampling.greedy:
                greedy.append(i)
            else:
                out[i] = self._samplers[seq.request_id](lg[-1])
        if greedy:
            for i, token in zip(greedy, argmax_rows([logits[i][-1] for i in greedy])):
                out[i] = token
        else:
            wait_for_device(self.model.device)  # step timings and prefill progress mean work done
        return out

    def release(self, seq: Sequence) -> None:
        state = self._states.get(seq.request_id)
        try:
            if (self.cache is not None and state is not None and seq.finish_reason in ("stop", "length")
                    and state.length >= seq.num_prompt):
                self._cache_turn(seq, state)
        finally:  # whatever happened above, the path this request locked at admission is unlocked
            self._drop_state(seq)

    def _drop_state(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        self._samplers.pop(seq.request_id, None)
        match = self._matches.pop(seq.request_id, None)
        if match is not None:
            self.cache.release(match)
        if state is not None and hasattr(state, "release"):
            state.release()  # a slot state's slot goes back to the pool now, not at garbage collection

    @torch.inference_mode()
    def _cache_turn(self, seq: Sequence, state) -> None:
        """Cache prompt + reply, the last emitted (or stop) token included, and pin it for the session.

        That token was sampled but never fed; the agent's next prompt repeats it (e.g. `<|im_end|>`), so one
        more forward step here makes the next turn reuse exactly up to its edit point instead of one short."""
        tokens = seq.tokens + ([seq.stop_token] if seq.stop_token is not None else [])
        if state.length == len(tokens) - 1:
            last = tokens[-1:]
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
        _check_fits(self.model, kv_tokens, prefix_device_bytes, prefix_host_bytes)
        fast = getattr(self.model, "fast", None)
        if kv_tokens is not None and fast is not None and kv_tokens > fast.pool.capacity:
            raise ValueError(f"the fast path's KV slots hold {fast.pool.capacity} tokens each; restart the "
                             f"server with --context-length {kv_tokens} to allow {kv_tokens}")
        if (prefix_device_bytes or prefix_host_bytes) and self.cache is None:
            raise ValueError("the prefix cache is off (--no-prefix-cache): there is no budget to change")
        if moe_slots is not None:
            experts.resize(moe_slots)  # checks the size before it frees anything
            if fast is not None:
                self.model.decode_steps.reset()  # its graphs read the old slots in place
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


def _check_fits(model, kv_tokens: int | None, device_bytes: int | None, host_bytes: int | None) -> None:
    """Sizes no bigger than the machine: one request's KV and the prefix budgets within its memory."""
    cfg, device = model.config, model.device
    if kv_tokens is not None:
        per_token = 2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize * sum(
            t == FULL for t in cfg.layer_types)
        _within(kv_tokens * per_token, memory_bytes(device), f"a KV budget of {kv_tokens} tokens")
    if device_bytes is not None:
        _within(device_bytes, memory_bytes(device), "the prefix cache's device budget")
    if host_bytes is not None:
        _within(host_bytes, memory_bytes(torch.device("cpu")), "the prefix cache's host budget")


def _within(nbytes: int, total: int, what: str) -> None:
    if nbytes > total:
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB this "
                         "machine has")


def memory_bytes(device: torch.device) -> int:
    """All the memory of the device (host RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
