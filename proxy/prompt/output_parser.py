"""Streaming parser from the model's decoded text to API-neutral output events.

The Qwen chat format: reasoning inside `<think>...</think>` (the generation prompt may already have
opened it), then the answer, then zero or more tool calls, each
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (the XML variant
`<tool_call>\n<function=NAME>\n<parameter=P>\nV\n</parameter>\n</function>\n</tool_call>` is accepted too).

Text arrives in arbitrary pieces, so a suffix that could still become a tag or a stop sequence is held back until
the next piece decides it. Stop sequences are searched for in the answer's text alone, as Anthropic's API does:
the thinking never ends the output, and the search starts afresh after `</think>`.

A JSON tool call streams: once its head `{"name": "N", "arguments": {` is read, ToolCallStart(index, name) goes out,
then ToolCallDelta pieces of the arguments object as they are written, then ToolCall(streamed=True) whose arguments
are exactly the deltas joined. Any other tool call is buffered until its closing tag and parsed whole (ToolCall,
streamed=False): malformed JSON degrades to plain text, never an error, and a call whose first characters can open
neither form goes out as text at once (up to its closing tag, as it would have at the end); once a call has started
streaming it ends as a call, its arguments as written. Blank lines at the start of each segment (after `<think>`,
after `</think>`, between tool calls), a single space before its first word, and whitespace at its end are dropped,
as the providers do; the first line's indentation is the answer's own (code), and stays.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Union

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
XML_CALL_OPEN = "<function="


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int  # 0-based among this response's tool calls
    name: str
    arguments: str  # JSON object text (for a streamed call: as the model wrote it, the deltas joined)
    streamed: bool = False  # ToolCallStart and ToolCallDelta events came before this one


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    text: str  # the next piece of the arguments object's text


OutputEvent = Union[TextDelta, ThinkingDelta, ToolCall, ToolCallStart, ToolCallDelta]

# the head of a JSON tool call up to its arguments object: from here the arguments can stream
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


class ArgumentsScan:
    """How far the arguments object of a streaming call has been sent, and whether it has closed: a brace
    count that skips strings (it finds the object's end; it does not validate JSON)."""

    def __init__(self, name: str, start: int):
        self.name, self.start, self.sent = name, start, 0  # start: offset of "{" in the call's text
        self.depth, self.in_string, self.escaped, self.closed = 0, False, False, False

    def advance(self, text: str) -> str:
        """The new part of the arguments in `text` (the call's text so far), up to the object's end."""
        begin = end = self.start + self.sent
        for ch in text[begin:]:
            if self.closed:
                break
            end += 1
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = ch == "\\"
                self.in_string = ch != '"'
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
        self.sent = end - self.start
        return text[begin:end]


def generation_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open <think> block (thinking-enabled generation prompt)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class OutputParser:
    def __init__(self, *, thinking_open: bool, parse_tools: bool = True, stop_sequences: tuple[str, ...] = (),
                 max_tool_calls: int | None = None, continues: bool = False):
        """continues: the output goes on from text in the prompt (a prefill), so its first whitespace is the
        text's own, not a segment's opening to drop."""
        self.mode = "think" if thinking_open else "text"  # "think" | "text" | "tool"
        self.parse_tools = parse_tools
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self.stopped: str | None = None  # the stop sequence that ended generation
        self.max_tool_calls = max_tool_calls  # 1 when the agent disabled parallel tool calls
        self.tool_calls = 0
        self._buf = ""  # undecided text (may be the start of a marker)
        self._tool_buf = ""
        self._call: ArgumentsScan | None = None  # the tool call whose arguments are streaming
        self._not_a_call = False  # inside <tool_call> ... </tool_call> whose text can be no call: shown as text
        self._pending_ws = ""  # trailing whitespace held until more visible text follows
        self._segment_started = continues
        self._before_tool = ("", False)

    @property
    def ended(self) -> bool:
        """A stop sequence matched or the allowed tool calls are made: the rest of the output is dropped."""
        return self.stopped is not None or self.tool_calls == self.max_tool_calls

    def feed(self, text: str) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        if not self.ended:
            self._buf += text
            while not self.ended and self._step(out):
                pass
        return out

    def finish(self) -> list[OutputEvent]:
        """Flush everything held back; an unterminated tool call becomes text."""
        out: list[OutputEvent] = []
        if not self.ended:
            rest, self._buf = self._buf, ""
            if self.mode == "tool" and self._call is not None:  # started: it ends as a call
                self._emit(out, rest)
                self.mode = "text"
                self._close_tool(out)
                rest = ""
            elif self.mode == "tool" and not self._not_a_call:
                self._pending_ws, self._segment_started = self._before_tool
                rest = TOOL_OPEN + self._tool_buf + rest
            self.mode, self._not_a_call = "text", False
            self._emit(out, rest)
        self._pending_ws = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        if self.mode == "tool":
            return (TOOL_CLOSE,)
        if self.mode == "think":  # stop sequences end the answer; the thinking is not searched for them
            return (THINK_CLOSE,)
        return (THINK_OPEN, *((TOOL_OPEN,) if self.parse_tools else ()), *self.stop_sequences)

    def _step(self, out: list[OutputEvent]) -> bool:
        """Consume up to the next marker; False when the buffer needs more text to decide."""
        markers = self._markers()
        hits = [(self._buf.find(m), -len(m), m) for m in markers if m in self._buf]
        if not hits:
            keep = _partial_marker_suffix(self._buf, markers)
            cut = len(self._buf) - keep
            self._emit(out, self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        idx, _, marker = min(hits)
        self._emit(out, self._buf[:idx])
        self._buf = self._buf[idx + len(marker):]
        self._transition(out, marker)
        return True

    def _transition(self, out: list[OutputEvent], marker: str) -> None:
        if self._not_a_call:  # the close tag of text shown as text: it stays text, whitespace rules go on
            self._emit(out, marker)
            self.mode, self._not_a_call = "text", False
            return
        if marker == TOOL_OPEN:  # text state before a tool call, restored if the call is malformed
            self._before_tool = (self._pending_ws, self._segment_started)
        self._pending_ws = ""
        self._segment_started = False
        if self.mode == "text" and marker in self.stop_sequences:  # the agent's stop wins over structure
            self.stopped = marker
            return
        if marker == THINK_CLOSE:
            self.mode = "text"
        elif marker == THINK_OPEN:
            self.mode = "think"
        elif marker == TOOL_OPEN:
            self.mode, self._tool_buf = "tool", ""
        elif marker == TOOL_CLOSE:
            self.mode = "text"
            self._close_tool(out)

    def _close_tool(self, out: list[OutputEvent]) -> None:
        call, self._call = self._call, None
        if call is not None:
            arguments = self._tool_buf[call.start:call.start + call.sent]
            out.append(ToolCall(self.tool_calls, call.name, arguments, streamed=True))
            self.tool_calls += 1
            return
        parsed = parse_tool_call(self._tool_buf)
        if parsed is None:  # malformed: show the model's text as it was
            self._pending_ws, self._segment_started = self._before_tool
            self._emit(out, TOOL_OPEN + self._tool_buf + TOOL_CLOSE)
            return
        out.append(ToolCall(self.tool_calls, *parsed))
        self.tool_calls += 1

    def _emit(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        if self.mode == "tool" and not self._not_a_call:
            self._tool_buf += text
            if self._call is None and not may_open_call(self._tool_buf):
                self._not_a_call = True
                self._pending_ws, self._segment_started = self._before_tool
                self._emit(out, TOOL_OPEN + self._tool_buf)
                self._tool_buf = ""
                return
            self._stream_arguments(out)
            return
        if not self._segment_started:  # undecided until visible text: indentation, or blank lines that go
            text, self._pending_ws = self._pending_ws + text, ""
            if not text.strip():
                self._pending_ws = text
                return
            lead = len(text) - len(text.lstrip())
            text = text[text.rfind("\n", 0, lead) + 1:]
            if text[:1] == " " and not text[1:2].isspace():  # one space is a token's, not an indent
                text = text[1:]
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        piece = self._pending_ws + body
        self._pending_ws = text[len(body):]
        self._segment_started = True
        out.append(ThinkingDelta(piece) if self.mode == "think" else TextDelta(piece))


    def _stream_arguments(self, out: list[OutputEvent]) -> None:
        if self._call is None:
            head = _CALL_HEAD.match(self._tool_buf)
            if head is None:
                return
            try:
                name = json.loads(head.group(1))
            except (json.JSONDecodeError, RecursionError):
                return
            if not name:
                return
            self._call = ArgumentsScan(name, head.end())
            out.append(ToolCallStart(self.tool_calls, name))
        piece = self._call.advance(self._tool_buf)
        if piece:
            out.append(ToolCallDelta(self.tool_calls, piece))


def may_open_call(body: str) -> bool:
    """Whether a tool call's text so far can still parse as a call (parse_tool_call): its first non-space
    characters open a JSON object or the XML variant's <function=."""
    head = body.lstrip()
    return not head or head.startswith(("{", XML_CALL_OPEN)) or XML_CALL_OPEN.startswith(head)


def _partial_marker_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_tool_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON object text) from a tool call's body, or None when it is malformed."""
    text = body.strip()
    if text.startswith(XML_CALL_OPEN):
        return _parse_xml_call(text)
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _parse_xml_call(text: str) -> tuple[str, str] | None:
    match = _XML_FUNCTION.fullmatch(text)
    if match is None:
        return None
    args = {}
    for key, raw in _XML_PARAM.findall(match.group(2)):
        try:
            args[key.strip()] = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            args[key.strip()] = raw
    return match.group(1).strip(), json.dumps(args, ensure_ascii=False)
