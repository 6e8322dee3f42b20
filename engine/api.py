"""The proxy<->engine contract (docs/CONTRACTS.md). Torch-free: the proxy imports this and nothing heavier.

What crosses: a GenerateRequest in, a stream of TokenEvents out. The engine never sees JSON and the proxy
never touches tensors.
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
CacheTier = Literal["none", "device", "host"]

_ids = itertools.count(1)


def new_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean 'off'; seed makes sampling reproducible.
    frequency_penalty / presence_penalty (OpenAI's; 0 means off): before each draw, token j's logit loses
    frequency_penalty * c + presence_penalty * (c > 0), c being how often the output so far holds j."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class AbortHandle:
    """Set by the caller (e.g. on client disconnect); the scheduler frees the request at its next step."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def abort(self) -> None:
        self._event.set()

    @property
    def aborted(self) -> bool:
        return self._event.is_set()


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` output tokens of thinking. The thinking runs from the output's start (open_ids empty: the
    prompt opened it) or from where the output writes open_ids, until it writes close_ids. Once it holds
    `tokens` tokens and is still open, the engine emits close_ids next, as if the model had written them, and
    feeds them to the model, so the answer follows."""

    tokens: int
    close_ids: tuple[int, ...]  # the think-end marker's ids (Qwen: `</think>`)
    open_ids: tuple[int, ...] = ()  # the think-open marker's ids, where the output opens the thinking itself

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a thinking budget must be >= 0 tokens, got {self.tokens}")
        if not self.close_ids:
            raise ValueError("a thinking budget needs the think-end marker's token ids (close_ids)")


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    # Token offsets (0 < p <= len(prompt_ids)) where the engine keeps a resumable copy of the recurrent
    # state and a KV boundary. The engine always adds the end of the prompt and the end of generation.
    checkpoint_positions: tuple[int, ...] = ()
    session_key: str | None = None
    # Replay / scripted mode: the engine runs every decode step on the model but emits these ids instead
    # of sampling. Generation ends when they run out (finish_reason "stop") or at max_new_tokens.
    forced_output_ids: list[int] | None = None
    thinking_budget: ThinkingBudget | None = None  # ignored where forced_output_ids gives the whole output
    abort: AbortHandle = field(default_factory=AbortHandle)
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        n = len(self.prompt_ids)
        bad = [p for p in self.checkpoint_positions if not 0 < p <= n]
        if bad:
            raise ValueError(f"checkpoint positions {bad} fall outside the prompt (1..{n})")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    output_tokens: int
    reused_tokens: int  # prompt tokens served from the prefix cache (the 'cached tokens' agents see)
    prefilled_tokens: int  # prompt tokens actually run through the model: prompt - reused
    cache_tier: CacheTier = "none"  # where the reused prefix came from
    queue_s: float = 0.0  # submit -> first scheduled
    ttft_s: float = 0.0  # submit -> first output token
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Positions where the prefix cache kept a checkpoint for this request (ascending): the requested
    # checkpoint_positions it prefilled past, the prompt end and the generation end.
    checkpoints_kept: tuple[int, ...] = ()
    # The stop id that ended the output (sampled, not emitted): the turn's cache runs through it, since the next
    # prompt repeats it (`<|im_end|>`); None when the output ended otherwise.
    stop_token: int | None = None

    @property
    def decode_tok_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 and self.output_tokens > 1 else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output. The last event has finish_reason and usage set."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None  # set with finish_reason "error": a sentence for the user
    # Progress while the request waits or prefills (no tokens yet): lets the proxy send keep-alives.
    prefilled_so_far: int | None = None
    # Set on one event (no tokens) once the engine has admitted the request and settled what the prefix cache
    # gives it, before its prefill: the prompt tokens reused, as the final Usage reports them (an agent's API
    # announces the split before the answer: Anthropic's message_start).
    reused_tokens: int | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None
