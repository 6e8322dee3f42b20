"""The backend of `killick serve --upstream`: OpenAI-compatible servers answer, the pool routes each request to
one, checks their health and fails over. It is the app's `core` (create_app), an AnswerSource
(proxy/generation.py):

    pool = UpstreamPool(config)
    app.cleanup_ctx.append(pool.lifetime)         # HTTP client + health checks, opened and closed with the app
    items = await pool.answer(ctx, prep)          # connect (ApiError before any byte), then OutputEvents, Finished
    pool.stats()                                  # /metrics, /health, killick ctl stats

One request: route (proxy/upstream/routing.py) -> POST /v1/chat/completions (stream, usage) to the first choice
-> SSE chunks -> OutputEvents (proxy/upstream/wire.py) -> Finished with the upstream's usage. Until the first
output event is out, a failed replica (refused, cut, 5xx, 429) costs nothing but time: the request goes to the
next one and the replica is marked down until a health check passes. After that, the answer ends with an error
in the API's shape (front-ends: an error event, or a 500 for a non-streaming request), never silently.
A health check that fails takes the replica out of rotation for new requests. Its requests in flight are cut
(the failure above) only when none of them heard from it while the check waited: a stalled replica sends no
error, and the read timeout that would end the wait is long for a healthy replica's silent prefill, but a
replica that still streams is busy, not stalled, and finishes what it holds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import AsyncIterator, NamedTuple, Optional

import aiohttp

from engine.api import Usage
from proxy.errors import ApiError
from proxy.generation import Finished, Prepared
from proxy.prompt.output_parser import OutputEvent, TextDelta, ThinkingDelta, ToolCall
from proxy.replay.scripted import Reply, forced_ids
from proxy.sse import read_lines
from proxy.upstream.config import UpstreamConfig, refused_key
from proxy.upstream.routing import Replica, Router
from proxy.upstream.wire import ChunkReader, chat_body

log = logging.getLogger("killick.upstream")
SESSION_HEADER = "x-session-id"  # the proxy's session key, so a killick upstream keeps the same session
HEALTH_TIMEOUT_S = 5.0  # a health answer slower than this marks the replica down
_NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def model_entry(body) -> tuple[Optional[str], Optional[int]]:
    """(id, context length) of the first model a GET /v1/models body lists (killick: context_length, vLLM:
    max_model_len); None for what it does not say, or all of it for a body not in that shape."""
    data = body.get("data") if isinstance(body, dict) else None
    entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    model, context = entry.get("id"), entry.get("context_length") or entry.get("max_model_len")
    try:
        context = int(context) if context else None
    except (TypeError, ValueError):
        context = None
    return (model if isinstance(model, str) and model else None), (context if context and context > 1 else None)


class Unknown(NamedTuple):
    """What no replica said at start (none was up): the first that is up is asked (GET /v1/models)."""

    model: bool = False  # the model requests name where no --upstream-model pattern matches
    name: bool = False  # the name /v1/models shows (no --model-name)
    context: bool = False  # the context length (no --context-length)


class UpstreamPool:
    def __init__(self, config: UpstreamConfig, unknown: Unknown = Unknown()):
        self.config = config
        self.router = Router(list(config.urls), config.routing)
        self.http: Optional[aiohttp.ClientSession] = None
        self.unknown = unknown
        self._ctx = None  # the app's ServerContext (lifetime): what is learned late goes there
        self.calls: set[_Call] = set()  # requests in flight at some replica (_Call.replica)

    async def lifetime(self, app):
        """app.cleanup_ctx: the HTTP client and the health checks live as long as the app."""
        from proxy.context import CTX

        self._ctx = app[CTX]
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                          sock_read=self.config.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=0))
        checks = asyncio.create_task(self._health_loop())
        try:
            yield
        finally:
            checks.cancel()
            with suppress(asyncio.CancelledError):
                await checks
            await self.http.close()

    def stats(self) -> dict:
        return self.router.stats()

    async def answer(self, ctx, prep: Prepared) -> AsyncIterator[OutputEvent | Finished]:
        call = _Call(self, ctx, prep)
        await call.connect()
        return call

    # -- health -----------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(r) for r in self.router.replicas))
            if any(self.unknown):
                await self.learn()
            await asyncio.sleep(self.config.health_interval_s)

    async def learn(self) -> None:
        """Ask the first replica that is up what it serves (its first model's id and context length, as at
        start), for what no replica said at start."""
        for replica in (r for r in self.router.replicas if r.healthy):
            try:
                async with self.http.get(replica.url + "/v1/models", headers=self._auth(),
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                    body = await resp.json() if resp.status == 200 else None
            except (*_NET_ERRORS, ValueError):
                continue
            model, context = model_entry(body)
            if not model:
                continue
            if self.unknown.model:
                self.config = replace(self.config, default_model=model)
            if self.unknown.name:
                self._ctx.model_name = model
            if self.unknown.context and context:
                self._ctx.context_length = context
            log.info("upstream %s serves %s%s: taken for what no replica said at start", replica.url, model,
                     f" ({context} tokens)" if context else "")
            self.unknown = Unknown()
            return

    async def check(self, replica: Replica) -> bool:
        """GET /health (killick, llama.cpp, vLLM and SGLang all serve it): 200 is up. A replica busy with a long
        prefill may answer late; it gets HEALTH_TIMEOUT_S whatever the interval (a short interval once marked
        busy replicas down, and their sessions lost their cached prefix to another replica). Down, it gets no
        new requests; those in flight there are cut only if it is silent (stalled), never while it streams."""
        asked, why = time.monotonic(), None
        try:
            async with self.http.get(replica.url + "/health", headers=self._auth(),
                                     timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                ok = resp.status == 200
                why = None if ok else f"health check: HTTP {resp.status}"
        except _NET_ERRORS as exc:
            ok, why = False, f"health check: {describe(exc)}"
        calls = [c for c in self.calls if c.replica is replica]
        streaming = [c for c in calls if c.heard >= asked]  # bytes came while the check waited: busy, not stalled
        if ok != replica.healthy:
            goes_on = f"; it still streams: its {len(calls)} in flight go on" if streaming else ""
            (log.info if ok else log.warning)("upstream %s is %s%s%s", replica.url, "up" if ok else "down",
                                              f" ({why})" if why else "", goes_on)
        self.router.set_health(replica, ok, why)
        if not ok and not streaming:
            for call in calls:
                call.cut(f"marked down, {why}")
        return ok

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}


class _Call:
    """One request's trip: the replicas it may try, the one answering now, what came back. Iterated for its
    items; aclose() releases the replica and the connection even when the items were never read."""

    def __init__(self, pool: UpstreamPool, ctx, prep: Prepared):
        self.pool, self.router, self.ctx, self.prep = pool, pool.router, ctx, prep
        self.key = prep.turn.plan.session_key
        self.body = chat_body(prep.conv, prep.params, prep.request.max_new_tokens,
                              pool.config.upstream_model(prep.model))
        self.headers = {**pool._auth(), **({SESSION_HEADER: self.key} if self.key else {}),
                        **{h: prep.headers[h] for h in pool.config.forward_headers if h in prep.headers}}
        self.todo = self.router.order(self.key)
        self.tried: list[str] = []
        self.busy = False  # some replica answered 429
        self.replica: Optional[Replica] = None  # where the request is in flight (asked, or answering)
        self.resp: Optional[aiohttp.ClientResponse] = None
        self.cut_why: Optional[str] = None  # why cut() ended the wait at self.replica
        self._waiting: Optional[asyncio.Timeout] = None  # while the replica's headers are awaited
        self.heard = -math.inf  # time.monotonic() of the last bytes from self.replica (its health check reads it)
        self.t0 = time.perf_counter()
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self._items = self.items()

    def __aiter__(self) -> "_Call":
        return self

    async def __anext__(self) -> OutputEvent | Finished:
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._items.aclose()
        self._close()

    async def connect(self) -> None:
        """POST to the next replica in order until one answers 200; an ApiError if none does."""
        while self.todo:
            self._start(self.todo.pop(0))
            url = self.replica.url
            try:
                async with asyncio.timeout(None) as self._waiting:  # no deadline of its own: cut() sets one
                    resp = await self.pool.http.post(url + "/v1/chat/completions", json=self.body,
                                                     headers=self.headers)
                    message = None if resp.status == 200 else _error_message(await resp.text())
            except _NET_ERRORS as exc:
                self._failed(self.cut_why or describe(exc), down=True)
                continue
            except BaseException:  # cancelled (the agent went away before the replica's headers): not in flight
                self._leave()
                raise
            finally:
                self._waiting = None
            if resp.status == 200:
                self.resp, self.heard = resp, time.monotonic()
                self.router.answered(self.key, self.replica)
                return
            resp.release()
            if resp.status in (401, 403):  # killick's key, not the agent's: the gateway is at fault
                self._leave()
                raise ApiError(502, f"{refused_key(url, resp.status)}; it said: {message}",
                               headers={"x-should-retry": "false"})
            if resp.status < 500 and resp.status != 429:  # the request itself is at fault: no other replica helps
                self._leave()
                raise ApiError(resp.status, f"upstream {url}: {message}")
            self.busy = self.busy or resp.status == 429
            self._failed(f"HTTP {resp.status}: {message}", down=resp.status in (502, 503, 504))
        status, what = (429, "busy") if self.busy else (503, "unreachable or failing")
        raise ApiError(status, f"no upstream replica answered ({what}): {'; '.join(self.tried)}",
                       code="rate_limit_exceeded" if self.busy else None)

    def _start(self, replica: Replica) -> None:
        """In flight at `replica` from here on: its load, and cut() when its health check fails. After a replica
        failed (refused, cut, 5xx, 429, a stream broken before its first output) this is a retry."""
        self.router.retries += bool(self.tried)
        self.router.started(replica, self.key)
        self.replica, self.cut_why, self.heard = replica, None, -math.inf
        self.pool.calls.add(self)

    def _leave(self, usage: Optional[Usage] = None) -> None:
        """No longer in flight at self.replica; a complete answer's usage is booked there."""
        self.router.finished(self.key, self.replica, usage.prompt_tokens if usage else 0,
                             usage.reused_tokens if usage else 0, ok=usage is not None)
        self.replica = None
        self.pool.calls.discard(self)

    def cut(self, why: str) -> None:
        """The replica's health check failed while it sent nothing: stop waiting for its headers or its next
        chunk now. The failure then goes the usual way: the next replica while nothing went to the agent, else an
        error in the API's shape."""
        self.cut_why = why
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.reschedule(asyncio.get_running_loop().time())  # the POST ends with a TimeoutError
        if self.resp is not None:
            self.resp.close()  # the pending read ends with a ClientConnectionError

    def _failed(self, why: str, down: bool) -> None:
        replica = self.replica
        self.tried.append(f"{replica.url}: {why}")
        self._leave()
        self.router.failed(replica, why, down=down)
        log.warning("upstream %s failed (%s)%s", replica.url, why, "; trying the next" if self.todo else "")

    async def items(self) -> AsyncIterator[OutputEvent | Finished]:
        reply = _ReplyParts()
        try:
            while True:
                reader, failure = ChunkReader(self.prep.params, continues=self.prep.conv.continue_last), None
                async for item in self._chunks(reader):
                    if isinstance(item, _Failure):  # always the last item
                        failure = item.why
                    else:
                        reply.add(item, self)
                        yield item
                if failure is None or reply.started:
                    break
                self._failed(failure, down=True)  # nothing went to the agent yet: the next replica answers instead
                self.resp = self._close_response()
                try:
                    await self.connect()
                except ApiError as err:
                    yield self._error(err.message, reader, status=err.status)
                    return
            for item in reader.close():
                reply.add(item, self)
                yield item
            yield self._finished(reader, failure, reply)
        finally:
            self._close()

    async def _chunks(self, reader: ChunkReader) -> AsyncIterator[OutputEvent | "_Failure"]:
        """Output events as the SSE chunks arrive; a _Failure last when the stream broke before its end."""
        done = False
        try:
            async for line in read_lines(self.resp):
                self.heard = time.monotonic()
                if not line.startswith("data:"):
                    continue  # keep-alive comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                try:
                    items = list(reader.feed(chunk)) if isinstance(chunk, dict) else []
                except (TypeError, ValueError, AttributeError, KeyError) as exc:  # fields not in the API's types
                    yield _Failure(f"a chunk not in the OpenAI shape ({type(exc).__name__}: {exc})")
                    return
                for item in items:
                    yield item
                if reader.ended or reader.error:
                    return
        except _NET_ERRORS as exc:
            yield _Failure(self.cut_why or describe(exc))
            return
        if not done and reader.finish is None:
            yield _Failure("the stream ended before its last chunk")

    def _finished(self, reader: ChunkReader, failure: Optional[str], reply: "_ReplyParts") -> Finished:
        if failure is not None:  # output was already out: this answer cannot be completed elsewhere
            self.router.failed(self.replica, failure, down=True)
            return self._error(f"upstream {self.replica.url} failed mid-answer ({failure}); the answer is incomplete",
                               reader, reply)
        if reader.error is not None:
            return self._error(f"upstream {self.replica.url}: {reader.error}", reader, reply)
        usage = self._usage(reader, reply)
        self._leave(usage)
        parser = reader.parser
        finish = reader.finish or "stop"
        if parser.stopped is not None:
            finish = "stop_sequence"
        elif reply.calls and (finish == "stop" or reader.ended):
            finish = "tool_calls"
        reasoning = reader.usage.reasoning_tokens if reader.usage and reader.usage.reasoning_tokens is not None \
            else reader.reasoning_chunks
        return Finished(finish, usage, reasoning, stop_sequence=parser.stopped, output_ids=self._output_ids(reply))

    def _error(self, message: str, reader: ChunkReader, reply: Optional["_ReplyParts"] = None,
               status: int = 500) -> Finished:
        if self.replica is not None:
            self._leave()
        return Finished("error", self._usage(reader, reply or _ReplyParts()), error=message, error_status=status)

    def _usage(self, reader: ChunkReader, reply: "_ReplyParts") -> Usage:
        """The upstream's figures (its tokenizer, its cache); the proxy's own count where it sends none."""
        u = reader.usage
        prompt = u.prompt_tokens if u else len(self.prep.request.prompt_ids)
        cached = min(u.cached_tokens, prompt) if u else 0
        first = self.first if self.first is not None else time.perf_counter()
        return Usage(prompt_tokens=prompt, output_tokens=u.output_tokens if u else reply.events,
                     reused_tokens=cached, prefilled_tokens=prompt - cached, ttft_s=first - self.t0,
                     prefill_s=first - self.t0, decode_s=(self.last or first) - first)

    def _output_ids(self, reply: "_ReplyParts") -> tuple[int, ...]:
        """The answer as the chat template writes it, in the proxy's tokens: the cache policy's diff of the next
        turn compares against it (the upstream's own ids are not in its OpenAI answer)."""
        try:
            return tuple(forced_ids(self.ctx.renderer, self.ctx.tokenizer, self.prep.conv, self.prep.prompt_text,
                                    reply.reply()))
        except Exception:  # noqa: BLE001 - bookkeeping must never cost the agent its answer
            log.exception("could not render the upstream's answer for the cache policy")
            return ()

    def _close(self) -> None:
        self.resp = self._close_response()
        if self.replica is not None:  # left early (the client went away)
            self._leave()

    def _close_response(self) -> None:
        if self.resp is not None:
            self.resp.close()  # an unfinished answer: closing the connection stops the upstream's generation
        return None


@dataclass(frozen=True)
class _Failure:
    why: str


class _ReplyParts:
    """The answer so far, kept to book it with the cache policy; `started` once anything went to the agent."""

    def __init__(self):
        self.thinking, self.text, self.calls, self.events = [], [], [], 0

    @property
    def started(self) -> bool:
        return self.events > 0

    def add(self, item: OutputEvent, call: _Call) -> None:
        now = time.perf_counter()
        call.first = call.first if call.first is not None else now
        call.last = now
        self.events += 1
        if isinstance(item, ThinkingDelta):
            self.thinking.append(item.text)
        elif isinstance(item, TextDelta):
            self.text.append(item.text)
        elif isinstance(item, ToolCall):
            self.calls.append((item.name, item.arguments))

    def reply(self) -> Reply:
        return Reply(thinking="".join(self.thinking), text="".join(self.text), tool_calls=tuple(self.calls))


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(text: str) -> str:
    """The message inside an OpenAI- or Anthropic-shaped error body, else the body's start."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300] or "(empty body)"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return text.strip()[:300]
