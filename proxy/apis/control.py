"""Control endpoints behind `killick ctl`: engine + cache + policy stats, and cache resizing at runtime.

    GET  /v1/killick/stats                      -> engine, prefix cache, expert cache and per-turn figures
    POST /v1/killick/cache {"moe_slots": N, "kv_tokens": T, "prefix_device_mb": D, "prefix_host_mb": H}

Resizing runs on the engine thread between two steps (EngineCore.call), so no request sees a half-resized
cache; impossible sizes are refused before anything is freed (400 with the reason).
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.context import CTX
from proxy.errors import ApiError

_FIELDS = {"moe_slots": "moe_slots", "kv_tokens": "kv_tokens", "prefix_device_mb": "prefix_device_bytes",
           "prefix_host_mb": "prefix_host_bytes"}


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/v1/killick/stats", stats)
    app.router.add_post("/v1/killick/cache", cache)


async def stats(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    return web.json_response({"engine": ctx.core.stats(), "policy": ctx.planner.stats(),
                              "context_length": ctx.context_length}, dumps=_dumps)


async def cache(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "body must be a JSON object such as {\"moe_slots\": 512}")
    if not isinstance(body, dict) or not body or set(body) - set(_FIELDS):
        raise ApiError(400, f"body must set one or more of {', '.join(_FIELDS)}")
    kwargs = {}
    for key, value in body.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{key} must be a positive integer", param=key)
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
