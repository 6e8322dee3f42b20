"""The proxy in front of OpenAI-compatible servers: the same app (create_app), its core an UpstreamPool.

    app = create_upstream_app(config, tokenizer, renderer, model_name=..., context_length=..., planner=...)
    app = build_upstream_app(args)        # `killick serve --upstream URL ...` (proxy/cli/serve.py)

Nothing of the engine is loaded (no torch): the tokenizer and chat template still render each request, because
the cache policy (sessions, the edit point of each turn) reads the rendered prompt. `--model DIR` names where
they come from (default: the shipped ones; give the upstream model's own for exact token counts).
"""
from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Optional

from aiohttp import web

from proxy.app import TurnObserver, create_app
from proxy.policy.planner import Planner
from proxy.upstream.config import UpstreamConfig, config_from_args, refused_key
from proxy.upstream.pool import Unknown, UpstreamPool, model_entry

log = logging.getLogger("killick.upstream")
DEFAULT_CONTEXT = 32768  # when neither --context-length nor any upstream says


def create_upstream_app(config: UpstreamConfig, tokenizer, renderer, *, model_name: str, context_length: int,
                        api_key: Optional[str] = None, keepalive_s: float = 5.0, planner: Optional[Planner] = None,
                        observer: Optional[TurnObserver] = None, unknown: Unknown = Unknown(),
                        **app_options) -> web.Application:
    """app_options: create_app's other keywords (access_log, sites, responses_store_mb). unknown: what no
    replica said at start, taken from the first one up."""
    pool = UpstreamPool(config, unknown)
    app = create_app(pool, tokenizer, renderer, model_name=model_name, context_length=context_length,
                     api_key=api_key, keepalive_s=keepalive_s, planner=planner, observer=observer, **app_options)
    app.cleanup_ctx.insert(0, pool.lifetime)  # cleaned up last: background responses end before the client closes
    return app


def build_upstream_app(args: argparse.Namespace) -> web.Application:
    from harness_adapters import load_registry
    from proxy.cli.serve import api_key, make_planner
    from proxy.sites import Sites
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.record import Recorder

    if args.script:
        raise ValueError("--script answers by forced decoding on the local engine; it does not go with --upstream")
    config = config_from_args(args)
    model, context = discover(config)
    config = replace(config, default_model=model) if model else config
    context_length = args.context_length or context or DEFAULT_CONTEXT
    if not (args.context_length or context):
        log.warning("no upstream told its context length; assuming %d tokens (set --context-length)", DEFAULT_CONTEXT)
    tokenizer = load_tokenizer(args.model)
    log.info("upstream mode: %d replica(s), routing %s, model %s, context %d", len(config.urls), config.routing,
             model or "as the agent names it", context_length)
    return create_upstream_app(config, tokenizer, ChatRenderer(tokenizer),
                               model_name=args.model_name or model or "killick-upstream",
                               context_length=context_length, api_key=api_key(args), keepalive_s=args.keepalive,
                               planner=make_planner(args.cache_policy, load_registry(args.harness_rules),
                                                    args.prompt_layout),
                               observer=Recorder(args.record) if args.record is not None else None,
                               access_log=not args.quiet,
                               sites=Sites.for_bind(args.host, args.allow_origin, args.allow_host),
                               responses_store_mb=args.responses_store_mb,
                               unknown=Unknown(model=config.default_model is None and model is None,
                                               name=not (args.model_name or model),
                                               context=not (args.context_length or context)))


def discover(config: UpstreamConfig, timeout_s: float = 3.0) -> tuple[Optional[str], Optional[int]]:
    """(model id, context length) from the first replica that answers GET /v1/models (killick: context_length,
    vLLM: max_model_len) or, for llama.cpp, GET /props (n_ctx). Replicas not up yet are no error."""
    for url in config.urls:
        models = _get_json(url, "/v1/models", config, timeout_s)
        if not models:
            continue
        model, context = model_entry(models)
        if not context:
            props = _get_json(url, "/props", config, timeout_s) or {}
            context = (props.get("default_generation_settings") or {}).get("n_ctx")
        return model, int(context) if context else None
    log.warning("no upstream answered GET /v1/models at start: the first replica up is asked (until then requests "
                "carry the model the agent names; --upstream-model NAME sets one)")
    return None, None


def _get_json(url: str, path: str, config: UpstreamConfig, timeout_s: float) -> Optional[dict]:
    auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    req = urllib.request.Request(url + path, headers=auth)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
            return body if isinstance(body, dict) else None
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (401, 403):
            log.warning("%s", refused_key(url, exc.code))
        return None
    except (urllib.error.URLError, OSError, ValueError):
        return None
