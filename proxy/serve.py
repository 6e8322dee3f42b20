"""`killick serve`: the agent APIs on loopback, with the engine in the same process.

    killick serve [--model DIR] [--host 127.0.0.1] [--port 8421] [--api-key KEY] [--max-running 4]

Without --model the embedded demo checkpoint is used. One startup line names the URL.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

log = logging.getLogger("killick.proxy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.build import add_engine_arguments  # torch-free

    parser.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8421)
    parser.add_argument("--api-key", metavar="KEY", help="require this key (Bearer or x-api-key) on every route "
                                                         "but /health")
    parser.add_argument("--model-name", default=None, help="name in /v1/models (default: the model directory)")
    parser.add_argument("--keepalive", type=float, default=5.0, metavar="S",
                        help="seconds of silence before a keep-alive while queued or prefilling (default 5)")
    add_engine_arguments(parser)


def build_app(args: argparse.Namespace) -> web.Application:
    """Load tokenizer, model and engine (torch imported here only) and wrap them in the app."""
    from engine.build import build_core, options_from_args
    from engine.demo import resolve_model
    from engine.tokenizer import load_tokenizer
    from proxy.app import create_app
    from proxy.render import ChatRenderer

    opts = options_from_args(args)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    core = build_core(model_dir, opts)
    return create_app(core, tokenizer, ChatRenderer(tokenizer), model_name=args.model_name or model_dir.name,
                      api_key=args.api_key, keepalive_s=args.keepalive)


def run(args: argparse.Namespace) -> int:
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the API is reachable from other machines", args.host)
    app = build_app(args)
    asyncio.run(_serve(app, args.host, args.port))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        print(f"killick: serving on http://{host}:{port}  (Anthropic /v1/messages, OpenAI /v1/chat/completions "
              "and /v1/responses)", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


# the names the brief used
add_serve_arguments, run_serve = add_arguments, run
