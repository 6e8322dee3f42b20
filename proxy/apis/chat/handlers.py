"""POST /v1/chat/completions, streaming (chat.completion.chunk + `data: [DONE]`) and not.

Reasoning goes out as `reasoning_content`, tool calls as `tool_calls` (id and name, then the arguments in
pieces as the model writes them), usage
with `prompt_tokens_details.cached_tokens` - in the final chunk when `stream_options.include_usage`.
Keep-alive while queued or prefilling: SSE comment lines.
"""
from __future__ import annotations

import functools
import time
import uuid

from aiohttp import web

from proxy.apis.chat.schema import ChatRequest, check_supported, gen_params, to_conversation
from proxy.body import read_json_object
from proxy.context import CTX
from proxy.generation import Admitted, Finished, Generation, Keepalive, answer_whole
from proxy.preparing import prepare
from proxy.prompt.output_parser import TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, ToolCallStart
from proxy.sse import SSEWriter

FINISH_REASONS = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "stop_sequence": "stop",
                  "abort": "stop", "error": "stop"}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    req = ChatRequest.model_validate(body)
    check_supported(req)
    prep = await prepare(ctx, request, to_conversation(req), gen_params(req), body)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model,
            "system_fingerprint": "killick"}
    async with Generation(ctx, prep) as gen:
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _stream(request, head, include_usage, gen)
        return await answer_whole(request, gen, functools.partial(_completion, head))


def usage_json(fin: Finished) -> dict:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.output_tokens,
            "total_tokens": u.prompt_tokens + u.output_tokens,
            "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
            "completion_tokens_details": {"reasoning_tokens": fin.reasoning_tokens}}


def _tool_call_json(call: ToolCall | ToolCallStart) -> dict:
    arguments = call.arguments if isinstance(call, ToolCall) else ""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": arguments}}


def _completion(head: dict, blocks: list, fin: Finished) -> dict:
    text = "".join(b.text for b in blocks if isinstance(b, TextDelta))
    reasoning = "".join(b.text for b in blocks if isinstance(b, ThinkingDelta))
    calls = [_tool_call_json(b) for b in blocks if isinstance(b, ToolCall)]
    message = {"role": "assistant", "content": text or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": FINISH_REASONS[fin.finish], "logprobs": None}
    return {**head, "object": "chat.completion", "choices": [choice], "usage": usage_json(fin)}


def _chunk(head: dict, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {**head, "object": "chat.completion.chunk", "choices": [choice]}


def _delta(item) -> dict | None:
    """The chunk's delta for an output event; None for the end of a call whose pieces went out already."""
    if isinstance(item, ThinkingDelta):
        return {"reasoning_content": item.text}
    if isinstance(item, TextDelta):
        return {"content": item.text}
    if isinstance(item, ToolCallDelta):
        return {"tool_calls": [{"index": item.index, "function": {"arguments": item.text}}]}
    if isinstance(item, ToolCall) and item.streamed:
        return None
    return {"tool_calls": [{"index": item.index, **_tool_call_json(item)}]}


async def _stream(request: web.Request, head: dict, include_usage: bool, gen: Generation) -> web.StreamResponse:
    sse = SSEWriter(request)
    await sse.event(_chunk(head, {"role": "assistant", "content": ""}))
    async for item in gen:
        if isinstance(item, Keepalive):
            await sse.comment("keep-alive")
        elif isinstance(item, Admitted):
            pass  # usage goes out in the last chunk
        elif isinstance(item, Finished):
            gen.turn.response = lambda fin=item: _completion(head, gen.blocks, fin)
            await _finish_stream(sse, head, include_usage, item)
        elif (delta := _delta(item)) is not None:
            await sse.event(_chunk(head, delta))
    return await sse.finish()


async def _finish_stream(sse: SSEWriter, head: dict, include_usage: bool, fin: Finished) -> None:
    if fin.finish == "error":
        await sse.event({"error": {"message": fin.error or "engine error", "type": "server_error",
                                   "param": None, "code": None}})
    else:
        await sse.event(_chunk(head, {}, FINISH_REASONS[fin.finish]))
        if include_usage:
            await sse.event({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage_json(fin)})
    await sse.data_line("[DONE]")
