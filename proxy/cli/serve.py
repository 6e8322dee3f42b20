"""`killick serve`: the agent APIs on loopback, with the engine in the same process.

    killick serve [--model DIR] [--host 127.0.0.1] [--port 8421] [--api-key KEY] [--max-running 4]
                  [--cache-policy anchors|prefix] [--prompt-layout stable|template] [--record DIR]
                  [--script FILE [--script-var K=V]] [--allow-forced-responses] [--quiet]
                  [--allow-origin ORIGIN] [--allow-host NAME] [--responses-store-mb 512]
    killick serve --upstream URL [--upstream URL ...] [--upstream-model PATTERN=NAME] [--routing session]

Without --model the embedded demo checkpoint is used. One startup line names the URL; then one access-log
line per request (method, path, status, prompt / cached / prefilled tokens, TTFT, time) unless --quiet.
The key can come from KILLICK_API_KEY instead of --api-key (which `ps` shows to every user). Web pages may not
reach the server unless --allow-origin names them (proxy/sites.py).
With --upstream (or --upstream-config FILE) no engine is loaded: OpenAI-compatible servers answer, each session
sticks to one of them (proxy/upstream/, docs/UPSTREAM.md); --model then only names the tokenizer and template.
--record appends every API request with its response and cache metrics to DIR (proxy/replay/record.py);
--script answers from a script by forced decoding (proxy/replay/scripted.py); --allow-forced-responses honours
replay's x-killick-force-response header (off by default: a client must not choose the model's output).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from proxy.cli import KEY_ENV, api_key, check_output

log = logging.getLogger("killick.proxy")
MAX_HEADER = 1 << 20  # x-killick-force-response carries a whole recorded reply
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.build import add_engine_arguments  # torch-free
    from harness_adapters.layout import LAYOUTS
    from proxy.upstream.config import add_upstream_arguments

    parser.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=port_arg, default=8421, help="TCP port (default 8421)")
    parser.add_argument("--api-key", metavar="KEY", help="require this key (Bearer or x-api-key) on every route "
                                                         f"but /health (default: ${KEY_ENV}, which ps does not show)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages from ORIGIN (e.g. https://app.example) call the server; '*' any "
                             "(repeatable; default: loopback pages only)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="accept Host: NAME on a loopback bind (repeatable; default: localhost, 127.0.0.1, "
                             "[::1] only, which stops DNS rebinding)")
    parser.add_argument("--model-name", default=None,
                        help="name in /v1/models and where a harness's prompt names its model (stable layout; "
                             "default: the model directory)")
    parser.add_argument("--harness-rules", metavar="FILE", help="extra harness normalisation rules (JSON/TOML)")
    parser.add_argument("--keepalive", type=float, default=5.0, metavar="S",
                        help="seconds of silence before a keep-alive while queued or prefilling (default 5)")
    parser.add_argument("--cache-policy", choices=["anchors", "prefix"], default="anchors",
                        help="anchors: the harness-aware planner; prefix: only prompt-end/generation-end "
                             "checkpoints (use --no-prefix-cache for no cache at all)")
    parser.add_argument("--prompt-layout", choices=LAYOUTS, default="stable",
                        help="stable: the system lines a harness declares volatile (working directory, date, "
                             "model line) go after the tool definitions, so conversations share the prefix; "
                             "template: the chat template's own order (default stable)")
    parser.add_argument("--record", metavar="DIR", help="append one JSON line per request to DIR/<session>.jsonl")
    parser.add_argument("--script", metavar="FILE", help="answer from this script (JSON/YAML) by forced decoding")
    parser.add_argument("--script-var", action="append", default=[], metavar="K=V",
                        help="a {K} template value for the script's tool arguments (repeatable)")
    parser.add_argument("--allow-forced-responses", action="store_true",
                        help="honour x-killick-force-response (what killick replay sends)")
    parser.add_argument("--quiet", action="store_true", help="no access log (one line per request otherwise)")
    parser.add_argument("--responses-store-mb", type=int, default=512, metavar="MB",
                        help="memory the finished Responses kept for previous_response_id and GET /v1/responses/ID "
                             "may hold (default 512; at most 256 responses either way)")
    add_engine_arguments(parser)
    add_upstream_arguments(parser)


def make_planner(cache_policy: str, registry=None, layout: str = "stable", served_model: str | None = None):
    """anchors: the cache policy (sessions, diff, anchors); prefix and off: the harness normalisation only
    (the engine's own checkpoints), so every mode renders the same prompt (in the given prompt layout).
    `served_model`: the name the stable layout gives the model where a harness names it (None: an upstream
    answers, and which model depends on the agent's alias, so those lines stay as sent)."""
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.policy.planner import HarnessNormalizer, NoAnchors

    harness = HarnessNormalizer(registry, layout, served_model)
    return PolicyPlanner(harness=harness) if cache_policy == "anchors" else NoAnchors(harness)


def load_script(path: str | None, pairs: list[str]):
    if path is None:
        return None
    from proxy.replay.scripted import Script

    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"--script-var takes K=V, got {bad[0]!r}")
    if not os.path.isfile(path):
        raise ValueError(f"--script {path}: no such file (a JSON or YAML script, fixtures/sessions/script.json)")
    return Script.load(path, **dict(p.split("=", 1) for p in pairs))


def reply_source(args: argparse.Namespace):
    """--allow-forced-responses (a replayed answer first) and --script; None: the model samples."""
    from proxy.replay.sources import FirstReply, ForcedResponses, Scripted

    script = load_script(args.script, args.script_var)
    sources = ([ForcedResponses()] if args.allow_forced_responses else []) + ([Scripted(script)] if script else [])
    return FirstReply(*sources) if sources else None


def build_app(args: argparse.Namespace) -> web.Application:
    """Load tokenizer, model and engine (torch imported here only) and wrap them in the app."""
    if args.upstream or args.upstream_config:
        from proxy.upstream.app import build_upstream_app

        return build_upstream_app(args)
    from engine.build import build_core, options_from_args
    from engine.demo import resolve_model
    from proxy.prompt.tokenizer import load_tokenizer
    from harness_adapters import load_registry
    from proxy.app import create_app
    from proxy.prompt.render import ChatRenderer
    from proxy.replay.record import Recorder
    from proxy.sites import Sites

    opts = options_from_args(args)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    model_name = args.model_name or model_dir.name
    # what the flags name (rules, script, recording folder) is read before the model loads: a mistake there is
    # an error in seconds, not after minutes of loading
    planner = make_planner(args.cache_policy, load_registry(args.harness_rules), args.prompt_layout, model_name)
    replies = reply_source(args)
    recorder = Recorder(args.record) if args.record is not None else None
    core = build_core(model_dir, opts)
    return create_app(core, tokenizer, ChatRenderer(tokenizer), model_name=model_name,
                      api_key=api_key(args), keepalive_s=args.keepalive, planner=planner, replies=replies,
                      observer=recorder, access_log=not args.quiet,
                      sites=Sites.for_bind(args.host, args.allow_origin, args.allow_host),
                      responses_store_mb=args.responses_store_mb)


def port_arg(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return port


def check_port(host: str, port: int) -> None:
    """Fail before the model loads (seconds to minutes) when the address is taken or not this machine's."""
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; another server (killick serve?) "
                             "holds it - stop it or pass --port N") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; --host takes an address of "
                         "this machine (127.0.0.1 by default, 0.0.0.0 for every interface)") from None


def run(args: argparse.Namespace) -> int:
    from proxy.sites import is_loopback

    if args.keepalive <= 0:
        raise ValueError(f"--keepalive must be more than 0 seconds, got {args.keepalive}")
    if args.responses_store_mb < 1:
        raise ValueError(f"--responses-store-mb must be at least 1 (MB kept for previous_response_id), got "
                         f"{args.responses_store_mb}; pass e.g. --responses-store-mb 512")
    if args.record is not None:
        check_output(args.record, "--record", directory=True)
    check_port(args.host, args.port)
    if not is_loopback(args.host):
        if api_key(args):
            log.warning("binding %s: the API is reachable from other machines, with the API key", args.host)
        else:
            log.warning("binding %s with no API key: anyone who can reach this machine can use the API; pass "
                        "--api-key KEY (or set $%s)", args.host, KEY_ENV)
    steady_malloc()
    app = build_app(args)
    try:
        stopped_by = asyncio.run(_serve(app, args.host, args.port))
    finally:
        from proxy.app import stop_engine

        stop_engine(app)  # where asyncio.run ended before the app's cleanup stopped it
    return 130 if stopped_by == signal.SIGINT else 0


MALLOC_ARENAS = 4  # measured on the 16-core GPU box (2026-12-02): see steady_malloc


def steady_malloc() -> bool:
    """glibc: four malloc arenas and a fixed 128 KiB mmap threshold, as MALLOC_ARENA_MAX=4 and
    MALLOC_MMAP_THRESHOLD_=131072 would set: the prompt-sized buffers the render threads and the engine free
    go back to the system instead of fragmenting an arena per thread (a 20-minute soak: RSS crept +84 MB after
    every cache was full without, stayed within 30 MB with). The count is a trade measured on the GPU box
    against `bench model`: two arenas made the tokenizer's 16 encode threads queue (an 8k-token render 35-42
    ms instead of 5), one a core (18) cost the engine thread itself (TTFT 136-140 ms instead of 120-123,
    decode 925 instead of 980 tok/s); four render in 14-18 ms. Whether it was applied; not where the user set
    either variable, nor off glibc. Where applied, the tokenizer encodes on as many threads as there are
    arenas (RAYON_NUM_THREADS, unless set): four threads with four arenas rendered that prompt in 8.3 ms, its
    default sixteen in 16.7 (bare process on the GPU box)."""
    if {"MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    if not (mallopt(M_ARENA_MAX, MALLOC_ARENAS) and mallopt(M_MMAP_THRESHOLD, 128 * 1024)):
        return False
    os.environ.setdefault("RAYON_NUM_THREADS", str(MALLOC_ARENAS))  # before the tokenizer's pool starts
    return True


SHUTDOWN_S = 60.0  # what a stopping server gives the answers in flight (aiohttp's default)


def serving_url(host: str, port: int) -> str:
    """The URL agents and `killick launch --server` reach the bind at (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (kill, systemd, docker stop), handled on the event loop: the first sets `event`,
    and the server stops with its answers in flight given SHUTDOWN_S to finish; the second ends the process at
    once (os._exit). A KeyboardInterrupt raised wherever the main thread was could be lost in a task being
    cancelled, leaving the second Ctrl-C to wait out the answers too, and Python's own exit waits for the engine
    thread's step (it aborts if the thread is still inside one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.event, self.first = asyncio.Event(), None
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on, sig)
            except (NotImplementedError, RuntimeError):  # no signal handlers on this loop (Windows)
                pass

    def _on(self, sig: int) -> None:
        if self.event.is_set():
            print("killick: stopped at once", flush=True)
            sys.stderr.flush()
            os._exit(128 + sig)
        self.first = sig
        self.event.set()


async def _serve(app: web.Application, host: str, port: int) -> int | None:
    """Serves until Ctrl-C or SIGTERM -> the signal that stopped it."""
    signals = StopSignals(asyncio.get_running_loop())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, max_field_size=MAX_HEADER,
                           shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, shutdown_timeout=SHUTDOWN_S)
        await site.start()
        print(f"killick: serving on {serving_url(host, port)}  (Anthropic /v1/messages, OpenAI /v1/chat/completions "
              "and /v1/responses)", flush=True)
        try:
            await signals.event.wait()
        finally:
            print(f"killick: stopping; answers still streaming get up to {SHUTDOWN_S:.0f} s to finish (Ctrl-C again "
                  "to stop now)", flush=True)
    finally:
        await runner.cleanup()
    return signals.first

