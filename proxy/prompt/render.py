"""Conversation -> prompt token ids, with the segment boundaries the cache manager plans around.

The chat template renders the whole conversation once; the ids are exactly `tokenizer.encode(text)` of the
whole text (never a concatenation of separately rendered pieces), except that special-token text written by
the conversation (not by the template) is encoded as plain text (proxy/prompt/literal.py). Segments are then
found on the text and mapped to token offsets through the tokenizer's offset mapping:
  system            the system turn, tools included          message_index 0, or None if template-made
  tools             the <tools>...</tools> block inside it   (only when the template writes one)
  message           one Conversation message, from its <|im_start|> to after its <|im_end|>\n; a tool result
                    sharing a user turn with its neighbours covers its own \n<tool_response>...</tool_response>
  think / tool_call / tool_response   <tag> ... </tag>, both tags included
  body              inside each message (after its "<|im_start|>role\n"; the system message: its own text
                    before the tools), each of those blocks and <tools>
                    (after the open tag's newline, up to the close tag)
  generation_prompt what add_generation_prompt appended       message_index None
  volatile          Conversation.volatile (the stable-first layout's moved system lines), written at the end
                    of the system turn after the tools               message_index 0
Message starts come from the turn structure (one <|im_start|> per turn, consecutive tool results in one turn);
when a template does not fit that shape, each message prefix is rendered and compared instead (quadratic,
but exact for any template).
"""
from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from typing import Literal

from engine.common_prefix import common_prefix_len
from proxy.conversation import Conversation, Message, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.prompt.chat_template import compile_template, render_template
from proxy.prompt.literal import ContentMarks
from proxy.prompt.tokenizer import Tokenizer

SegmentKind = Literal["system", "tools", "message", "think", "tool_call", "tool_response", "body",
                      "generation_prompt", "volatile"]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
INNER_BLOCKS = {"assistant": (("<think>", "</think>", "think"), ("<tool_call>", "</tool_call>", "tool_call")),
                "tool": (("<tool_response>", "</tool_response>", "tool_response"),)}


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    start: int  # token offset, inclusive
    end: int  # token offset, exclusive
    message_index: int | None  # index into Conversation.messages; None for parts the template adds


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    text: str
    segments: tuple[Segment, ...]
    token_starts: tuple[int, ...] = ()  # char offset in `text` where each token begins

    def boundary_at_or_before(self, char: int) -> int:
        """Tokens that end at or before text[char]: a checkpoint there is untouched by an edit at `char`."""
        return max(0, bisect.bisect_right(self.token_starts, char) - 1) if char < len(self.text) else len(self.ids)

    def of_kind(self, kind: SegmentKind) -> list[Segment]:
        return [s for s in self.segments if s.kind == kind]


class ChatRenderer:
    """Renders Conversations with the tokenizer's chat template (or `template`, a jinja source)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        source = tokenizer.chat_template if template is None else template
        self._origin = "the chat template given" if template is not None else str(tokenizer.template_path)
        self._template = compile_template(source, self._origin)
        self._source = source

    def render(self, conv: Conversation, add_generation_prompt: bool = True) -> Rendered:
        msgs, owners = template_messages(conv)
        tools = template_tools(conv)
        marks = ContentMarks(self.tokenizer.specials, (msgs, tools, conv.volatile), reserved=self._source)
        msgs, tools, volatile = marks.mark(msgs), marks.mark(tools), marks.mark(conv.volatile)
        if volatile and not (msgs and msgs[0]["role"] == "system"):
            raise ValueError("Conversation.volatile needs a first system message to belong to")
        body = self._render(msgs, tools, conv.enable_thinking, False, volatile)
        if volatile and _system_turn_end(body) is None:  # a template without a ChatML system turn
            msgs, volatile = _volatile_in_system_text(msgs, volatile), ""
            body = self._render(msgs, tools, conv.enable_thinking, False)
        if conv.continue_last:
            text = _open_last(body, msgs)
        elif add_generation_prompt:
            text = self._render(msgs, tools, conv.enable_thinking, True, volatile)
        else:
            text = body
        if not text.startswith(body) and not conv.continue_last:  # a template that changes earlier text
            body = body[:common_prefix_len(body, text)]
        starts = _structural_starts(body, msgs)
        if starts is None:
            starts = self._prefix_starts(body, msgs, tools, conv.enable_thinking, volatile)
        spans = _char_segments(body, msgs, owners, starts)
        if conv.continue_last:  # the last message's spans end where the model goes on writing
            spans = [(kind, a, min(b, len(text)), owner) for kind, a, b, owner in spans if a < len(text)]
        if volatile:
            end = _system_turn_end(body)
            spans.append(("volatile", end - len(volatile), end, owners[0]))
        if len(text) > len(body):
            spans.append(("generation_prompt", len(body), len(text), None))
        text, literal_at = marks.restore(text)
        ids, starts = self.tokenizer.encode_with_starts(text, literal_at)
        return Rendered(ids, text, _to_token_segments(spans, starts), tuple(starts))

    def _render(self, msgs: list[dict], tools: list[dict], thinking: bool, generation: bool,
                volatile: str = "") -> str:
        tok = self.tokenizer
        text = render_template(self._template, self._origin, messages=msgs, tools=tools or None,
                               add_generation_prompt=generation, enable_thinking=thinking,
                               bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
        return _with_volatile(text, volatile) if volatile else text

    def _prefix_starts(self, body: str, msgs: list[dict], tools: list[dict], thinking: bool,
                       volatile: str = "") -> list[int]:
        """Start of message i = where rendering messages[:i] stops agreeing with the full render."""
        starts, prev = [], 0
        for i in range(len(msgs)):
            if i == 0 and msgs[0]["role"] == "system":
                starts.append(0)
                continue
            try:
                prefix = self._render(msgs[:i], tools, thinking, False, volatile)
            except (ValueError, LookupError, AttributeError, TypeError):  # e.g. templates reading messages[0]
                prefix = ""
            prev = max(prev, common_prefix_len(prefix, body))
            starts.append(prev)
        return starts


def _open_last(body: str, msgs: list[dict]) -> str:
    """The rendered conversation with its last turn, the assistant's, left open: up to the turn's <|im_end|>."""
    end = body.rfind(IM_END)
    if not msgs or msgs[-1]["role"] != "assistant" or end < 0 or body.rfind(IM_START) > end:
        raise ValueError("only an assistant message at the end can be continued")
    return body[:end]


def _system_turn_end(text: str) -> int | None:
    """Where the system turn's text ends (at its <|im_end|>), or None when the text opens with no system turn."""
    if not text.startswith(IM_START + "system"):
        return None
    end = text.find(IM_END)
    return end if end >= 0 else None


def _with_volatile(text: str, volatile: str) -> str:
    """The volatile system lines at the end of the system turn: after the tool definitions, on their own lines."""
    end = _system_turn_end(text)
    if end is None:
        return text
    head = text[:end]
    newlines = len(head) - len(head.rstrip("\n"))
    return head + "\n" * max(0, 2 - newlines) + volatile + text[end:]


def _volatile_in_system_text(msgs: list[dict], volatile: str) -> list[dict]:
    """The fallback: the volatile lines end the system message's own text (before the template's tools)."""
    content = msgs[0]["content"] or ""
    return [{**msgs[0], "content": content + ("\n\n" if content else "") + volatile}] + msgs[1:]


def template_messages(conv: Conversation) -> tuple[list[dict], list[int]]:
    """The message dicts HF-style templates read, and for each the index of the Conversation message it
    came from (a message holding several tool results becomes one tool message per result)."""
    out, owners = [], []
    for i, message in enumerate(conv.messages):
        for d in _message_dicts(message):
            out.append(d)
            owners.append(i)
    return out, owners


def template_tools(conv: Conversation) -> list[dict]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in conv.tools]


def _message_dicts(m: Message) -> list[dict]:
    results = [p for p in m.parts if isinstance(p, ToolResultPart)]
    if m.role == "tool":
        return [{"role": "tool", "content": r.content} for r in results] or [{"role": "tool", "content": m.text}]
    if m.role == "user" and results:  # an API that puts tool results inside a user message
        tail = [{"role": "user", "content": m.text}] if m.text else []
        return [{"role": "tool", "content": r.content} for r in results] + tail
    if m.role != "assistant":
        return [{"role": m.role, "content": m.text}]
    d = {"role": "assistant", "content": m.text,
         "reasoning_content": "\n\n".join(p.text for p in m.parts if isinstance(p, ThinkingPart))}
    calls = [{"type": "function", "function": {"name": p.name, "arguments": _arguments(p.arguments)}}
             for p in m.parts if isinstance(p, ToolCallPart)]
    if calls:
        d["tool_calls"] = calls
    return [d]


def _arguments(text: str):
    """Parsed JSON (templates iterate over or tojson it); text that is not JSON stays text."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _structural_starts(body: str, msgs: list[dict]) -> list[int] | None:
    """Message starts read off the turn structure, or None when the text does not have the expected shape."""
    groups = _turn_groups(msgs)
    turns = [t.start() for t in re.finditer(re.escape(IM_START), body)]
    template_system = msgs and msgs[0]["role"] != "system" and body.startswith(IM_START + "system")
    if template_system and len(turns) == len(groups) + 1:
        turns = turns[1:]  # a system turn the template adds (tools, default prompt)
    if len(turns) != len(groups):
        return None
    starts = []
    for group, start, end in zip(groups, turns, turns[1:] + [len(body)]):
        role = msgs[group[0]]["role"]
        labels = ("user", "tool") if role == "tool" else (role,)
        if not any(body.startswith(IM_START + label, start) for label in labels):
            return None
        starts.append(start)
        if len(group) > 1:  # later tool results start at their own <tool_response> (and the \n before it)
            opens = [start + t.start() for t in re.finditer("<tool_response>", body[start:end])]
            if len(opens) != len(group):
                return None
            starts += [p - 1 if body[p - 1] == "\n" else p for p in opens[1:]]
    return starts


def _turn_groups(msgs: list[dict]) -> list[list[int]]:
    """Message indices per expected turn: consecutive tool results share one."""
    groups: list[list[int]] = []
    for j, m in enumerate(msgs):
        if m["role"] == "tool" and groups and msgs[groups[-1][0]]["role"] == "tool":
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def _char_segments(body: str, msgs: list[dict], owners: list[int], starts: list[int]) -> list[tuple]:
    """(kind, char start, char end, message index) for everything but the generation prompt."""
    spans = _system_spans(body, msgs, owners)
    system_owner = spans[0][3] if spans else None  # its body is the system text alone (see _system_spans)
    ends = starts[1:] + [len(body)]
    for j, (s, e) in enumerate(zip(starts, ends)):
        for open_tag, close_tag, kind in INNER_BLOCKS.get(msgs[j]["role"], ()):
            for a, b in _tag_spans(body, open_tag, close_tag, s, e):
                spans += [(kind, a, b, owners[j]), _body(body, a, b, open_tag, close_tag, owners[j])]
    mine_of: dict[int, list[int]] = {}  # conversation message -> its template messages
    for j, o in enumerate(owners):
        mine_of.setdefault(o, []).append(j)
    for i, mine in sorted(mine_of.items()):
        start, end = starts[mine[0]], ends[mine[-1]]
        header = body.find("\n", start, end) + 1 if body.startswith(IM_START, start) else start
        spans.append(("message", start, end, i))
        if i != system_owner:
            spans.append(("body", header or start, end, i))
    return spans


def _system_spans(body: str, msgs: list[dict], owners: list[int]) -> list[tuple]:
    if not body.startswith(IM_START + "system"):
        return []
    end = body.find(IM_END)
    if end < 0:
        return []
    end += len(IM_END) + (body[end + len(IM_END):end + len(IM_END) + 1] == "\n")
    index = owners[0] if msgs and msgs[0]["role"] == "system" else None
    spans = [("system", 0, end, index)]
    text_start = body.find("\n") + 1
    if index is not None and body.startswith(msgs[0]["content"] or "", text_start):
        spans.append(("body", text_start, text_start + len(msgs[0]["content"] or ""), index))
    blocks = _tag_spans(body, "<tools>", "</tools>", 0, end)
    if blocks:  # the longest: templates also mention an empty "<tools></tools>" in their instructions
        a, b = max(blocks, key=lambda ab: ab[1] - ab[0])
        spans += [("tools", a, b, index), _body(body, a, b, "<tools>", "</tools>", index)]
    return spans


def _body(text: str, a: int, b: int, open_tag: str, close_tag: str, index: int | None) -> tuple:
    """The inside of <tag>...</tag> at text[a:b]: after the open tag and its newline, up to the close tag.
    Where a harness rewrites a block (a cleared tool output, an added tool), the edit starts here."""
    start = a + len(open_tag)
    start += text.startswith("\n", start)
    return ("body", start, max(start, b - len(close_tag)), index)


def _tag_spans(text: str, open_tag: str, close_tag: str, start: int, end: int) -> list[tuple[int, int]]:
    """Character spans of open_tag ... close_tag (both included) inside text[start:end]."""
    spans = []
    a = text.find(open_tag, start, end)
    while a >= 0:
        b = text.find(close_tag, a + len(open_tag), end)
        if b < 0:
            break
        spans.append((a, b + len(close_tag)))
        a = text.find(open_tag, b + len(close_tag), end)
    return spans


def _to_token_segments(spans: list[tuple], token_starts: list[int]) -> tuple[Segment, ...]:
    """Character spans -> token spans: a boundary at char c falls before the first token starting at >= c."""
    segments = [Segment(kind, bisect.bisect_left(token_starts, a), bisect.bisect_left(token_starts, b), i)
                for kind, a, b, i in spans]
    return tuple(sorted((s for s in segments if s.end > s.start), key=lambda s: (s.start, -s.end)))
