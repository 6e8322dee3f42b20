"""What the cache policy reads from a render, and the per-turn record it writes for metrics. Torch-free.

The policy modules (diff, anchors, sessions) take any object shaped like proxy/prompt/render.py's `Rendered`
(`ids`, `segments`) whose segments look like its `Segment` (`kind`, `start`, `end`, `message_index`,
token offsets, end exclusive). They never import the renderer, so they are testable on hand-built lists.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional, Protocol, Sequence

EditClass = Literal[
    "first",  # no earlier turn in this session
    "append",  # the new prompt extends the previous prompt + generated reply
    "rewind",  # the new prompt is a prefix of what was there (retry, regenerate)
    "reply_rerendered",  # the agent sent the last reply back in another form than it was generated
    "tail_replacement",  # the last message of the previous prompt was replaced (OpenClaw internal context)
    "tool_output_elision",  # an old tool output / observation was cleared (OpenCode prune, SWE-agent)
    "thinking_stripped",  # an earlier reasoning block was dropped or shortened
    "system_changed",
    "tools_changed",
    "compaction",  # history rebuilt from a summary (declared by the harness's Compaction rule)
    "new_history",  # the history diverges at its first message: a different conversation
    "history_edit",  # any other edit inside the history
]


class SegmentLike(Protocol):
    kind: str  # system, tools, message, think, tool_call, tool_response, body, generation_prompt
    start: int
    end: int
    message_index: Optional[int]


class RenderedLike(Protocol):
    ids: Sequence[int]
    segments: Sequence[SegmentLike]


def segments_at(segments: Sequence[SegmentLike], pos: int) -> list:
    """Segments covering token `pos`, innermost (shortest) first."""
    hits = [s for s in segments if s.start <= pos < s.end]
    return sorted(hits, key=lambda s: s.end - s.start)


def message_spans(segments: Sequence[SegmentLike]) -> dict[int, tuple[int, int]]:
    """message_index -> (start, end) token span, over every segment carrying that index."""
    spans: dict[int, tuple[int, int]] = {}
    for s in segments:
        if s.message_index is None or s.kind in ("system", "tools", "generation_prompt"):
            continue
        lo, hi = spans.get(s.message_index, (s.start, s.end))
        spans[s.message_index] = (min(lo, s.start), max(hi, s.end))
    return spans


def first_conversation_message(segments: Sequence[SegmentLike], conv=None) -> Optional[int]:
    """Index of the first rendered message that is not a system message (roles from `conv` if given,
    else the message that owns the render's system segment is skipped)."""
    system = {s.message_index for s in segments if s.kind == "system"}
    for idx in sorted(message_spans(segments)):
        if idx in system:
            continue
        if conv is None or idx >= len(conv.messages) or conv.messages[idx].role != "system":
            return idx
    return None


def prefix_end(segments: Sequence[SegmentLike]) -> int:
    """End of the system + tools block (0 when the render has neither)."""
    return max((s.end for s in segments if s.kind in ("system", "tools")), default=0)


def from_other_sessions(reused: int, edit_point: int, edit_class: str) -> int:
    """Of a request's reused (cached) tokens, those its own session had not sent before, so another session
    put them in the cache (another conversation of the harness, a subagent, the main conversation for a side
    request): all of them on a session's first request, those past its edit point on a later one."""
    return max(0, reused - (0 if edit_class == "first" else edit_point))


@dataclass(frozen=True)
class TurnRecord:
    """One request of one session, as the metrics see it. Plain data: the proxy exports it."""

    session_key: str
    harness: str
    turn_index: Optional[int]  # 0 for the session's first request; None until the backend took it (admit)
    request_kind: str  # "main", "title", "compaction"
    prompt_tokens: int
    edit_point: int  # first token differing from the previous turn's prompt + reply (first turn: from any session)
    edit_class: EditClass
    anchor_used: int  # deepest known checkpoint at or before the edit point: where prefill should resume
    expected_reprefill: int  # prompt_tokens - anchor_used: what the policy expects the engine to prefill
    checkpoint_positions: tuple[int, ...] = ()  # what this request asked the engine to keep
    reused_tokens: Optional[int] = None  # from the engine's Usage once the request finished
    prefilled_tokens: Optional[int] = None
    cache_tier: str = "none"
    ttft_s: Optional[float] = None
    shared_tokens: Optional[int] = None  # of the reused tokens, those from another session (from_other_sessions)

    def with_usage(self, usage) -> "TurnRecord":
        """Fill in what the engine reports (an engine.api.Usage or anything with the same fields)."""
        return replace(self, reused_tokens=usage.reused_tokens, prefilled_tokens=usage.prefilled_tokens,
                       cache_tier=usage.cache_tier, ttft_s=usage.ttft_s,
                       shared_tokens=from_other_sessions(usage.reused_tokens, self.edit_point, self.edit_class))

    def row(self) -> dict:
        """The turn as `killick ctl stats` shows it (a list entry, so /metrics does not export it)."""
        turn = None if self.turn_index is None else self.turn_index + 1
        return {"session": self.session_key, "turn": turn, "kind": self.request_kind,
                "harness": self.harness, "prompt": self.prompt_tokens, "edit_point": self.edit_point,
                "edit_class": self.edit_class, "resume_at": self.anchor_used,
                "expected_prefill": self.expected_reprefill, "cached": self.reused_tokens,
                "prefilled": self.prefilled_tokens,
                "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000)}

    @property
    def wasted_tokens(self) -> Optional[int]:
        """Tokens prefilled beyond what the edit point required (None until usage arrives)."""
        if self.prefilled_tokens is None:
            return None
        return max(0, self.prefilled_tokens - (self.prompt_tokens - self.edit_point))


def summarize(records) -> dict:
    """Totals over TurnRecords for /metrics: turns per edit class and request kind, tokens expected to be
    re-prefilled, and (where the engine reported) reused, prefilled and from-other-session tokens."""
    out: dict = {"turns": 0, "by_edit_class": {}, "by_request_kind": {}, "prompt_tokens": 0,
                 "expected_reprefill_tokens": 0, "reused_tokens": 0, "prefilled_tokens": 0, "shared_tokens": 0}
    for r in records:
        out["turns"] += 1
        out["by_edit_class"][r.edit_class] = out["by_edit_class"].get(r.edit_class, 0) + 1
        out["by_request_kind"][r.request_kind] = out["by_request_kind"].get(r.request_kind, 0) + 1
        out["prompt_tokens"] += r.prompt_tokens
        out["expected_reprefill_tokens"] += r.expected_reprefill
        out["reused_tokens"] += r.reused_tokens or 0
        out["prefilled_tokens"] += r.prefilled_tokens or 0
        out["shared_tokens"] += r.shared_tokens or 0
    return out
