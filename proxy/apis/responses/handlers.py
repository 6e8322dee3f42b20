"""POST /v1/responses, streaming (response.created ... response.completed) and not; GET and DELETE
/v1/responses/{response_id}.

`previous_response_id` and GET are served from the bounded in-memory ResponseStore, which keeps each finished
response as its create call answered it; `store: false` responses are never kept (GET answers them 404). Usage
carries `input_tokens_details.cached_tokens` and `output_tokens_details.reasoning_tokens`.
"""
from __future__ import annotations

import functools
import time
import uuid

from aiohttp import web

from proxy.apis.responses.output import OutputItems
from proxy.apis.responses.schema import ResponsesRequest, check_supported, gen_params, to_conversation
from proxy.apis.responses.store import RESPONSES, ResponseStore
from proxy.apis.responses.tools import offered_tools
from proxy.body import read_json_object
from proxy.context import CTX
from proxy.errors import ApiError, not_served
from proxy.generation import Admitted, Finished, Generation, Keepalive, run_to_finish
from proxy.preparing import prepare
from proxy.sse import SSEWriter

TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed"}


async def responses(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    req = ResponsesRequest.model_validate(body)
    check_supported(req)
    store = request.app[RESPONSES]
    previous = _previous(store, req)
    tools = offered_tools(req.tools)
    conv = to_conversation(req, previous, tools)
    prep = await prepare(ctx, request, conv, gen_params(req), body)
    head = _head(req)
    out = OutputItems(tools, "reasoning.encrypted_content" in (req.include or ()))
    history = conv.messages[1:] if req.instructions else conv.messages  # previous + input, not the instructions
    remember = functools.partial(_remember, store, req, head["id"], history, out)
    async with Generation(ctx, prep) as gen:
        if req.stream:
            return await _stream(request, head, out, remember, gen)
        return await _complete(request, head, out, remember, gen)


async def _complete(request: web.Request, head: dict, out: OutputItems, remember, gen: Generation) -> web.Response:
    fin = await run_to_finish(request, gen, out.feed)
    out.close()
    body = _final(head, out, fin)
    remember(body)
    gen.turn.response = lambda: body
    return web.json_response(body)


async def retrieve(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: the stored response object, as its create call answered it."""
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise not_served("stream", "streaming a stored response again", "retrieve it without stream")
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}: forgets the response (a later previous_response_id naming it is a 400)."""
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES].delete(response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id!r} not found (responses are kept in memory, a bounded "
                         "number, and never with store:false).")


def _previous(store: ResponseStore, req: ResponsesRequest):
    if not req.previous_response_id:
        return ()
    stored = store.get(req.previous_response_id)
    if stored is None:
        raise ApiError(400, f"previous_response_id: no stored response {req.previous_response_id!r} "
                            "(responses are kept in memory, a bounded number, and never with store:false)",
                       param="previous_response_id", code="previous_response_not_found")
    return stored.messages


def _remember(store: ResponseStore, req: ResponsesRequest, response_id: str, history, out: OutputItems,
              body: dict) -> None:
    if req.store:
        store.put(response_id, tuple(history) + (out.message(),), body)


def _head(req: ResponsesRequest) -> dict:
    """The response object's fields that do not change while it is generated."""
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
        "model": req.model, "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "store": req.store,
        "reasoning": (req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}),
        "text": {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {}, "error": None, "incomplete_details": None,
    }


def usage_json(fin: Finished) -> dict:
    u = fin.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.output_tokens, "output_tokens_details": {"reasoning_tokens": fin.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.output_tokens}


def _status(fin: Finished) -> str:
    return {"length": "incomplete", "error": "failed"}.get(fin.finish, "completed")


def _final(head: dict, out: OutputItems, fin: Finished) -> dict:
    status = _status(fin)
    body = {**head, "status": status, "output": out.items, "usage": usage_json(fin)}
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    if status == "failed":
        body["error"] = {"code": "server_error", "message": fin.error or "engine error"}
    return body


class _Events:
    def __init__(self, sse: SSEWriter):
        self.sse, self.seq = sse, 0

    async def send(self, kind: str, payload: dict) -> None:
        await self.sse.event({"type": kind, "sequence_number": self.seq, **payload}, kind)
        self.seq += 1


async def _stream(request: web.Request, head: dict, out: OutputItems, remember, gen: Generation) -> web.StreamResponse:
    sse = SSEWriter(request)
    events = _Events(sse)
    pending = {**head, "status": "in_progress", "output": [], "usage": None}
    await events.send("response.created", {"response": pending})
    await events.send("response.in_progress", {"response": pending})
    async for item in gen:
        if isinstance(item, Keepalive):
            await sse.comment("keep-alive")
            continue
        if isinstance(item, Admitted):  # usage goes out with the final response
            continue
        if isinstance(item, Finished):
            emitted = out.close()
            final = _final(head, out, item)
            remember(final)
            gen.turn.response = lambda final=final: final
            emitted.append((TERMINAL_EVENTS[final["status"]], {"response": final}))
        else:
            emitted = out.feed(item)
        for kind, payload in emitted:
            await events.send(kind, payload)
    return await sse.finish()
