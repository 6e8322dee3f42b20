"""Responses output items, built from output events one at a time.

The same builder serves both modes: streaming sends the (event type, payload) pairs it returns, the
non-streaming answer ignores them and takes the finished items. Each item goes added -> deltas -> done:
reasoning (reasoning_text), message (output_text), function_call (arguments, in pieces as the model writes
them), custom_tool_call (input, whole: it is a string inside the model's JSON). A call to a namespaced tool goes
out under the tool's own name with its `namespace` (tools.py); the conversation parts keep the name the model wrote.
"""
from __future__ import annotations

import json
import uuid

from proxy.apis.responses.schema import encrypt_reasoning
from proxy.apis.responses.tools import OfferedTool
from proxy.apis.chat.schema import written_arguments
from proxy.conversation import Message, Part, TextPart, ThinkingPart, ToolCallPart, canonical_json
from proxy.prompt.output_parser import ThinkingDelta, ToolCall, ToolCallDelta, ToolCallStart

Emitted = list[tuple[str, dict]]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputItems:
    def __init__(self, tools: dict[str, OfferedTool], include_encrypted: bool):
        self.tools = tools  # by the name the model calls them
        self.include_encrypted = include_encrypted
        self.items: list[dict] = []  # finished output items
        # the same output as conversation parts (for previous_response_id), sharing the items' strings
        self.parts: list[Part] = []
        self._open: dict | None = None  # the item being streamed
        self._text = ""
        self._call: dict | None = None  # the function_call whose arguments are streaming

    def feed(self, ev) -> Emitted:
        if isinstance(ev, ToolCallStart):
            return [] if self._custom(ev.name) else self.close() + self._start_call(ev.name)
        if isinstance(ev, ToolCallDelta):
            if self._call is None:  # a custom tool's input goes out whole, at its end
                return []
            return [("response.function_call_arguments.delta", {**self._call_where(), "delta": ev.text})]
        if isinstance(ev, ToolCall):
            if self._call is not None:
                return self._end_call(ev)
            return self.close() + self._tool_call(ev)
        kind = "reasoning" if isinstance(ev, ThinkingDelta) else "message"
        out = [] if self._open is not None and self._open["type"] == kind else self.close() + self._start(kind)
        self._text += ev.text
        where = self._where()
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [(name, {**where, "content_index": 0, "delta": ev.text, **extra})]

    def close(self) -> Emitted:
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = {**item, "content": [part]}
            if self.include_encrypted:
                done["encrypted_content"] = encrypt_reasoning(text)
            self.parts.append(ThinkingPart(text))
            text_done = ("response.reasoning_text.done", {**where, "content_index": 0, "text": text})
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = {**item, "status": "completed", "content": [part]}
            self.parts.append(TextPart(text))
            text_done = ("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []})
        return self._finish(done, [text_done, ("response.content_part.done", {**where, "content_index": 0,
                                                                                "part": part})])

    def message(self) -> Message:
        return Message("assistant", tuple(self.parts))

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _start(self, kind: str) -> Emitted:
        if kind == "reasoning":
            self._open = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self._open = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = self._where()
        return [("response.output_item.added", {"output_index": where["output_index"], "item": self._open}),
                ("response.content_part.added", {**where, "content_index": 0, "part": part})]

    def _custom(self, name: str) -> bool:
        tool = self.tools.get(name)
        return tool is not None and tool.custom

    def _named(self, name: str) -> dict:
        """The call item's name fields: a namespaced tool's own name and its namespace; any other name as written."""
        tool = self.tools.get(name)
        if tool is None or tool.namespace is None:
            return {"name": name}
        return {"name": tool.name, "namespace": tool.namespace}

    def _tool_call(self, call: ToolCall) -> Emitted:
        if not self._custom(call.name):
            return self._start_call(call.name) + \
                [("response.function_call_arguments.delta", {**self._call_where(), "delta": call.arguments})] + \
                self._end_call(call)
        call_id = _id("call")
        try:
            args = json.loads(call.arguments)
        except (json.JSONDecodeError, RecursionError):  # a streamed call may end malformed
            args = {}
        text = args["input"] if isinstance(args, dict) and isinstance(args.get("input"), str) else call.arguments
        item = {"id": _id("ctc"), "type": "custom_tool_call", "call_id": call_id, **self._named(call.name)}
        where = {"item_id": item["id"], "output_index": len(self.items)}
        self.parts.append(ToolCallPart(call.name, canonical_json({"input": text}), call_id))
        added = ("response.output_item.added", {"output_index": len(self.items), "item": {**item, "input": ""}})
        delta = ("response.custom_tool_call_input.delta", {**where, "delta": text})
        done = ("response.custom_tool_call_input.done", {**where, "input": text})
        return [added, delta] + self._finish({**item, "input": text}, [done])

    def _start_call(self, name: str) -> Emitted:
        self._call = {"id": _id("fc"), "type": "function_call", "call_id": _id("call"), **self._named(name),
                      "status": "in_progress"}
        return [("response.output_item.added", {"output_index": len(self.items), "item": {**self._call,
                                                                                           "arguments": ""}})]

    def _call_where(self) -> dict:
        return {"item_id": self._call["id"], "output_index": len(self.items)}

    def _end_call(self, call: ToolCall) -> Emitted:
        item, where, self._call = self._call, self._call_where(), None
        canonical = written_arguments(call.arguments)
        arguments = call.arguments if canonical == call.arguments else canonical  # the item's string, held once
        self.parts.append(ToolCallPart(call.name, arguments, item["call_id"]))
        done_args = ("response.function_call_arguments.done", {**where, "arguments": call.arguments,
                                                               "name": item["name"]})
        return self._finish({**item, "arguments": call.arguments, "status": "completed"}, [done_args])

    def _finish(self, item: dict, before: Emitted) -> Emitted:
        index = len(self.items)
        self.items.append(item)
        return before + [("response.output_item.done", {"output_index": index, "item": item})]
