"""POST /v1/responses, streaming (response.created ... response.completed) and not, in the foreground or the
background (background.py); GET, DELETE /v1/responses/{response_id} and POST .../cancel.

`previous_response_id` and GET are served from the bounded in-memory ResponseStore, which keeps each finished
response as its create call answered it; `store: false` responses are never kept (GET answers them 404). A
running background response is read from its job; GET with `stream=true` follows the events of one created with
`stream: true` (`starting_after` N: those numbered over N), while it runs and for a while after it ended.
"""
from __future__ import annotations

import functools
from contextlib import AsyncExitStack

from aiohttp import web

from proxy.apis.responses.background import BACKGROUND, Job, follow
from proxy.apis.responses.output import OutputItems
from proxy.apis.responses.response import TERMINAL_EVENTS, final, head, pending, state_event
from proxy.apis.responses.schema import ResponsesRequest, check_supported, gen_params, to_conversation
from proxy.apis.responses.store import RESPONSES, ResponseStore
from proxy.apis.responses.tools import offered_tools
from proxy.body import read_json_object
from proxy.context import CTX
from proxy.errors import ApiError
from proxy.generation import Admitted, Finished, Generation, Keepalive, Prepared, run_to_finish
from proxy.preparing import prepare
from proxy.sse import SSEWriter


async def responses(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    req = ResponsesRequest.model_validate(body)
    check_supported(req)
    store = request.app[RESPONSES]
    previous = _previous(request.app, req)
    tools = offered_tools(req.tools)
    conv = to_conversation(req, previous, tools)
    prep = await prepare(ctx, request, conv, gen_params(req), body)
    fixed = head(req)
    out = OutputItems(tools, "reasoning.encrypted_content" in (req.include or ()))
    history = conv.messages[1:] if req.instructions else conv.messages  # previous + input, not the instructions
    remember = functools.partial(_remember, store, req, fixed["id"], history, out)
    if req.background:
        return await _background(request, prep, fixed, out, remember, req.stream)
    async with Generation(ctx, prep) as gen:
        if req.stream:
            return await _stream(request, fixed, out, remember, gen)
        return await _complete(request, fixed, out, remember, gen)


async def _background(request: web.Request, prep: Prepared, fixed: dict, out: OutputItems, remember,
                      stream: bool) -> web.StreamResponse:
    """Submits (a full engine queue, or as many background responses running as the server runs, is a 429
    here), then answers the queued response or follows its events."""
    ctx = request.app[CTX]
    request.app[BACKGROUND].check_room()
    stack = AsyncExitStack()
    gen = await stack.enter_async_context(Generation(ctx, prep))
    job = Job(fixed, out, remember, stream, stack, gen)
    request.app[BACKGROUND].start(job)
    prep.turn.response, prep.turn.ended = job.state, job.ended
    if stream:
        return await follow(request, job, ctx.keepalive_s)
    return web.json_response(job.state())


async def _complete(request: web.Request, fixed: dict, out: OutputItems, remember, gen: Generation) -> web.Response:
    fin = await run_to_finish(request, gen, out.feed)
    out.close()
    body = final(fixed, out, fin)
    remember(body)
    gen.turn.response = lambda: body
    return web.json_response(body)


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{response_id}: a running background response's state, else the stored response object
    as its create call answered it; with stream=true, its events (_resume). A starting_after that is no sequence
    number is a 400 either way."""
    response_id = request.match_info["response_id"]
    after = _starting_after(request)
    if _flag(request, "stream"):
        return await _resume(request, response_id, after)
    job = request.app[BACKGROUND].get(response_id)
    if job is not None:
        return web.json_response(job.state())
    return web.json_response(_stored(request.app, response_id))


async def _resume(request: web.Request, response_id: str, after: int) -> web.StreamResponse:
    """The events of a background response created with `stream: true`, those numbered over `after`, then the
    rest as they come until it ends. Its events are kept while it runs and for the last streamed ones that
    ended (EndedStreams); for any other stored response it is a 400 that says why."""
    jobs = request.app[BACKGROUND]
    job = jobs.streamed(response_id)
    if job is None:
        stored = _stored(request.app, response_id)
        if not stored.get("background"):
            raise ApiError(400, f"Response {response_id!r} was not created with background: true; only background "
                                "responses created with stream: true can be streamed.", param="stream")
        raise ApiError(400, f"The events of response {response_id!r} are no longer kept (they are kept for at most "
                            f"the last {jobs.ended.capacity} background responses created with stream: true that "
                            "ended); retrieve it without stream.", param="stream")
    if job.events is None:
        raise ApiError(400, f"Response {response_id!r} was created without stream: true, so its events were not "
                            "kept; retrieve it without stream.", param="stream")
    return await follow(request, job, request.app[CTX].keepalive_s, after)


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "1", "false", "0"):
        raise ApiError(400, f"{name}: expected true or false, got {value!r}", param=name)
    return value in ("true", "1")


def _starting_after(request: web.Request) -> int:
    """The query's starting_after, a sequence number (-1 when absent: from the first event)."""
    value = request.query.get("starting_after")
    if value is None:
        return -1
    if not (value.isascii() and value.isdigit()):
        raise ApiError(400, f"starting_after: expected a sequence number (an integer >= 0), got {value!r}",
                       param="starting_after")
    return int(value)


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{response_id}/cancel: a running background response ends cancelled (its engine request
    aborted); one that has ended is answered as it ended."""
    response_id = request.match_info["response_id"]
    job = request.app[BACKGROUND].get(response_id)
    if job is not None:
        return web.json_response(await job.cancel())
    stored = _stored(request.app, response_id)
    if not stored.get("background"):
        raise ApiError(400, f"Response {response_id!r} was not created with background: true; only background "
                            "responses can be cancelled.", param="response_id")
    return web.json_response(stored)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}: forgets the response (a later previous_response_id naming it is a 400)
    and its kept events; a running background response is cancelled first."""
    response_id = request.match_info["response_id"]
    job = request.app[BACKGROUND].get(response_id)
    if job is not None:
        await job.cancel()
    request.app[BACKGROUND].ended.forget(response_id)
    if not request.app[RESPONSES].delete(response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _stored(app: web.Application, response_id: str) -> dict:
    stored = app[RESPONSES].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id!r} not found (responses are kept in memory, a bounded "
                         "number, and never with store:false).")


def _previous(app: web.Application, req: ResponsesRequest):
    if not req.previous_response_id:
        return ()
    if app[BACKGROUND].get(req.previous_response_id) is not None:
        raise ApiError(400, f"previous_response_id: response {req.previous_response_id!r} is still running in the "
                            "background; wait until it has ended", param="previous_response_id")
    stored = app[RESPONSES].get(req.previous_response_id)
    if stored is None:
        raise ApiError(400, f"previous_response_id: no stored response {req.previous_response_id!r} "
                            "(responses are kept in memory, a bounded number, and never with store:false)",
                       param="previous_response_id", code="previous_response_not_found")
    return stored.messages


def _remember(store: ResponseStore, req: ResponsesRequest, response_id: str, history, out: OutputItems,
              body: dict) -> None:
    if req.store:
        store.put(response_id, tuple(history) + (out.message(),), body)


class _Events:
    def __init__(self, sse: SSEWriter):
        self.sse, self.seq = sse, 0

    async def send(self, kind: str, payload: dict) -> None:
        await self.sse.event({"type": kind, "sequence_number": self.seq, **payload}, kind)
        self.seq += 1


async def _stream(request: web.Request, fixed: dict, out: OutputItems, remember, gen: Generation) -> web.StreamResponse:
    sse = SSEWriter(request)
    events = _Events(sse)
    await events.send("response.created", {"response": pending(fixed, "in_progress", out)})
    await events.send(*state_event(fixed, "in_progress", out))
    async for item in gen:
        if isinstance(item, Keepalive):
            await events.send(*state_event(fixed, "in_progress", out))
            continue
        if isinstance(item, Admitted):  # usage goes out with the final response
            continue
        if isinstance(item, Finished):
            emitted = out.close()
            body = final(fixed, out, item)
            remember(body)
            gen.turn.response = lambda body=body: body
            emitted.append((TERMINAL_EVENTS[body["status"]], {"response": body}))
        else:
            emitted = out.feed(item)
        for kind, payload in emitted:
            await events.send(kind, payload)
    return await sse.finish()
