"""POST /v1/messages (streaming and not) and /v1/messages/count_tokens, in Anthropic's exact shapes.

Streaming grammar: message_start, ping, then per content block content_block_start / *_delta /
content_block_stop (thinking_delta + signature_delta, text_delta, input_json_delta), message_delta with
stop_reason and the final usage, message_stop.

message_start goes out once the engine has admitted the request, so its usage carries the real split of the
prompt into input_tokens and cache_read_input_tokens (Claude Code reads it there), or after QUEUED_START_S in the
queue (the whole prompt as input then; message_delta has the split). An engine failure before anything was sent is
an error answer of its own (HTTP status and the API's error body); once bytes are out, it is an `error` event.

Keep-alives (nothing sent for --keepalive seconds, queued or prefilling): pings before message_start. After it,
an empty delta of the open block, and where the answer starts in thinking and no block is open yet, the thinking
block opened for it (its thinking streams into it later): Claude Code skips pings and comments, and gives up on a
stream 300 s after its last other event (CLAUDE_STREAM_IDLE_TIMEOUT_MS can only raise that), whereas an empty
delta counts for it and adds nothing to the message.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid

from aiohttp import web

from proxy.apis.anthropic.schema import (CountTokensRequest, MessagesRequest, check_supported, gen_params,
                                         to_conversation)
from proxy.body import read_json_object
from proxy.context import CTX
from proxy.generation import Admitted, Finished, Generation, Keepalive, answer_whole, check_failed
from proxy.preparing import prepare, prompt_tokens
from proxy.prompt.output_parser import TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, ToolCallStart
from proxy.sse import SSEWriter

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                "stop_sequence": "stop_sequence", "abort": "end_turn", "error": "end_turn"}
QUEUED_START_S = 60.0  # a request still queued after this long gets its message_start (keep-alives need one)
EMPTY_DELTAS = {"thinking": {"type": "thinking_delta", "thinking": ""}, "text": {"type": "text_delta", "text": ""},
                "tool_use": {"type": "input_json_delta", "partial_json": ""}}


async def messages(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    req = MessagesRequest.model_validate(body)
    check_supported(req)
    prep = await prepare(ctx, request, to_conversation(req), gen_params(req), body)
    msg = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": req.model}
    async with Generation(ctx, prep) as gen:
        if req.stream:
            return await _stream(request, msg, len(prep.request.prompt_ids), gen)
        return await answer_whole(request, gen, functools.partial(message_json, msg))


async def count_tokens(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    conv = to_conversation(CountTokensRequest.model_validate(body))
    return web.json_response({"input_tokens": await prompt_tokens(ctx, conv, request.headers, body)})


def message_json(msg: dict, blocks: list, fin: Finished) -> dict:
    return {**msg, "content": [_block_json(b) for b in blocks], **_stop_fields(fin), "usage": usage_json(fin)}


def usage_json(fin: Finished) -> dict:
    u = fin.usage
    return {"input_tokens": u.prompt_tokens - u.reused_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.reused_tokens, "output_tokens": u.output_tokens}


def _stop_fields(fin: Finished) -> dict:
    return {"stop_reason": STOP_REASONS[fin.finish], "stop_sequence": fin.stop_sequence}


def _signature(thinking: str) -> str:
    """Not a secret: agents re-send thinking blocks with a signature, so each gets a stable one."""
    return "killick-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _block_json(block) -> dict:
    if isinstance(block, ThinkingDelta):
        return {"type": "thinking", "thinking": block.text, "signature": _signature(block.text)}
    if isinstance(block, TextDelta):
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": _tool_id(), "name": block.name, "input": _json_object(block.arguments)}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _json_object(text: str) -> dict:
    """A call's arguments as `input`; a streamed call whose arguments turned out malformed gets {}."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class _BlockStream:
    """Opens and closes content blocks as the kind of output changes."""

    def __init__(self, sse: SSEWriter):
        self.sse, self.index, self.kind, self.thinking = sse, -1, None, ""

    async def open(self, kind: str, block: dict) -> None:
        await self.close()
        self.index, self.kind = self.index + 1, kind
        await self.sse.event({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start")

    async def delta(self, delta: dict) -> None:
        await self.sse.event({"type": "content_block_delta", "index": self.index, "delta": delta},
                             "content_block_delta")

    async def close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            await self.delta({"type": "signature_delta", "signature": _signature(self.thinking)})
            self.thinking = ""
        await self.sse.event({"type": "content_block_stop", "index": self.index}, "content_block_stop")
        self.kind = None

    async def item(self, item) -> None:
        if isinstance(item, ThinkingDelta):
            if self.kind != "thinking":
                await self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += item.text
            await self.delta({"type": "thinking_delta", "thinking": item.text})
        elif isinstance(item, TextDelta):
            if self.kind != "text":
                await self.open("text", {"type": "text", "text": ""})
            await self.delta({"type": "text_delta", "text": item.text})
        elif isinstance(item, ToolCallStart):
            await self.open("tool_use", {"type": "tool_use", "id": _tool_id(), "name": item.name, "input": {}})
        elif isinstance(item, ToolCallDelta):
            await self.delta({"type": "input_json_delta", "partial_json": item.text})
        elif isinstance(item, ToolCall):
            if not item.streamed:
                await self.open("tool_use", {"type": "tool_use", "id": _tool_id(), "name": item.name, "input": {}})
                await self.delta({"type": "input_json_delta", "partial_json": item.arguments})
            await self.close()


async def _stream(request: web.Request, msg: dict, prompt_tokens: int, gen: Generation) -> web.StreamResponse:
    sse = SSEWriter(request)
    blocks = _BlockStream(sse)
    started = False  # message_start is out
    t0 = time.monotonic()
    async for item in gen:
        if isinstance(item, Keepalive):
            if not started and time.monotonic() - t0 >= QUEUED_START_S:
                await _message_start(sse, msg, _start_usage(None, prompt_tokens))
                started = True
            await _keep_alive(blocks, started, gen.parser.mode == "think")
            continue
        if not started and not (isinstance(item, Finished) and item.finish == "error"):
            await _message_start(sse, msg, _start_usage(item, prompt_tokens))
            started = True
        if isinstance(item, Finished):
            if not sse.started:
                check_failed(item)  # raises: nothing is sent yet, so the failure is the answer
            gen.turn.response = lambda fin=item: message_json(msg, gen.blocks, fin)
            await _finish_stream(sse, blocks, item)
        elif not isinstance(item, Admitted):
            await blocks.item(item)
    return await sse.finish()


async def _message_start(sse: SSEWriter, msg: dict, usage: dict) -> None:
    await sse.event({"type": "message_start", "message": {
        **msg, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}, "message_start")
    await sse.event({"type": "ping"}, "ping")


async def _keep_alive(blocks: _BlockStream, started: bool, thinks: bool) -> None:
    """A ping before message_start; after it an empty delta of the open block, the thinking block opened first
    where nothing was written yet and the answer starts in thinking; a ping where no block can take one."""
    if started and blocks.kind is None and blocks.index < 0 and thinks:
        await blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
    if started and blocks.kind in EMPTY_DELTAS:
        await blocks.delta(EMPTY_DELTAS[blocks.kind])
    else:
        await blocks.sse.event({"type": "ping"}, "ping")


def _start_usage(first, prompt_tokens: int) -> dict:
    """message_start's usage from the first item: the split the engine's admission settled (or an early end's
    usage); the whole prompt as input where the backend tells its cache reuse only at the end (an upstream)."""
    reused = 0
    if isinstance(first, Admitted):
        prompt_tokens, reused = first.prompt_tokens, first.reused_tokens
    elif isinstance(first, Finished):
        prompt_tokens, reused = first.usage.prompt_tokens, first.usage.reused_tokens
    return {"input_tokens": prompt_tokens - reused, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": reused, "output_tokens": 0}


async def _finish_stream(sse: SSEWriter, blocks: _BlockStream, fin: Finished) -> None:
    await blocks.close()
    if fin.finish == "error":
        await sse.event({"type": "error", "error": {"type": "api_error", "message": fin.error or "engine error"}},
                        "error")
        return
    await sse.event({"type": "message_delta", "delta": _stop_fields(fin), "usage": usage_json(fin)},
                    "message_delta")
    await sse.event({"type": "message_stop"}, "message_stop")
