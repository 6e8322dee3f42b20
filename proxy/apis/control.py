"""Control endpoints behind `killick ctl`: engine + cache + policy stats, and cache resizing at runtime.

    GET  /v1/killick/stats                      -> engine, prefix cache, expert cache, per-turn and tokenizer
                                                   cache figures
    POST /v1/killick/cache {"moe_slots": N, "kv_tokens": T, "prefix_device_mb": D, "prefix_host_mb": H}

Resizing runs on the engine thread between two steps (EngineCore.call), so no request sees a half-resized
cache; impossible sizes are refused before anything is freed (400 with the reason): here, numbers beyond
any machine (MAX_SIZE); in the engine, more than this one has (ModelRunner.reconfigure).
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.body import read_json_object
from proxy.context import CTX
from proxy.errors import ApiError

_FIELDS = {"moe_slots": "moe_slots", "kv_tokens": "kv_tokens", "prefix_device_mb": "prefix_device_bytes",
           "prefix_host_mb": "prefix_host_bytes"}
MAX_SIZE = 1 << 30  # slots, tokens or MiB (1 PiB): anything larger is a typo


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/v1/killick/stats", stats)
    app.router.add_post("/v1/killick/cache", cache)


async def stats(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    return web.json_response({"engine": ctx.core.stats(), "policy": ctx.planner.stats(),
                              "context_length": ctx.context_length, "tokenizer": ctx.tokenizer.cache_stats()},
                             dumps=_dumps)


async def cache(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = await read_json_object(request)
    if not body or set(body) - set(_FIELDS):
        raise ApiError(400, f"body must set one or more of {', '.join(_FIELDS)}")
    kwargs = {}
    for key, value in body.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
            raise ApiError(400, f"{key} must be an integer from 1 to {MAX_SIZE}", param=key)
        kwargs[_FIELDS[key]] = value << 20 if key.endswith("_mb") else value
    runner = getattr(ctx.core, "runner", None)
    if runner is None:
        raise ApiError(400, "this server runs no engine (upstream mode): the caches live in the upstream servers")
    loop = asyncio.get_running_loop()
    try:
        result = await loop.run_in_executor(None, ctx.core.call, lambda: runner.reconfigure(**kwargs))
    except ValueError as exc:
        raise ApiError(400, str(exc))
    if "kv_tokens" in kwargs:
        ctx.context_length = kwargs["kv_tokens"]
    return web.json_response({"ok": True, "engine": result}, dumps=_dumps)


def _dumps(obj) -> str:
    import json

    return json.dumps(obj, default=str)
