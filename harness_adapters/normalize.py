"""Normaliser: pure functions that make a Conversation independent of what never belongs in the prompt.

Parsing into Conversation already drops cache_control markers, message/item/tool-call ids and request
metadata. What survives parsing and still changes tokens without changing meaning is handled here:
Claude Code's per-conversation billing line, text split into several parts, empty text parts, and JSON key
order in tool arguments and schemas. Whitespace inside text is left alone on purpose: it is the agent's
meaning (code, diffs). A harness adapter's own step runs first, on the parts as parsed (before text parts
are merged), then the base steps (`normalize(conv, adapter)`).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Callable, Iterable

from proxy.conversation import (Conversation, Message, Part, TextPart, ToolCallPart, ToolSpec,
                                canonical_json)

# Claude Code's first system block: `x-anthropic-billing-header: cc_version=2.1.3.a1f; cc_entrypoint=cli;`
# The hex suffix changes per conversation, so left in it would make every conversation's prefix unique.
BILLING_LINE = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(?:\n+|\Z)")

# Request fields that describe the request, not the prompt (dropped by strip_volatile).
VOLATILE_KEYS = frozenset({
    "cache_control", "id", "tool_use_id", "call_id", "item_id", "metadata", "client_metadata",
    "prompt_cache_key", "signature", "encrypted_content", "user", "stream", "stream_options", "store",
    "include", "service_tier", "context_management",
})


def is_billing_line(text: str) -> bool:
    return BILLING_LINE.match(text) is not None


def _drop_billing(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    first = parts[0] if parts else None
    if not isinstance(first, TextPart) or not is_billing_line(first.text):
        return parts
    rest = BILLING_LINE.sub("", first.text, count=1)
    return ((TextPart(rest),) if rest else ()) + parts[1:]


def strip_billing_line(conv: Conversation) -> Conversation:
    """Drop the billing line from the first system message (a whole part, or the first line of one)."""
    msgs = conv.messages
    if not msgs or msgs[0].role != "system":
        return conv
    parts = _drop_billing(msgs[0].parts)
    if parts == msgs[0].parts:
        return conv
    head = (Message("system", parts),) if parts else ()
    return replace(conv, messages=head + msgs[1:])


def merge_text_parts(conv: Conversation) -> Conversation:
    """Adjacent text parts become one, empty ones go: `"ab"` and `[{"text": "a"}, {"text": "b"}]` agree.

    Joined with "" as Message.text does; parts of other kinds stay where they are.
    """
    return replace(conv, messages=tuple(_merge_message(m) for m in conv.messages))


def _merge_message(msg: Message) -> Message:
    out: list[Part] = []
    for part in msg.parts:
        if isinstance(part, TextPart):
            if not part.text:
                continue
            if out and isinstance(out[-1], TextPart):
                out[-1] = TextPart(out[-1].text + part.text)
                continue
        out.append(part)
    return msg if tuple(out) == msg.parts else Message(msg.role, tuple(out))


def _canonical(text: str) -> str:
    """canonical_json of a JSON text; text that is not JSON is kept as the agent sent it."""
    try:
        return canonical_json(json.loads(text))
    except (ValueError, TypeError):
        return text


def canonicalize_json(conv: Conversation) -> Conversation:
    """Tool-call arguments and tool schemas in canonical JSON, whatever key order the agent used."""
    def fix(part: Part) -> Part:
        if isinstance(part, ToolCallPart):
            return replace(part, arguments=_canonical(part.arguments))
        return part

    msgs = tuple(Message(m.role, tuple(fix(p) for p in m.parts)) for m in conv.messages)
    tools = tuple(ToolSpec(t.name, t.description, _canonical(t.parameters_json)) for t in conv.tools)
    return replace(conv, messages=msgs, tools=tools)


def drop_empty_messages(conv: Conversation) -> Conversation:
    """A message left with no parts (e.g. only a billing line) renders as an empty turn: drop it."""
    return replace(conv, messages=tuple(m for m in conv.messages if m.parts))


BASE_STEPS: tuple[Callable[[Conversation], Conversation], ...] = (
    strip_billing_line, merge_text_parts, canonicalize_json, drop_empty_messages,
)


def normalize(conv: Conversation, adapter: Any = None,
              steps: Iterable[Callable[[Conversation], Conversation]] = BASE_STEPS) -> Conversation:
    """The harness adapter's own `normalize(conv)` (if an adapter is given), then the base steps.

    Idempotent: normalize(normalize(c)) == normalize(c). `extras` are carried over untouched.
    """
    if adapter is not None:
        conv = adapter.normalize(conv)
    for step in steps:
        conv = step(conv)
    return conv


def strip_volatile(value: Any) -> Any:
    """A copy of a raw request with VOLATILE_KEYS removed at every depth and dict keys sorted.

    For fingerprints and logs only: the prompt is always rendered from the parsed Conversation.
    """
    if isinstance(value, dict):
        return {k: strip_volatile(value[k]) for k in sorted(value) if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value
