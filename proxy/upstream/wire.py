"""What goes to an OpenAI-compatible upstream and what comes back. Torch-free and aiohttp-free.

    body = chat_body(conv, params, max_tokens, model)       # the normalised Conversation as /v1/chat/completions
    reader = ChunkReader(params, continues=conv.continue_last)
    items = reader.feed(chunk)     # one decoded `data:` JSON object -> OutputEvents (thinking, text, tool calls)
    items = reader.close()         # the stream ended: a tool call still being assembled, held-back text
    reader.finish, reader.usage    # the upstream's finish_reason and usage (cached tokens included)

The body is built from the Conversation the normaliser produced, not from the agent's request: ids, cache
markers, billing lines and key order are already gone, so the upstream sees the same prefix every turn and
its prompt cache can hold. Messages follow the shape the chat template reads (proxy/prompt/render.py): tool
results become `tool` messages, thinking goes back as `reasoning_content`.

Content passes through the same OutputParser as the engine's text (stop sequences, a `<tool_call>` the upstream
left unparsed, whitespace at segment edges); `reasoning_content` (or `reasoning`) and structured `tool_calls`
come already parsed. A replica without a reasoning parser sends the thinking as content; where the prompt opens
the thinking (`<think>` ends the generation prompt) that content runs up to a bare `</think>`. The reader is told
what the replica was seen to do (`reasoning`, as routing.Replica keeps it); not yet seen, it holds the answer's
content back until one of them shows: a `</think>` in it (the thinking came as content: it goes out as thinking,
the rest as the answer), the upstream's reasoning field, or the stream's end (no thinking at all).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Optional

from proxy.conversation import Conversation, Message, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.generation import GenParams
from proxy.prompt.output_parser import (THINK_CLOSE, OutputEvent, OutputParser, ThinkingDelta, ToolCall,
                                        ToolCallDelta, ToolCallStart)

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls",
          "content_filter": "stop"}


def chat_body(conv: Conversation, params: GenParams, max_tokens: int, model: str) -> dict:
    """A streaming chat completions request with usage in the last chunk."""
    body: dict = {"model": model, "messages": [m for msg in conv.messages for m in _messages(msg)],
                  "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
    s = params.sampling
    body["temperature"] = s.temperature
    if s.top_p < 1.0:
        body["top_p"] = s.top_p
    if s.top_k > 0:
        body["top_k"] = s.top_k  # not OpenAI's, but vLLM, SGLang, llama.cpp and killick read it
    if s.seed is not None:
        body["seed"] = s.seed
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if conv.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in conv.tools]
        if not params.parse_tools:
            body["tool_choice"] = "none"
        if params.max_tool_calls == 1:
            body["parallel_tool_calls"] = False
    if not conv.enable_thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if conv.continue_last:  # a prefill, continued (vLLM's fields; SGLang, llama.cpp and killick read them too)
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    return body


def _messages(m: Message) -> list[dict]:
    """One Conversation message as chat messages: a message holding tool results becomes one `tool` message
    per result (then its text as a user message), as the chat template reads it."""
    results = [p for p in m.parts if isinstance(p, ToolResultPart)]
    if m.role == "tool" or results:
        out = [{"role": "tool", "tool_call_id": r.call_id, "content": r.content} for r in results]
        if m.role == "user" and m.text:
            out.append({"role": "user", "content": m.text})
        return out or [{"role": "tool", "tool_call_id": "", "content": m.text}]
    if m.role != "assistant":
        return [{"role": m.role, "content": m.text}]
    out = {"role": "assistant", "content": m.text}
    thinking = "\n\n".join(p.text for p in m.parts if isinstance(p, ThinkingPart))
    if thinking:
        out["reasoning_content"] = thinking
    calls = [p for p in m.parts if isinstance(p, ToolCallPart)]
    if calls:
        out["tool_calls"] = [{"id": c.call_id or f"call_{i}", "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
    return [out]


@dataclass(frozen=True)
class UpstreamUsage:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: Optional[int] = None


def parse_usage(usage: dict) -> Optional[UpstreamUsage]:
    """OpenAI's usage object; cached tokens from prompt_tokens_details (vLLM, SGLang, llama.cpp, killick)."""
    if not isinstance(usage, dict) or "prompt_tokens" not in usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or {}
    return UpstreamUsage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                         int(details.get("cached_tokens") or 0), out_details.get("reasoning_tokens"))


class ChunkReader:
    """chat.completion.chunk objects -> OutputEvents. Tool calls arrive in pieces (id and name first, then
    argument fragments, each under its index); one goes out whole when the next begins or the stream ends."""

    def __init__(self, params: GenParams, continues: bool = False, opens_think: bool = False,
                 reasoning: str = "parsed"):
        """continues: the answer goes on from the conversation's last message (Conversation.continue_last).
        opens_think: the rendered prompt leaves the answer inside <think> (thinking on, the template opened it);
        reasoning: where this replica sends such thinking (routing.Replica.reasoning): "parsed" (its reasoning
        field), "content" (no reasoning parser), "unknown" (the answer's content is held back until it shows)."""
        self._params, self._continues = params, continues
        self._undecided = opens_think and reasoning == "unknown"
        self._opened = opens_think and reasoning == "content"  # the parser starts in the thinking, until content
        self._held = ""  # content held back while undecided
        self.shown: Optional[str] = None  # "content" / "parsed" where this answer showed it (for the replica)
        self.parser = self._parser(self._opened)
        self.max_tool_calls = params.max_tool_calls
        self.calls = 0  # tool calls emitted (structured and parsed from text)
        self.reasoning_chunks = 0
        self.finish: Optional[str] = None
        self.usage: Optional[UpstreamUsage] = None
        self.error: Optional[str] = None  # an error object the upstream sent inside the stream
        self._call: Optional[dict] = None  # the structured tool call being assembled

    @property
    def ended(self) -> bool:
        """A stop sequence matched or the allowed tool calls are out: the rest of the output is not needed."""
        return self.parser.ended or (self.max_tool_calls is not None and self.calls >= self.max_tool_calls)

    def feed(self, chunk: dict) -> list[OutputEvent]:
        if isinstance(chunk.get("error"), (dict, str)):
            err = chunk["error"]
            self.error = err.get("message", json.dumps(err)) if isinstance(err, dict) else err
            return []
        self.usage = parse_usage(chunk.get("usage")) or self.usage
        out: list[OutputEvent] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if thinking and not self.ended:
                out += self._decided("parsed")
                if self._opened:  # a replica known to send its thinking as content has a reasoning parser now
                    self.parser, self._opened, self.shown = self._parser(False), False, "parsed"
                self.reasoning_chunks += 1
                out.append(ThinkingDelta(thinking))
            if delta.get("content"):
                out += self._content(delta["content"])
            for piece in delta.get("tool_calls") or ():
                out += self._decided(None)  # a call follows the answer's text: what was held is that text
                out += self._tool_piece(piece)
            if choice.get("finish_reason"):
                self.finish = FINISH.get(choice["finish_reason"], "stop")
        return out

    def close(self) -> list[OutputEvent]:
        out = self._decided(None)  # no </think> and no reasoning field: what was held is the answer
        out += self._flush_call()
        return out + self._count(self.parser.finish())

    def _parser(self, thinking_open: bool) -> OutputParser:
        p = self._params
        return OutputParser(thinking_open=thinking_open, parse_tools=p.parse_tools, stop_sequences=p.stop_sequences,
                            max_tool_calls=p.max_tool_calls, continues=self._continues)

    def _content(self, text: str) -> list[OutputEvent]:
        self._opened = False
        if not self._undecided:
            return self._text(text)
        self._held += text
        return self._decided("content") if THINK_CLOSE in self._held else []

    def _decided(self, shown: Optional[str]) -> list[OutputEvent]:
        """An undecided answer showed where its thinking comes ("content", "parsed": the reasoning field, None:
        nowhere, it ended or a call followed its text): the content held back goes through the parser, in the
        thinking if "content"."""
        if not self._undecided:
            return []
        self._undecided, self.shown = False, shown
        if shown == "content":
            self.parser = self._parser(True)
        held, self._held = self._held, ""
        return self._text(held) if held else []

    def _text(self, text: str) -> list[OutputEvent]:
        return self._count(self.parser.feed(text)) if not self.ended else []

    def _count(self, items: list[OutputEvent]) -> list[OutputEvent]:
        out = []
        for item in items:  # the parser numbers calls per text stream; a response numbers them all
            if isinstance(item, (ToolCallStart, ToolCallDelta)):
                item = replace(item, index=self.calls)
            elif isinstance(item, ToolCall):
                item = replace(item, index=self.calls)
                self.calls += 1
            out.append(item)
        return out

    def _tool_piece(self, piece: dict) -> list[OutputEvent]:
        fn = piece.get("function") or {}
        out = []
        if self._call is None or (piece.get("index") is not None and piece.get("index") != self._call["index"]):
            out = self._flush_call()
            self._call = {"index": piece.get("index"), "name": "", "arguments": ""}
        self._call["name"] += fn.get("name") or ""
        self._call["arguments"] += fn.get("arguments") or ""
        return out

    def _flush_call(self) -> list[OutputEvent]:
        call, self._call = self._call, None
        if call is None or self.ended:
            return []
        args = call["arguments"].strip() or "{}"
        try:
            parsed = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        if not call["name"] or not isinstance(parsed, dict):  # malformed: show it as text, as the parser does
            return self._text(f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': args})}\n</tool_call>")
        out = [ToolCall(self.calls, call["name"], json.dumps(parsed, ensure_ascii=False))]
        self.calls += 1
        return out
