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
from engine.penalties import PenaltyPool
from engine.sampling import Readback, Sampler, sample_rows
from engine.scheduler import Sequence, Work


SMALL_STEP = 128  # tokens: below this a CPU step runs single-threaded (see ModelRunner.__init__)


def cpu_step_threads() -> int:
    """Intra-op threads for a CPU engine's long steps: OMP_NUM_THREADS where the user set it, else every thread
    torch would use but one. The proxy's event loop (and the replaying client in `killick demo`) shares the
    process; where it takes a core from a step's OpenMP team, every op of the step waits for the preempted
    worker at its barrier. On the 2-core dev box `killick demo`'s uncached prompts of 1.3-1.9k tokens took 0.8x
    the time with 1 thread that they took with 2 (docs/PERF.md, "CPU steps beside the proxy")."""
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, torch.get_num_threads())
    return max(1, torch.get_num_threads() - 1)


class StateCache(Protocol):
    """The prefix cache as the runner sees it (engine/cache/store.PrefixStore implements it)."""

    def acquire(self, tokens: list[int]) -> tuple[object, object | None]: ...  # (match, restored state)

    def release(self, match) -> None: ...

    def insert(self, tokens: list[int], state, session_key: str | None = None) -> None: ...

    def set_budgets(self, device: int | None = None, host: int | None = None) -> None: ...

    def stats(self) -> dict: ...


class ModelRunner:
    def __init__(self, model, context_length: int | None = None, cache: StateCache | None = None,
                 overlap: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length or 32768
        self._states: dict[str, object] = {}
        self._samplers: dict[str, Sampler] = {}
        self._penalties = PenaltyPool(self.vocab_size, model.device)  # counts of sequences with penalties
        self._matches: dict[str, object] = {}
        self.steps = 0
        self._readback = Readback(depth=2)  # a chained step's tokens travel while the host reads the last's
        # EngineCore queues the next decode step before it reads this one's tokens (chain), so the host's work
        # between steps runs while the device computes; by default on CUDA, where a queued step runs alone
        self.overlap = model.device.type == "cuda" if overlap is None else overlap
        # On CPU, steps of a few tokens run on one intra-op thread: their ops are too small to split, and
        # torch's other threads only fight the proxy's event loop for the cores (a 40-token step took 2x
        # as long on 2 threads next to a streaming proxy). Long prefill chunks get cpu_step_threads().
        self._cpu_threads = cpu_step_threads() if self.model.device.type == "cpu" else 0

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
        if seq.req.forced_output_ids is None:
            self._penalties.add(seq.request_id, seq.req.sampling)

    def readmit(self, seq: Sequence) -> None:
        """Admit again a sequence that computed nothing yet: the prefill it waited for cached a longer prefix."""
        self._drop_state(seq)
        seq.num_computed = seq.reused = 0
        seq.cache_tier = "none"
        self.admit(seq)

    def step(self, work: list[Work]) -> list[int | None]:
        return self.launch(work).tokens()

    def idle(self) -> bool:
        """Background work while no request runs or waits (EngineCore calls it between requests, a bounded
        piece at a time): the expert cache's refresh (OffloadBackend.refresh). -> whether more remains."""
        refresh = getattr(getattr(self.model, "experts", None), "refresh", None)
        return refresh is not None and refresh() > 0

    @torch.inference_mode()
    def launch(self, work: list[Work]) -> "Launched":
        """Queue one step (forward, checkpoints, sampling) on the device; its tokens are read by tokens()."""
        # token ids stay host-side lists: the model moves them (a decode step reads them as ints)
        items = [(w.seq.tokens[w.start : w.end], self._states[w.seq.request_id]) for w in work]
        if self._cpu_threads:
            threads = self._cpu_threads if sum(w.end - w.start for w in work) >= SMALL_STEP else 1
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
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
        samples = [w.samples and w.seq.req.max_new_tokens > 0 for w in work]
        return self._sample(work, logits, samples)

    @torch.inference_mode()
    def chain(self, last: "Launched", work: list[Work]) -> "Launched":
        """Queue the decode step after `last` before its tokens reach the host: each item of `work` (one token
        past a sequence of last's, which sampled there) feeds the token last sampled for that sequence, on the
        device. The caller drops the rows of sequences that last's tokens end; their states have taken one
        token more (a stop token: what the turn's cache entry takes anyway, see _cache_turn)."""
        rows = [last.row(w.seq) for w in work]
        # (a subset picked by int views and one stack: indexing by a list would copy the list to the device)
        ids = last.ids if rows == list(range(last.ids.shape[0])) else torch.stack([last.ids[r] for r in rows])
        items = [(ids[i : i + 1], self._states[w.seq.request_id]) for i, w in enumerate(work)]
        logits = self.model.forward(items, logits="last")
        self.steps += 1
        return self._sample(work, logits, [True] * len(work))

    def _sample(self, work: list[Work], logits: list[torch.Tensor], samples: list[bool]) -> "Launched":
        """A token per sampling item, queued on the device: forced ids (a script's, the end of thinking past its
        budget) as given, the others drawn by their Sampler (greedy rows in one argmax) after the penalties of
        those that ask for them, all read back by one copy when tokens() asks."""
        forced: dict[int, int] = {}
        drawn = []
        for i, (w, sampling) in enumerate(zip(work, samples)):
            if not sampling:
                continue
            token = w.seq.forced_token()
            if token is not None:
                forced[i] = token
            else:
                drawn.append(i)
        ids = None
        if drawn:
            request_ids = [work[i].seq.request_id for i in drawn]
            rows, counted = self._penalties.apply(request_ids, [logits[i][-1] for i in drawn])
            ids = sample_rows(rows, [self._samplers[r] for r in request_ids])
            self._penalties.count(counted, ids)
        # without draws, a step still waits for the device: step timings and prefill progress mean work done
        read = self._readback.start(ids) if ids is not None else _device_done(self.model.device)
        return Launched(work, forced, drawn, ids, read)

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
        self._penalties.drop(seq.request_id)
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

    def close(self) -> None:
        """The expert backend's worker threads end (EngineCore.stop); it starts them again if used later."""
        close = getattr(getattr(self.model, "experts", None), "close", None)
        if close is not None:
            close()

    def stats(self) -> dict:
        out = {"live_states": len(self._states), "steps": self.steps, "context_length": self.context_length}
        experts = getattr(self.model, "experts", None)
        if experts is not None and hasattr(experts, "stats"):
            out["experts"] = experts.stats()
        if self.cache is not None:
            out.update(self.cache.stats())
        return out


class Launched:
    """A step queued on the device (ModelRunner.launch / chain). tokens(): its token per item (None where
    the item does not sample), read from the device once."""

    def __init__(self, work: list[Work], forced: dict[int, int], drawn: list[int], ids: torch.Tensor | None,
                 read) -> None:
        self.work, self.ids = work, ids  # ids: the drawn tokens [len(drawn)] int64 on the device
        self._forced, self._drawn, self._read = forced, drawn, read
        self._rows = {work[i].seq.request_id: r for r, i in enumerate(drawn)}
        self._tokens: list[int | None] | None = None

    def row(self, seq: Sequence) -> int:
        """The row of ids holding seq's drawn token (KeyError: seq's item drew none)."""
        return self._rows[seq.request_id]

    def tokens(self) -> list[int | None]:
        if self._tokens is None:
            out: list[int | None] = [None] * len(self.work)
            for i, token in self._forced.items():
                out[i] = token
            values = self._read()
            for i, token in zip(self._drawn, values or ()):
                out[i] = token
            self._tokens = out
        return self._tokens


def _device_done(device: torch.device):
    """-> a function that waits (GIL released) until the device finished the work queued so far."""
    if device.type != "cuda":
        return lambda: None
    done = torch.cuda.Event()
    done.record()
    return done.synchronize


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
