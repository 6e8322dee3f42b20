"""A small stand-in for proxy/prompt/render.py for policy tests: one token per character, exact segments.

Same layout as the shipped ChatML template (system turn with tools, <think> in every assistant turn, tool
results sharing a user turn), so edit points fall where the real renderer puts them, and no tokenizer is
needed. `reply_ids` gives what the model would have generated for an assistant message, `engine_usage` what
the engine reports once it has.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.api import Usage
from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart


@dataclass(frozen=True)
class Seg:
    kind: str
    start: int
    end: int
    message_index: int | None


@dataclass(frozen=True)
class FakeRendered:
    ids: list[int]
    text: str
    segments: tuple[Seg, ...]


class _Builder:
    def __init__(self) -> None:
        self.text, self.segs = "", []

    def add(self, s: str, kind: str | None = None, index: int | None = None) -> None:
        if kind:
            self.segs.append(Seg(kind, len(self.text), len(self.text) + len(s), index))
        self.text += s


def _system_turn(b: _Builder, conv: Conversation) -> None:
    has_system = bool(conv.messages) and conv.messages[0].role == "system"
    if not (conv.tools or has_system):
        return
    index = 0 if has_system else None
    b.add("<|im_start|>system\n" + (conv.messages[0].text if has_system else ""))
    if conv.tools:
        lines = "".join("\n" + json.dumps({"name": t.name, "parameters": t.parameters}) for t in conv.tools)
        b.add("\n\n# Tools\n" if has_system else "# Tools\n")
        b.add("<tools>" + lines + "\n</tools>", "tools", index)
    b.add("<|im_end|>\n")
    b.segs.append(Seg("system", 0, len(b.text), index))
    if has_system:
        b.segs.append(Seg("message", 0, len(b.text), 0))


def _assistant(b: _Builder, m: Message, i: int) -> None:
    reasoning = "\n\n".join(p.text for p in m.parts if isinstance(p, ThinkingPart))
    b.add("<|im_start|>assistant\n")
    b.add("<think>\n" + reasoning + "\n</think>", "think", i)
    b.add("\n\n" + m.text)
    for k, call in enumerate(p for p in m.parts if isinstance(p, ToolCallPart)):
        b.add("\n" if (m.text or k) else "")
        b.add('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (call.name, call.arguments),
              "tool_call", i)
    b.add("<|im_end|>\n")


def render(conv: Conversation, add_generation_prompt: bool = True) -> FakeRendered:
    b = _Builder()
    _system_turn(b, conv)
    msgs = conv.messages
    for i, m in enumerate(msgs):
        if i == 0 and m.role == "system":
            continue
        start = len(b.text)
        if m.role == "assistant":
            _assistant(b, m, i)
        elif m.role == "tool" or any(isinstance(p, ToolResultPart) for p in m.parts):
            opens = i == 0 or msgs[i - 1].role != "tool"
            b.add("<|im_start|>user" if opens else "")
            for r in (p for p in m.parts if isinstance(p, ToolResultPart)):
                b.add("\n<tool_response>\n" + r.content + "\n</tool_response>", "tool_response", i)
            closes = i == len(msgs) - 1 or msgs[i + 1].role != "tool"
            b.add("<|im_end|>\n" if closes else "")
        else:
            b.add(f"<|im_start|>{m.role}\n{m.text}<|im_end|>\n")
        b.segs.append(Seg("message", start, len(b.text), i))
    if add_generation_prompt:
        b.add("<|im_start|>assistant\n<think>\n", "generation_prompt")
    return FakeRendered([ord(c) for c in b.text], b.text, tuple(sorted(b.segs, key=lambda s: (s.start, -s.end))))


def reply_ids(msg: Message) -> list[int]:
    """What the model generated for `msg`: its render after the generation prompt."""
    full = render(Conversation((Message("user", (TextPart("x"),)), msg)), add_generation_prompt=False).text
    head = render(Conversation((Message("user", (TextPart("x"),)),))).text
    assert full.startswith(head)
    return [ord(c) for c in full[len(head):]]


def user(text: str) -> Message:
    return Message("user", (TextPart(text),))


def system(text: str) -> Message:
    return Message("system", (TextPart(text),))


def assistant(text: str = "", thinking: str = "", calls: tuple = ()) -> Message:
    parts = ((ThinkingPart(thinking),) if thinking else ()) + ((TextPart(text),) if text else ())
    return Message("assistant", parts + tuple(ToolCallPart(n, a, c) for n, a, c in calls))


def tool(content: str, call_id: str = "") -> Message:
    return Message("tool", (ToolResultPart(content, call_id),))


def engine_usage(turn, generated_ids) -> Usage:
    """What an engine with room for everything reports after serving `turn`: prefill from where the plan
    resumes, and a checkpoint kept at every asked position, the prompt end and the generation end."""
    n, out = len(turn.prompt_ids), len(generated_ids)
    kept = tuple(sorted(set(turn.checkpoint_positions) | {n, n + out}))
    return Usage(prompt_tokens=n, output_tokens=out, reused_tokens=turn.resume_at,
                 prefilled_tokens=n - turn.resume_at, checkpoints_kept=kept)


def play(policy, adapter, conv: Conversation, reply: Message, request: dict | None = None,
         headers: dict | None = None):
    """One request through the cache policy with the fake renderer; returns (TurnPlan, TurnRecord)."""
    from harness_adapters.normalize import normalize

    conv = normalize(conv, adapter)
    rendered = render(conv)
    turn = policy.admit_turn(policy.plan_turn(request or {}, headers or {}, conv, rendered, adapter))
    generated = reply_ids(reply)
    return turn, policy.finish_turn(turn, generated, engine_usage(turn, generated))
