"""Anchor planner: which token offsets of a prompt get a resumable checkpoint.

The gated-DeltaNet layers cannot resume at an arbitrary position, so a later turn that edits history at
token e reuses the cache only up to the deepest checkpoint at or before e. Candidates are the render's
segment boundaries; the harness's truncation rules say where future turns will cut (priority 3, the very
next cut 4), the end of
system + tools is shared by every conversation of a harness (2), every message start is a turn boundary
(1, the default), the other boundaries (think, tool-call and tool-response edges) are fine-grained (0).
A per-session budget (count, and bytes at a given size per checkpoint) decides which to keep: highest
priority first, later positions first within a priority.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from proxy.conversation import Conversation, Message, ThinkingPart, ToolResultPart
from proxy.policy.turns import RenderedLike, first_conversation_message, message_spans, prefix_end

IMMINENT_CUT, PREDICTED_CUT, SHARED_PREFIX, TURN_BOUNDARY, FINE = 4, 3, 2, 1, 0
# Checkpoints the engine takes for every request unasked (the prompt end and the generation end, see
# GenerateRequest.checkpoint_positions): a budget leaves room for them.
IMPLICIT_PER_TURN = 2


@dataclass(frozen=True)
class Candidate:
    pos: int
    kind: str  # prefix_end, message_start, before_last_token, think_start/end, tool_call_end, tool_response_start/end,
    #            tools_end, system_end, volatile_start/end, a rule kind
    priority: int = FINE
    message_index: Optional[int] = None


@dataclass(frozen=True)
class AnchorBudget:
    """Checkpoints one session may hold (the engine's implicit two per turn included)."""

    max_count: int = 32
    max_bytes: Optional[int] = None
    bytes_per_checkpoint: int = 0  # recurrent state + KV boundary bookkeeping, from the engine

    def __post_init__(self) -> None:
        if self.max_count < IMPLICIT_PER_TURN:
            raise ValueError(f"anchor budget max_count must be >= {IMPLICIT_PER_TURN} (the engine keeps the "
                             f"prompt end and generation end), got {self.max_count}")

    @property
    def cap(self) -> int:
        if self.max_bytes is not None and self.bytes_per_checkpoint > 0:
            return max(IMPLICIT_PER_TURN, min(self.max_count, self.max_bytes // self.bytes_per_checkpoint))
        return self.max_count


@dataclass(frozen=True)
class AnchorPlan:
    checkpoint_positions: tuple[int, ...]  # new positions for GenerateRequest (start < p < len(prompt))
    keep: tuple[int, ...]  # the session's earlier checkpoint positions still worth holding
    release: tuple[int, ...]  # earlier checkpoint positions dropped by the budget (the engine may evict them)
    reasons: dict  # position -> candidate kind, for the chosen ones


def candidates(rendered: RenderedLike) -> list[Candidate]:
    """Every segment boundary of the render worth a checkpoint, at priority FINE or TURN_BOUNDARY."""
    n = len(rendered.ids)
    out = [Candidate(prefix_end(rendered.segments), "prefix_end", SHARED_PREFIX)]
    # a message start, one token in when every message opens alike: a later turn that replaces the message
    # (with another role, the summary of a compaction, the reply) repeats that token
    opener = opening_token(rendered)
    out += [Candidate(_past(rendered.ids, lo, opener) if lo else lo, "message_start", TURN_BOUNDARY, i)
            for i, (lo, _) in message_spans(rendered.segments).items()]
    # the prompt's last token: the next turn re-renders it followed by the reply and may tokenise the two
    # together differently ("<think>\n" + "\n</think>" -> "<think>" "\n\n" "</think>"): one token back
    if n > 1:
        out.append(Candidate(n - 1, "before_last_token", TURN_BOUNDARY))
    # a request that adds a message instead of the reply (a summary request, a user interrupting) cuts here
    out += [Candidate(_past(rendered.ids, s.start, opener), "generation_prompt_start", TURN_BOUNDARY)
            for s in rendered.segments if s.kind == "generation_prompt"]
    # tools connected mid-session (MCP servers) are added at the end of the list, system text at its end
    out += [Candidate(b.end, f"{t.kind}_end", SHARED_PREFIX) for t in rendered.segments
            if t.kind in ("tools", "system") for b in _bodies(rendered, t)]
    # the stable-first layout's volatile lines: every conversation of the harness shares what comes before
    # them; system text added later lands at their end
    out += [Candidate(pos, kind, SHARED_PREFIX) for v in rendered.segments if v.kind == "volatile"
            for pos, kind in ((v.start, "volatile_start"), (v.end, "volatile_end"))]
    edges = {"think": ("think_start", "think_end"), "tool_response": ("tool_response_start", "tool_response_end"),
             "tool_call": (None, "tool_call_end")}
    for s in rendered.segments:
        start_kind, end_kind = edges.get(s.kind, (None, None))
        if start_kind:
            out.append(Candidate(s.start, start_kind, FINE, s.message_index))
        if end_kind:
            out.append(Candidate(s.end, end_kind, FINE, s.message_index))
    return [c for c in out if 0 < c.pos <= n]


def predicted_cuts(rendered: RenderedLike, rules: Sequence, conv: Optional[Conversation] = None) -> dict[int, tuple]:
    """Positions where the harness's rules say a later turn will cut -> (rule kind, priority).

    Every block a rule will eventually cut (a tool output not yet elided, a reasoning block not yet
    stripped, an observation) is a future cut, PREDICTED_CUT; it must be anchored while it is new, since
    an anchor can only be taken while its position is being prefilled. The block the next turn cuts (the
    n-th latest) is IMMINENT_CUT, so the budget keeps it longest.
    """
    cuts: dict[int, tuple] = {}
    spans = message_spans(rendered.segments)
    for rule in rules:
        find = RULE_CUTS.get(rule.kind)
        blocks, n = find(rule, rendered, conv, spans) if find is not None else ([], 0)
        imminent = sorted(set(blocks))[-n] if 0 < n <= len(set(blocks)) else None
        for pos in blocks:
            priority = IMMINENT_CUT if pos == imminent else PREDICTED_CUT
            if pos and cuts.get(pos, ("", -1))[1] < priority:
                cuts[pos] = (rule.kind, priority)
    return cuts


# What each rule kind cuts, as (block starts, n): the blocks a later turn will cut, and which of them (the
# n-th latest; 0: none in particular) the very next turn cuts. `spans` is message_spans(rendered.segments).
def _trailing_message_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    if not spans:
        return [], 1
    last = max(spans)
    if conv is None or last >= len(conv.messages) or rule.marker in conv.messages[last].text:
        return [past_opening_token(rendered, spans[last][0])], 1
    return [], 1


def _thinking_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    return _live_blocks(rendered, "think", conv, lambda m: _reasoning(m) != ""), rule.n


def _tool_output_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    """The output is replaced after "<tool_response>\n"."""
    def alive(msg: Message) -> bool:
        return rule.placeholder not in _results(msg)

    return _live_blocks(rendered, "tool_response", conv, alive, inside=True), rule.n


def _observation_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    return [body_start(rendered, p) for p in _observation_starts(spans, rendered, conv, rule.placeholder)], rule.n


def _compaction_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    """The summary replaces the first conversation message's text, after the system + tools prefix."""
    end = prefix_end(rendered.segments)
    if not end:
        return [], 1
    first = first_conversation_message(rendered.segments, conv)
    return [end] + ([body_start(rendered, spans[first][0])] if first in spans else []), 1


def _volatile_cuts(rule, rendered: RenderedLike, conv: Optional[Conversation], spans: dict):
    """Rewritten in place some later turn, nobody knows which."""
    return volatile_positions(rendered, rule.pattern), 0


RULE_CUTS = {
    "replace_trailing_message": _trailing_message_cuts,
    "strip_thinking_except_latest_n": _thinking_cuts,
    "elide_tool_outputs_beyond_n": _tool_output_cuts,
    "elide_observations_except_last_n": _observation_cuts,
    "compaction": _compaction_cuts,
    "volatile_text": _volatile_cuts,
}


def opening_token(rendered: RenderedLike) -> Optional[int]:
    """The token every message (after the first) and the generation prompt open with (`<|im_start|>` in
    ChatML), or None when they do not share one."""
    ids = rendered.ids
    gen = next((s.start for s in rendered.segments if s.kind == "generation_prompt"), None)
    if gen is None or gen >= len(ids):
        return None
    starts = [lo for lo, _ in message_spans(rendered.segments).values() if lo]
    return ids[gen] if starts and all(ids[lo] == ids[gen] for lo in starts) else None


def past_opening_token(rendered: RenderedLike, pos: int) -> int:
    """pos + 1 when the message (or generation prompt) starting at pos opens with the opening_token:
    whatever replaces it, the reply or another message, repeats that token, so the edit comes one token
    later and a checkpoint there is exact. Else pos."""
    return _past(rendered.ids, pos, opening_token(rendered))


def _past(ids, pos: int, opener: Optional[int]) -> int:
    return pos + 1 if opener is not None and pos < len(ids) and ids[pos] == opener else pos


def volatile_positions(rendered: RenderedLike, pattern: str, limit: int = 8) -> list[int]:
    """Token boundaries at or before each match of `pattern` in the rendered text: at the start of each of
    its groups that took part, or of the match when it has none. Renders without text and offsets (test
    doubles) have none. At most `limit` matches, the earliest."""
    text, locate = getattr(rendered, "text", None), getattr(rendered, "boundary_at_or_before", None)
    if not text or locate is None:
        return []
    found = []
    for k, match in enumerate(re.finditer(pattern, text)):
        if k == limit:
            break
        starts = [match.start(g) for g in range(1, match.re.groups + 1)] or [match.start()]
        found += [locate(c) for c in starts if c >= 0]
    return found


def _reasoning(msg: Message) -> str:
    return "".join(p.text for p in msg.parts if isinstance(p, ThinkingPart))


def _results(msg: Message) -> str:
    return "".join(p.content for p in msg.parts if isinstance(p, ToolResultPart)) + msg.text


def _bodies(rendered: RenderedLike, seg) -> list:
    """Body segments directly inside `seg` (see proxy/prompt/render.py: a block's text after its opening line)."""
    inner = [b for b in rendered.segments if b.kind == "body" and seg.start <= b.start and b.end <= seg.end
             and b is not seg and b.message_index == seg.message_index]
    return sorted(inner, key=lambda b: b.start)[:1]


def body_start(rendered: RenderedLike, pos: int) -> int:
    """Where the text of the message or block starting at `pos` begins (pos itself when there is no body)."""
    after = [b.start for b in rendered.segments if b.kind == "body" and b.start > pos]
    owners = [s for s in rendered.segments if s.start == pos and s.kind != "body"]
    inside = [p for p in after if any(p < s.end for s in owners)]
    return min(inside, default=pos)


def _live_blocks(rendered: RenderedLike, kind: str, conv: Optional[Conversation], alive,
                 inside: bool = False) -> list[int]:
    """Starts of `kind` segments whose message (per `alive`) has not been cut yet (of their bodies: inside)."""
    out = []
    for s in rendered.segments:
        if s.kind != kind:
            continue
        msg = conv.messages[s.message_index] if conv is not None and s.message_index is not None \
            and s.message_index < len(conv.messages) else None
        if msg is None or alive(msg):
            out.append(body_start(rendered, s.start) if inside else s.start)
    return out


def _observation_starts(spans: dict, rendered: RenderedLike, conv: Optional[Conversation],
                        placeholder: str) -> list[int]:
    """Starts of observation messages not yet shortened: tool messages, or user messages after the first."""
    if conv is None:
        return [spans[s.message_index][0] for s in rendered.segments
                if s.kind == "tool_response" and s.message_index in spans]
    task = next((i for i, m in enumerate(conv.messages) if m.role == "user"), -1)
    obs = [i for i, m in enumerate(conv.messages) if m.role == "tool" or (m.role == "user" and i != task)]
    return [spans[i][0] for i in obs if i in spans and not (placeholder and placeholder in _results(conv.messages[i]))]


def plan_anchors(rendered: RenderedLike, rules: Sequence = (), start: int = 0, existing: Sequence[int] = (),
                 budget: AnchorBudget = AnchorBudget(), conv: Optional[Conversation] = None,
                 min_priority: int = TURN_BOUNDARY) -> AnchorPlan:
    """Choose checkpoint positions for one request.

    start: where prefill resumes (positions at or before it are already cached, not takeable now).
    existing: the session's earlier checkpoint positions; those within the reused prefix (<= start) compete
        for the budget with the new ones.
    """
    n = len(rendered.ids)
    pool: dict[int, Candidate] = {}
    for c in candidates(rendered):
        if c.priority >= min_priority and c.pos < n:
            _offer(pool, c)
    for pos, (kind, priority) in predicted_cuts(rendered, rules, conv).items():
        if pos < n:
            _offer(pool, Candidate(pos, kind, priority))
    old = sorted(p for p in set(existing) if 0 < p <= start)
    fresh = [c for p, c in pool.items() if p > start]
    # an earlier anchor that is no boundary of this render (an old prompt end, one-token-back) goes first
    held = [pool.get(p, Candidate(p, "earlier", FINE)) for p in old]
    ranked = sorted(held + fresh, key=lambda c: (c.priority, c.pos), reverse=True)
    chosen = ranked[: budget.cap - IMPLICIT_PER_TURN]
    chosen_pos = {c.pos for c in chosen}
    return AnchorPlan(
        checkpoint_positions=tuple(sorted(c.pos for c in chosen if c.pos > start)),
        keep=tuple(p for p in old if p in chosen_pos),
        release=tuple(p for p in old if p not in chosen_pos),
        reasons={c.pos: c.kind for c in chosen},
    )


def _offer(pool: dict[int, Candidate], c: Candidate) -> None:
    if c.pos not in pool or pool[c.pos].priority < c.priority:
        pool[c.pos] = c


def resume_position(checkpoint_positions: Sequence[int], edit_point: int) -> int:
    """Deepest checkpoint at or before the edit point: where prefill resumes (0: from scratch)."""
    return max((p for p in checkpoint_positions if p <= edit_point), default=0)
