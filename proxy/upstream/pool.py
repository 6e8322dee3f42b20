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
import logging
import time
from contextlib import suppress
from dataclasses import replace
from typing import AsyncIterator, NamedTuple, Optional

import aiohttp

from proxy.generation import Finished, Prepared
from proxy.prompt.output_parser import OutputEvent
from proxy.upstream.call import NET_ERRORS, UpstreamCall, describe
from proxy.upstream.config import UpstreamConfig
from proxy.upstream.routing import Replica, Router

log = logging.getLogger("killick.upstream")
HEALTH_TIMEOUT_S = 5.0  # a health answer slower than this marks the replica down


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
        self.router = Router(list(config.urls), config.routing, reasoning=config.reasoning)
        self.http: Optional[aiohttp.ClientSession] = None
        self.unknown = unknown
        self._ctx = None  # the app's ServerContext (lifetime): what is learned late goes there
        self.calls: set[UpstreamCall] = set()  # requests in flight at some replica (UpstreamCall.replica)

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
        call = UpstreamCall(self, ctx, prep)
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
            except (*NET_ERRORS, ValueError):
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
        except NET_ERRORS as exc:
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
