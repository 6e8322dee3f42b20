"""Which sequences run in the next engine step, and what each step's output means. Torch-free.

One step = every running sequence that has finished its prompt decodes one token, and the remaining token
budget goes to prompt chunks (chunked prefill), oldest first. Checkpoint positions do not cut chunks: a
chunk carries the positions it covers (Work.checkpoint_positions) and the model snapshots its recurrent state there inside
the one pass (the DeltaNet layers run their recurrence piecewise; projections, attention and experts do not
split, so a checkpoint costs no extra pass over the weights).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine.api import FinishReason, GenerateRequest


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    req: GenerateRequest
    tokens: list[int]  # prompt + generated; the model state covers tokens[:num_computed]
    num_prompt: int
    num_computed: int = 0
    num_output: int = 0
    reused: int = 0  # prompt tokens taken from the prefix cache at admission
    stop_token: int | None = None  # the stop id that ended generation: sampled, not emitted, not fed
    cache_tier: str = "none"
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    checkpoint_positions: list[int] = field(default_factory=list)  # sorted prompt positions to snapshot
    checkpoints_kept: list[int] = field(default_factory=list)  # where the prefix cache took one (-> Usage)
    t_submit: float = field(default_factory=time.monotonic)
    t_admit: float = 0.0
    t_first_token: float = 0.0
    t_prefill_done: float = 0.0

    @classmethod
    def from_request(cls, req: GenerateRequest) -> "Sequence":
        n = len(req.prompt_ids)
        return cls(req, list(req.prompt_ids), n, checkpoint_positions=sorted(set(req.checkpoint_positions) | {n}))

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt


@dataclass(frozen=True)
class Work:
    """Feed seq.tokens[start:end] to the model; sample if end reaches the end of the known tokens."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.tokens)

    @property
    def checkpoint_here(self) -> bool:
        return self.end in self.seq.checkpoint_positions

    @property
    def checkpoint_positions(self) -> tuple[int, ...]:
        """Checkpoint positions strictly inside this chunk (the end one is checkpoint_here)."""
        cps = self.seq.checkpoint_positions
        lo, hi = bisect.bisect_right(cps, self.start), bisect.bisect_left(cps, self.end)
        return tuple(cps[lo:hi])


class Scheduler:
    def __init__(self, max_running: int = 4, max_step_tokens: int = 512, max_waiting: int = 64) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        if max_step_tokens < max_running:
            raise ValueError("max_step_tokens must be at least max_running (one decode token each)")
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- admission -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise OverflowError(f"queue full ({self.max_waiting} waiting)")
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free running slots; the caller restores their cached prefix."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.t_admit = time.monotonic()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def remove(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        decodes = [s for s in self.running if not s.prefilling]
        work = [Work(s, s.num_computed, len(s.tokens)) for s in decodes]
        budget = self.max_step_tokens - len(work)
        for seq in self.running:
            if not seq.prefilling or budget <= 0:
                continue
            end = min(seq.num_prompt, seq.num_computed + budget)
            work.append(Work(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        return work

    def advance(self, item: Work, token: int | None) -> FinishReason | None:
        """Record a finished work item; `token` is what was sampled (None if this chunk does not sample)."""
        seq = item.seq
        seq.num_computed = item.end
        if token is None:
            # a prefill-only request (max_new_tokens 0) ends when its prompt is in the cache
            return "length" if seq.req.max_new_tokens == 0 and not seq.prefilling else None
        now = time.monotonic()
        if seq.num_output == 0:
            seq.t_first_token = now
            seq.t_prefill_done = seq.t_prefill_done or now
        seq.num_output += 1
        req = seq.req
        forced = req.forced_output_ids
        if token in req.stop_ids and forced is None:
            seq.stop_token = token
            return "stop"
        seq.tokens.append(token)
        if seq.num_output >= req.max_new_tokens:
            return "length"
        if forced is not None and seq.num_output >= len(forced):
            return "stop"
        return None

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
