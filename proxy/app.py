"""The aiohttp application: one factory, typed app state, middlewares for errors / auth / metrics.

    create_app(core, tokenizer, renderer, model_name=..., context_length=..., api_key=...,
               planner=None, replies=None, observer=None, access_log=False, sites=Sites(),
               responses_store_mb=512)

Every handler reads parse -> normalise -> render -> plan -> submit -> stream (see proxy/preparing.py,
proxy/generation.py). The engine core is started and stopped through cleanup_ctx, so the app owns its lifetime; in
upstream mode the core is an UpstreamPool (proxy/upstream/app.py: create_upstream_app), which answers with output
events itself. Scripts, replay and test answers plug in as one reply source (`replies`, proxy/replay/sources.py); a
recorder observes each finished API request through one hook (`observer`, proxy/replay/record.py); it hears only of
requests that passed authentication. Which web pages may reach the server at all: proxy/sites.py.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import time
from typing import Awaitable, Callable, Protocol
from urllib.parse import quote

from aiohttp import web

from proxy.apis.anthropic import handlers as anthropic
from proxy.apis.chat import handlers as chat
from proxy.apis.control import add_control_routes
from proxy.apis.responses import handlers as responses
from proxy.apis.responses.background import BACKGROUND, BackgroundJobs, background_lifetime
from proxy.apis.responses.store import MB, RESPONSES, ResponseStore
from proxy.body import MAX_BODY
from proxy.context import CTX, ServerContext
from proxy.errors import CLIENT_CLOSED, ApiError, error_middleware, is_anthropic_path
from proxy.generation import ARRIVED, TURN, ReplySource, Turn
from proxy.policy.planner import NoAnchors, Planner
from proxy.sites import Sites, cors_headers, sites_middleware

log = logging.getLogger("killick.proxy")
access_logger = logging.getLogger("killick.access")
AUTHENTICATED = web.RequestKey("killick_authenticated", bool)
_BEARER = re.compile(r"bearer\s+", re.IGNORECASE)
_HEADER_UNSAFE = re.compile(r"[^\x20-\x7e]|%")  # what a header value may not carry as is
_API_OF = {"/v1/messages": "anthropic", "/v1/messages/count_tokens": "count_tokens",
           "/v1/chat/completions": "chat", "/v1/responses": "responses"}
GENERATING_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
PLAN_HEADERS = {"x-killick-session": "session", "x-killick-turn-kind": "kind",
                "x-killick-edit-point": "edit_point", "x-killick-edit-class": "edit_class",
                "x-killick-resume-at": "anchor_used"}


class TurnObserver(Protocol):
    """Told once about every POST to a generating API, when it is over: its Turn (None when it was refused
    before planning), the HTTP status and the time it arrived (the recorder). A background response's create
    call is over when its response has ended (Turn.ended), after its answer went out."""

    async def turn_done(self, request: web.Request, turn: Turn | None, status: int, started: float) -> None: ...


def create_app(core, tokenizer, renderer, *, model_name: str = "killick", context_length: int | None = None,
               api_key: str | None = None, keepalive_s: float = 5.0, default_max_tokens: int = 8192,
               planner: Planner | None = None, replies: ReplySource | None = None,
               observer: TurnObserver | None = None, access_log: bool = False,
               sites: Sites = Sites(), responses_store_mb: int = 512) -> web.Application:
    """The queue limit is the engine's (EngineCore(max_running, max_waiting)): a full queue answers 429.
    `sites`: the Origin / Host checks (proxy/sites.py); the default is a loopback bind's.

    context_length defaults to the engine runner's, i.e. the real KV budget of one sequence.
    access_log: one INFO line per request on the `killick.access` logger (what `killick serve` turns on).
    responses_store_mb: the memory bound of the finished Responses kept (proxy/apis/responses/store.py).
    """
    context_length = context_length or getattr(getattr(core, "runner", None), "context_length", None)
    if not context_length or context_length < 2:
        raise ValueError("context_length is unknown: pass create_app(context_length=<the engine's KV budget>)")
    if keepalive_s <= 0:
        raise ValueError(f"keepalive_s must be > 0, got {keepalive_s}")
    ctx = ServerContext(core=core, tokenizer=tokenizer, renderer=renderer, model_name=model_name,
                        context_length=context_length, keepalive_s=keepalive_s,
                        default_max_tokens=default_max_tokens, planner=planner or NoAnchors(), replies=replies)
    middlewares = [access_middleware(access_log), error_middleware, sites_middleware(sites), auth_middleware(api_key)]
    if observer is not None:
        middlewares.insert(0, observe_middleware(observer))  # outermost: it sees the status answered
    app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
    app[CTX] = ctx
    app[RESPONSES] = ResponseStore(max_bytes=responses_store_mb * MB)
    app[BACKGROUND] = BackgroundJobs()
    app.cleanup_ctx.append(_engine_lifetime)
    app.cleanup_ctx.append(background_lifetime)  # cleaned up first: background responses end before the engine
    app.on_response_prepare.append(plan_headers)
    app.on_response_prepare.append(cors_headers)
    add_routes(app)
    return app


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", root)  # HEAD too: Claude Code probes it
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model_info)
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_post("/v1/responses", responses.responses)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses.cancel)
    add_control_routes(app)


async def _engine_lifetime(app: web.Application):
    core = app[CTX].core
    if hasattr(core, "start"):
        core.start()
    yield
    # off the event loop: the engine ends its step first, and a second Ctrl-C must be heard meanwhile
    await asyncio.get_running_loop().run_in_executor(None, stop_engine, app)
    app[CTX].planning.shutdown(wait=False, cancel_futures=True)  # its threads end after the plans under way


def stop_engine(app: web.Application) -> None:
    """Stop the engine thread after its current step (again: nothing happens). Python must not exit while the
    thread is inside a step: the process aborts."""
    core = app[CTX].core
    if hasattr(core, "stop"):
        core.stop()


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if api_key is not None and request.path != "/health" and not key_matches(request.headers, api_key):
            what = "x-api-key" if is_anthropic_path(request.path) else "API key"
            raise ApiError(401, f"invalid {what}: send the server's --api-key as 'Authorization: Bearer KEY' "
                                "or 'x-api-key: KEY'", code="invalid_api_key")
        request[AUTHENTICATED] = True
        return await handler(request)

    return check_key


def key_matches(headers, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (the scheme in any case) or `x-api-key: KEY`, compared in constant time;
    header bytes that are not UTF-8 compare as they came."""
    bearer = _BEARER.match(headers.get("Authorization", ""))
    offered = headers["Authorization"][bearer.end():] if bearer else headers.get("x-api-key", "")
    return hmac.compare_digest(offered.encode("utf-8", "surrogateescape"), api_key.encode())


def observe_middleware(observer: TurnObserver):
    @web.middleware
    async def observe(request: web.Request, handler):
        if request.method != "POST" or request.path not in GENERATING_PATHS:
            return await handler(request)
        started = time.time()

        async def done(status: int) -> None:
            if not request.get(AUTHENTICATED):
                return
            turn = request.get(TURN)
            await when_over(request, functools.partial(observer.turn_done, request, turn, status, started))

        return await answered(request, handler, done)

    return observe


async def when_over(request: web.Request, report: Callable[[], Awaitable[None]]) -> None:
    """report() now, or for a background response's create call once its response has ended (Turn.ended)."""
    turn = request.get(TURN)
    if turn is not None and turn.ended is not None and not turn.ended.is_set():
        request.app[BACKGROUND].after_end(turn.ended, report)
    else:
        await report()


async def plan_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the plan is made before any byte, so even a stream carries its edit point
    (x-killick-edit-point / -edit-class / -resume-at / -session / -turn-kind) for clients such as replay."""
    turn = request.get(TURN)
    if turn is None:
        return
    fields = turn.plan.fields()
    for name, key in PLAN_HEADERS.items():
        if fields.get(key) is not None:
            response.headers[name] = header_safe(str(fields[key]))


def header_safe(value: str) -> str:
    """Printable ASCII as is, everything else percent-encoded: a session id is the agent's text, and CR, LF
    or NUL in a header would break the response after the engine has run."""
    return _HEADER_UNSAFE.sub(lambda m: quote(m.group(), safe="", errors="surrogateescape"), value)


async def answered(request: web.Request, handler, done) -> web.StreamResponse:
    """handler(request), then `await done(status)` with the status it ended with, answered or raised."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except BaseException as exc:
        status = status_of(exc)
        raise
    finally:
        await done(status)


def status_of(exc: BaseException) -> int:
    """The status a request that raised `exc` past the error middleware ended with."""
    if isinstance(exc, web.HTTPException):
        return exc.status
    if isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
        return CLIENT_CLOSED
    return 500


def access_middleware(log_lines: bool):
    """Counts every request in /metrics (by API, else by route, else `unmatched`) and, with `log_lines`, logs
    one line per request: method, path, status, the engine's prompt / cached / prefilled tokens, TTFT, time. A
    background response's line is logged as it ends (its usage known then), its time from the create call."""

    @web.middleware
    async def access(request: web.Request, handler):
        started = request[ARRIVED] = time.monotonic()

        async def done(status: int) -> None:
            request.app[CTX].metrics.request_done(_route_label(request), status)
            if status == CLIENT_CLOSED:
                idle_abort_hint(request, time.monotonic() - started)
            if log_lines:
                await when_over(request, functools.partial(log_access, request, status, started))

        return await answered(request, handler, done)

    return access


# Claude Code gives up on a stream that sends no event for 300 s unless CLAUDE_STREAM_IDLE_TIMEOUT_MS says longer
# (keep-alive pings do not count): a client of it that left this long after its request, with no output sent yet,
# most likely did
CLAUDE_IDLE_ABORT_S = 290.0


def idle_abort_hint(request: web.Request, seconds: float) -> None:
    """A warning naming the fix when a Claude Code request was given up by its client after CLAUDE_IDLE_ABORT_S
    or more without output (a long prefill, or a queue): `killick launch claude` sets the timeout; a bare
    `claude` needs it set."""
    turn = request.get(TURN)
    if seconds < CLAUDE_IDLE_ABORT_S or "claude-cli/" not in request.headers.get("User-Agent", "") or (
            turn is not None and turn.first_output_s is not None):
        return
    log.warning("Claude Code gave up on %s after %.0f s with no output yet: it aborts a stream that sends no event "
                "for 300 s (keep-alive pings do not count). Start it with `killick launch claude`, or set "
                "CLAUDE_STREAM_IDLE_TIMEOUT_MS=3600000 in its environment", request.path, seconds)


async def log_access(request: web.Request, status: int, started: float) -> None:
    access_logger.info("%s", access_line(request, status, time.monotonic() - started))


def _route_label(request: web.Request) -> str:
    if request.path in _API_OF:
        return _API_OF[request.path]
    route = request.match_info.route
    return route.resource.canonical if route.resource is not None else "unmatched"


def access_line(request: web.Request, status: int, seconds: float) -> str:
    line = f"{request.method} {request.path_qs} {status}"
    turn = request.get(TURN)
    if turn is not None and turn.ended is not None:  # the create call of a background response, as it ended
        line += f" background {turn.response()['status'] if turn.response is not None else ''}".rstrip()
    if turn is not None and turn.finished is not None and turn.finished.finish == "error" \
            and turn.finished.usage.output_tokens == 0:  # failed before any output: no TTFT, no known prefill
        line += f" prompt={turn.finished.usage.prompt_tokens} error"
    elif turn is not None and turn.finished is not None:
        u = turn.finished.usage
        line += (f" prompt={u.prompt_tokens} cached={u.reused_tokens} prefilled={u.prefilled_tokens}"
                 f" out={u.output_tokens} ttft={u.ttft_s * 1000:.0f}ms")
        if turn.prepare_s is not None:  # the server's own part before and after the engine's TTFT
            line += f" prep={turn.prepare_s * 1000:.0f}ms"
            if turn.render_s is not None:
                line += f" (render={turn.render_s * 1000:.0f}ms plan={turn.plan_s * 1000:.0f}ms)"
        if turn.first_token_s is not None:
            line += f" tok1={turn.first_token_s * 1000:.0f}ms"
        if turn.first_output_s is not None:
            line += f" first={turn.first_output_s * 1000:.0f}ms"
            if turn.held is not None:  # an engine's request (an upstream's or a replayed answer has none)
                line += f" held={turn.held}"
    return f"{line} {seconds * 1000:.0f}ms"


async def root(request: web.Request) -> web.Response:
    return web.json_response({"name": "killick", "model": request.app[CTX].model_name, "status": "ok"})


async def health(request: web.Request) -> web.Response:
    stats = request.app[CTX].core.stats()
    return web.json_response({"status": "ok", "active": stats.get("active"), "queued": stats.get("queued")})


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    stats = {**ctx.core.stats(), "proxy_in_flight": ctx.in_flight}
    text = ctx.metrics.render(stats, ctx.planner.stats())
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def _model_entry(ctx: ServerContext, model_id: str) -> dict:
    """One entry readable by both SDKs: OpenAI (object/created/owned_by), Anthropic (type/display_name)."""
    created = int(time.time())
    return {"id": model_id, "object": "model", "created": created, "owned_by": "killick",
            "type": "model", "display_name": ctx.model_name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
            "context_length": ctx.context_length, "max_model_len": ctx.context_length,
            # Anthropic's ModelInfo limits: a prompt leaves at least one token of the window to its answer
            "max_input_tokens": ctx.context_length - 1, "max_tokens": ctx.context_length - 1}


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    return web.json_response({"object": "list", "data": [_model_entry(ctx, ctx.model_name)], "has_more": False,
                              "first_id": ctx.model_name, "last_id": ctx.model_name})


async def model_info(request: web.Request) -> web.Response:
    """Any model name an agent asks about is served by the loaded model."""
    return web.json_response(_model_entry(request.app[CTX], request.match_info["model_id"]))

