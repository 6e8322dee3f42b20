"""The stable-first layout: the system text a harness declares volatile goes after the tool definitions.

A harness writes its system prompt as static instructions with a few lines that differ between its
conversations (working directory, date, git status, model line); the chat template then renders that text
before the tool definitions, so two conversations of one harness part ways after a few hundred tokens and
the ~10-20k tokens of tools after it are never shared. `stable_first` takes the lines its `volatile_text`
rules match (VolatileText.moves) out of the first system message into `Conversation.volatile`, which the
renderer writes at the end of the system turn: static instructions, tools, then the volatile lines, then
the messages. Nothing is added or dropped; only the order inside the system turn changes.

Before that, `name_served_model` applies the harness's `model_name` rules: the lines that name the model the
harness was pointed at (an alias the user picks, and may change between two runs of one conversation) name
the model killick serves instead.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Optional

from harness_adapters.rules import ModelName, VolatileText, rules_of
from proxy.conversation import Conversation, Message, TextPart

LAYOUTS = ("stable", "template")  # template: the chat template's own order, volatile lines where written


def stable_first(conv: Conversation, rules: Iterable) -> Conversation:
    """conv with the volatile lines of its first system message moved to `volatile` (appended to any there)."""
    rules = [r for r in rules_of(rules, VolatileText) if r.moves != "none"]
    first = conv.messages[0] if conv.messages else None
    if not rules or first is None or first.role != "system":
        return conv
    text = first.text
    spans = _merge(span for rule in rules for span in volatile_spans(text, rule))
    if not spans:
        return conv
    moved = "".join(text[a:b] for a, b in spans).strip("\n")
    kept = _join([text[a:b] for a, b in _gaps(spans, len(text))])
    if spans[-1][1] == len(text):  # what preceded a block taken from the end keeps no trailing blank lines
        kept = kept.rstrip("\n")
    parts = (TextPart(kept),) + tuple(p for p in first.parts if not isinstance(p, TextPart))
    volatile = conv.volatile + ("\n" if conv.volatile else "") + moved
    return replace(conv, messages=(Message("system", parts),) + conv.messages[1:], volatile=volatile)


def name_served_model(conv: Conversation, rules: Iterable, model: Optional[str]) -> Conversation:
    """conv with its ModelName rules applied to the first system message and the tool descriptions; `model`
    is the served model's name (None: not known, so rules whose replacement names it do nothing)."""
    rules = rules_of(rules, ModelName)
    if not rules:
        return conv

    def rewrite(text: str) -> str:
        for rule in rules:
            text = rule.rewrite(text, model)
        return text

    msgs = conv.messages
    if msgs and msgs[0].role == "system":
        parts = tuple(TextPart(rewrite(p.text)) if isinstance(p, TextPart) else p for p in msgs[0].parts)
        msgs = (msgs[0] if parts == msgs[0].parts else Message("system", parts),) + msgs[1:]
    tools = tuple(replace(t, description=rewrite(t.description)) for t in conv.tools)
    if msgs == conv.messages and tools == conv.tools:
        return conv
    return replace(conv, messages=msgs, tools=tools)


def volatile_spans(text: str, rule: VolatileText) -> list[tuple[int, int]]:
    """Character spans of `text` the rule moves: whole lines (their newline included), or to the end."""
    out = []
    for match in re.finditer(rule.pattern, text):
        first = match.start()
        while first < match.end() - 1 and text[first] == "\n":  # a pattern that opens with the line break
            first += 1
        start = text.rfind("\n", 0, first) + 1
        if rule.moves == "to_end":
            out.append((start, len(text)))
            continue
        newline = text.find("\n", max(first, match.end() - 1))
        out.append((start, len(text) if newline < 0 else newline + 1))
    return out


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _join(pieces: list[str]) -> str:
    """The text left around the moved blocks: where a block left two blank lines side by side, one goes."""
    out = ""
    for piece in pieces:
        out += piece.lstrip("\n") if out.endswith("\n\n") else piece
    return out


def _gaps(spans: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    edges = [0] + [x for span in spans for x in span] + [n]
    return [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i] < edges[i + 1]]
