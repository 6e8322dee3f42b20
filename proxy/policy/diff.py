"""Diff of one turn against the session's previous one: the edit point and what kind of edit it was.

The edit point is the first token where the new rendered prompt differs from the previous turn's prompt
followed by what was generated for it. Everything before it can be reused; the engine's prefix cache is
the ground truth of reuse, this is the explanation (metrics) and the input to the anchor planner.

Classification looks at where the edit point falls in both renders' segments:
  prev segment kind system/tools             -> system_changed / tools_changed
  a Compaction rule's marker in the new text -> compaction
  inside a <think> block                     -> thinking_stripped
  inside the previous prompt's last message  -> tail_replacement
  inside the first conversation message      -> new_history
  inside a tool response / observation       -> tool_output_elision
  inside the generated reply                 -> thinking_stripped when the new render has no <think> there,
                                                else reply_rerendered
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

from engine.common_prefix import common_prefix_len, id_array
from harness_adapters.rules import Compaction, ElideObservationsExceptLastN, rules_of
from proxy.conversation import Conversation
from proxy.policy.turns import EditClass, RenderedLike, first_conversation_message, message_spans, segments_at


@dataclass(frozen=True)
class PreviousTurn:
    """What the session remembers of its last turn."""

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    segments: tuple  # the previous render's segments (prompt offsets)
    conversation: Optional[Conversation] = None  # roles of messages, for observation rules

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.generated_ids

    @cached_property
    def id_array(self) -> array:
        """ids as an array, made once: sessions compare every new prompt with it (common_prefix.id_array)."""
        return id_array(self.ids)


@dataclass(frozen=True)
class Edit:
    edit_point: int
    edit_class: EditClass
    message_index: Optional[int] = None  # previous turn's message the edit falls in, where there is one
    segment_kind: str = ""  # innermost previous-turn segment kind at the edit point ("generation" in the reply)


def diff_turn(prev: Optional[PreviousTurn], new: RenderedLike, new_conv: Optional[Conversation] = None,
              rules: Sequence = ()) -> Edit:
    """Edit point and class of `new` against `prev` (None: the session's first turn)."""
    if prev is None:
        return Edit(0, "first")
    old = prev.ids
    e = common_prefix_len(old, new.ids)
    if e >= len(old):
        return Edit(e, "append", segment_kind="end")
    if e >= len(new.ids):
        return Edit(e, "rewind")
    if e >= _generation_start(prev):
        return Edit(e, _reply_edit(new, e), segment_kind="generation")
    return _history_edit(prev, new, e, new_conv, rules)


def _generation_start(prev: PreviousTurn) -> int:
    """Where the assistant turn being generated began: the generation prompt's start, else the prompt end.

    An edit inside the generation prompt (e.g. "<think>\n" re-tokenised as "<think>\n\n" once the reply
    is sent back without reasoning) is an edit of the reply, not of the history."""
    return min((s.start for s in prev.segments if s.kind == "generation_prompt"), default=len(prev.prompt_ids))


def _reply_edit(new: RenderedLike, e: int) -> EditClass:
    """Divergence inside the reply we generated: did the agent drop its reasoning, or re-render it?

    Inside the new render's <think> block (or a message without one): the reasoning was dropped or cut.
    After it: the agent re-rendered the reply (e.g. a tokenizer merge at the boundary).
    """
    hits = segments_at(new.segments, e)
    if any(s.kind == "think" for s in hits):
        return "thinking_stripped"
    msg = next((s.message_index for s in hits if s.message_index is not None), None)
    if msg is None:
        return "reply_rerendered"
    has_think = any(s.kind == "think" and s.message_index == msg for s in new.segments)
    return "reply_rerendered" if has_think else "thinking_stripped"


def _history_edit(prev: PreviousTurn, new: RenderedLike, e: int, new_conv: Optional[Conversation],
                  rules: Sequence) -> Edit:
    hits = segments_at(prev.segments, e)
    kinds = {s.kind for s in hits}
    kind = hits[0].kind if hits else ""
    msg = next((s.message_index for s in hits if s.message_index is not None), None)
    if "tools" in kinds:
        return Edit(e, "tools_changed", msg, "tools")
    if "system" in kinds or (msg is None and e < _first_message_start(prev.segments)):
        return Edit(e, "system_changed", msg, "system")
    if _has_compaction_marker(new_conv, msg, rules):
        return Edit(e, "compaction", msg, kind)
    if any(s.kind == "think" for s in hits):
        return Edit(e, "thinking_stripped", msg, kind)
    spans = message_spans(prev.segments)
    if msg is not None and spans and msg == max(spans):
        return Edit(e, "tail_replacement", msg, kind)
    if msg is not None and msg == first_conversation_message(prev.segments, prev.conversation):
        return Edit(e, "new_history", msg, kind)
    if any(s.kind == "tool_response" for s in hits) or _is_observation(prev, msg, rules):
        return Edit(e, "tool_output_elision", msg, kind)
    return Edit(e, "history_edit", msg, kind)


def _first_message_start(segments: Sequence) -> int:
    spans = message_spans(segments)
    return min((lo for lo, _ in spans.values()), default=0)


def _is_observation(prev: PreviousTurn, msg: Optional[int], rules: Sequence) -> bool:
    """A user/tool message under a harness that elides observations (SWE-agent history processors)."""
    if msg is None or not rules_of(rules, ElideObservationsExceptLastN):
        return False
    conv = prev.conversation
    if conv is None or msg >= len(conv.messages):
        return True
    return conv.messages[msg].role in ("user", "tool")


def _has_compaction_marker(conv: Optional[Conversation], msg: Optional[int], rules: Sequence) -> bool:
    """A Compaction rule's history marker in the new conversation, at or after the edited message.

    Messages before the edited one are unchanged, so a summary further up is an old compaction.
    """
    markers = [m for r in rules_of(rules, Compaction) for m in r.history_markers]
    if conv is None or not markers:
        return False
    tail = conv.messages[msg or 0:]
    text = "\n".join(m.text for m in tail if m.role in ("user", "system"))
    return any(marker in text for marker in markers)
