"""Which sequences run in the next engine step, and what each step's output means. Torch-free.

One step = every running sequence that has finished its prompt decodes one token, and the remaining token
budget (max_step_tokens, or max_prefill_tokens for a model that runs a step layer-major) goes to prompt
chunks (chunked prefill), oldest first; a prompt's short tail (up to an eighth of the budget) rides with its
last full chunk instead of taking a step of its own. Checkpoint positions do not cut chunks: a chunk carries
the positions it covers (Work.checkpoint_positions) and the model snapshots its recurrent state there inside
the one pass (the DeltaNet layers run their recurrence piecewise; projections, attention and experts do not
split, so a checkpoint costs no extra pass over the weights).

One prefill for a prefix in flight: a sequence admitted while another is still prefilling a long prefix
they share (subagents started together, several agents at once) waits instead of computing it again
(`follow`): the leader takes a checkpoint where the two part, and once it has passed there the follower is
handed back (`ready_followers`) to take that prefix from the cache and prefill only the rest.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine.api import FinishReason, GenerateRequest
from engine.common_prefix import common_prefix_len


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
    thinking_since: int | None = None  # output tokens written when the budgeted thinking opened (None: not open)
    leader: Sequence | None = None  # the sequence whose prefill of a shared prefix this one waits for
    shared_at: int = 0  # where the two part: the leader checkpoints there, this one resumes there
    t_submit: float = field(default_factory=time.monotonic)
    t_admit: float = 0.0
    t_first_token: float = 0.0
    t_prefill_done: float = 0.0

    @classmethod
    def from_request(cls, req: GenerateRequest) -> "Sequence":
        n = len(req.prompt_ids)
        opened = 0 if req.thinking_budget is not None and not req.thinking_budget.open_ids else None
        return cls(req, list(req.prompt_ids), n, checkpoint_positions=sorted(set(req.checkpoint_positions) | {n}),
                   thinking_since=opened)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def waiting_for_prefix(self) -> bool:
        return self.leader is not None

    def forced_token(self) -> int | None:
        """The id this sequence's next output must be instead of a sample: a replay script's next id, or the next
        id of the think-end marker once its thinking has used its budget."""
        script = self.req.forced_output_ids
        if script is not None:
            return script[self.num_output]
        if self.thinking_since is None:
            return None
        budget = self.req.thinking_budget
        over = self.num_output - self.thinking_since - budget.tokens  # close ids emitted so far
        return budget.close_ids[over] if 0 <= over < len(budget.close_ids) else None

    def forced_soon(self) -> bool:
        """Whether the output after the next one may be forced (forced_token): a decode step queued before the
        next token is read (EngineCore._chain) would sample it instead."""
        budget = self.req.thinking_budget
        if self.req.forced_output_ids is not None:
            return True
        if budget is None:
            return False
        if self.thinking_since is not None:
            return self.num_output + 1 - self.thinking_since >= budget.tokens
        return bool(budget.open_ids) and budget.tokens == 0  # the next token may open it, spent at once

    def follow_thinking(self) -> None:
        """After an output token: the budgeted thinking opens or closes where the output ends in its marker."""
        budget = self.req.thinking_budget
        marker = budget.close_ids if self.thinking_since is not None else budget.open_ids
        if marker and self.num_output >= len(marker) and self.tokens[-len(marker):] == list(marker):
            self.thinking_since = None if self.thinking_since is not None else self.num_output


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


# A prompt whose last piece would be at most step_budget / TAIL_FOLD tokens takes it in the chunk before:
# a step has a fixed cost a few tokens do not earn back (H200, 8 layers: 8,215 tokens as 4 x 2,048 + 23 spent
# 11-20 ms on the 23, against ~0.3 ms for 23 more rows in a 2,048-token chunk; docs/PERF.md, issue 20).
TAIL_FOLD = 8


class Scheduler:
    """share_min: the fewest tokens a sequence must gain from another one's prefill in flight to wait for
    it (0: never wait; the engine turns it on only with a prefix cache, which hands the prefix over)."""

    def __init__(self, max_running: int = 4, max_step_tokens: int = 512, max_waiting: int = 64,
                 share_min: int = 0, max_prefill_tokens: int | None = None) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        if max_step_tokens < max_running:
            raise ValueError("max_step_tokens must be at least max_running (one decode token each)")
        if share_min < 0:
            raise ValueError(f"share_min must be >= 0 tokens, got {share_min}")
        if max_prefill_tokens is not None and max_prefill_tokens < max_step_tokens:
            raise ValueError(f"max_prefill_tokens ({max_prefill_tokens}) must be at least max_step_tokens "
                             f"({max_step_tokens})")
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        # tokens one step may take in all (decodes + prompt chunks): more than max_step_tokens when the model
        # runs a step layer-major in pieces of max_step_tokens (an expert cache streams once per step)
        self.step_budget = max_prefill_tokens or max_step_tokens
        self.max_waiting = max_waiting
        self.share_min = share_min
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

    def follow(self, seq: Sequence) -> bool:
        """After admission (seq.num_computed = what the cache gave): wait for the sequence admitted before it
        that is still prefilling the longest prefix they share, if that spares at least share_min tokens.
        The leader gets a checkpoint where they part. True if seq now waits."""
        seq.leader = None
        if not self.share_min or not seq.prefilling or seq not in self.running:
            return False
        best, best_at = None, 0
        prompt = seq.tokens[: seq.num_prompt - 1]  # at least one token of its own to prefill
        for other in self.running[: self.running.index(seq)]:  # in admission order: no one waits for itself
            if other.waiting_for_prefix or not other.prefilling:
                continue
            at = common_prefix_len(other.tokens[: other.num_prompt], prompt)
            if at > max(best_at, other.num_computed):
                best, best_at = other, at
        if best is None or best_at - seq.num_computed < self.share_min:
            return False
        seq.leader, seq.shared_at = best, best_at
        if best_at not in best.checkpoint_positions:
            bisect.insort(best.checkpoint_positions, best_at)
        return True

    def ready_followers(self) -> list[Sequence]:
        """Waiting sequences whose leader has prefilled past where they part (or is gone): they take the
        prefix from the cache now (runner re-admission) and may follow again."""
        ready = [s for s in self.running if s.leader is not None and
                 (s.leader.status is not Status.RUNNING or s.leader.num_computed >= s.shared_at)]
        for s in ready:
            s.leader = None
        return ready

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        decodes = [s for s in self.running if not s.prefilling]
        work = [Work(s, s.num_computed, len(s.tokens)) for s in decodes]
        budget = self.step_budget - len(work)
        for seq in self.running:
            if not seq.prefilling or seq.waiting_for_prefix or budget <= 0:
                continue
            end = min(seq.num_prompt, seq.num_computed + budget)
            if 0 < seq.num_prompt - end <= self.step_budget // TAIL_FOLD:
                end = seq.num_prompt  # a short tail rides along rather than cost a step of its own
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
        if req.thinking_budget is not None and forced is None:
            seq.follow_thinking()
        if seq.num_output >= req.max_new_tokens:
            return "length"
        if forced is not None and seq.num_output >= len(forced):
            return "stop"
        return None

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
