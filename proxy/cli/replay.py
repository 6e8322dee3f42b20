"""`killick replay`: send recorded agent requests again and measure TTFT, cache hits and prefill per turn.

    killick replay FILE.jsonl [MORE ...|DIR] [--url URL | --model DIR] [--mode off|prefix|anchors|all]
                   [--json OUT] [--plot OUT.png] [--limit N] [--turns N] [--concurrent] [--unforced]
                   [--prompt-layout stable|template]

Requests go out in recorded order (sessions interleaved as recorded), one at a time; with --concurrent each
session's requests go out in order and all sessions run side by side from the same moment. A request with a
recorded response carries it in `x-killick-force-response`, so the engine decodes exactly that answer
(forced decoding: every step still runs on the model) and the next recorded prompt extends what the server
generated. The header is honoured only by servers started by replay itself or by
`killick serve --allow-forced-responses`; a request without a recorded response (or every request, with
--unforced) is generated, capped at --unforced-max-tokens.

With --url the server is used as it runs (one column, "url"). Without it, each --mode gets a fresh in-process
engine on --model (default: the demo model): off = no prefix cache; prefix = prefix cache with only the
engine's prompt-end / generation-end checkpoints; anchors = the full cache policy. --mode all runs all three.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path

from proxy.cli import KEY_ENV, URL_FORMS, api_key, check_output, server_url

MODES = ("off", "prefix", "anchors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.build import add_engine_arguments  # torch-free
    from harness_adapters.layout import LAYOUTS

    parser.add_argument("recordings", nargs="+", metavar="FILE", help="JSON lines (.jsonl, .jsonl.gz) or dirs")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"replay against this running server instead of an in-process engine "
                                     f"({URL_FORMS})")
    parser.add_argument("--api-key", help=f"with --url: the server's --api-key (default: ${KEY_ENV})")
    where.add_argument("--model", metavar="DIR", help="checkpoint for the in-process engine (default: demo model)")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="anchors",
                        help="off: no prefix cache; prefix: prompt-end checkpoints only; anchors: the cache "
                             "policy's anchors (default); all: the three. In-process only: --url replays against "
                             "the server as it runs")
    parser.add_argument("--json", metavar="OUT", help="write every measurement and the summary here")
    parser.add_argument("--plot", metavar="OUT.png", help="draw TTFT per turn for each mode (needs matplotlib)")
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    parser.add_argument("--turns", type=int, metavar="N", help="replay only the first N requests of each session")
    parser.add_argument("--unforced-max-tokens", type=int, default=32, metavar="N",
                        help="max tokens for requests without a recorded response (default 32)")
    parser.add_argument("--stream", action="store_true",
                        help="send non-streaming requests as streams (same prompt and answer) so TTFT is the "
                             "first delta, not the total time")
    parser.add_argument("--unforced", action="store_true",
                        help="send no recorded answers: the server generates every one (capped at "
                             "--unforced-max-tokens), for servers that cannot force them (llama.cpp, vLLM)")
    parser.add_argument("--concurrent", action="store_true",
                        help="run the recorded sessions side by side, all starting at once (each one's requests "
                             "in order), like agents started together; default: every request in recorded order")
    parser.add_argument("--prompt-layout", choices=LAYOUTS, default="stable",
                        help="the in-process server's prompt layout (killick serve --prompt-layout)")
    parser.add_argument("--quiet", action="store_true", help="only the summary and the TTFT table")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from proxy.replay import log as replay_log
    from proxy.replay import report as replay_report

    for value, flag in ((args.turns, "--turns"), (args.limit, "--limit")):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    for path, flag in ((args.json, "--json"), (args.plot, "--plot")):
        if path:
            check_output(path, flag)
    if args.plot:
        replay_report.check_plot()
    url = server_url(args.url, "--url") if args.url else None
    entries = replay_log.load(args.recordings)
    if args.turns is not None:
        entries = replay_log.first_turns(entries, args.turns)
    if args.limit is not None:
        entries = entries[:args.limit]
    if args.unforced:
        entries = [dataclasses.replace(e, response=None) for e in entries]
    if not entries:
        raise replay_log.no_requests("the recordings hold")
    if url:
        by_mode = {"url": asyncio.run(_client(url, entries, args.unforced_max_tokens, args.stream,
                                              args.concurrent, api_key(args)))}
    else:
        from engine.build import options_from_args

        modes = list(MODES) if args.mode == "all" else [args.mode]
        by_mode = run_modes(entries, args.model, modes, options_from_args(args), args.unforced_max_tokens,
                            args.stream, args.concurrent, args.prompt_layout)
    report(by_mode, quiet=args.quiet)
    meta = {"recordings": [str(p) for p in args.recordings], "url": url, "model": args.model,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.json:
        replay_report.write_json(args.json, by_mode, meta)
    if args.plot:
        replay_report.plot(args.plot, by_mode)
        print(f"plot: {args.plot}")
    return 0 if all(r.status == 200 for rs in by_mode.values() for r in rs) else 1


def report(by_mode: dict, quiet: bool = False) -> None:
    from proxy.replay import report as replay_report

    if not quiet:
        for mode, results in by_mode.items():
            print(replay_report.session_tables(mode, results), end="\n\n")
    print(replay_report.ttft_table(by_mode), end="\n\n")
    print(replay_report.summary_text(by_mode))


async def _client(url: str, entries, unforced_max_tokens: int, stream: bool, concurrent: bool = False,
                  api_key: str | None = None):
    from proxy.replay.client import replay

    return await replay(url, entries, unforced_max_tokens, stream=stream, concurrent=concurrent, api_key=api_key)


def context_needed(entries, margin: int = 4096) -> int:
    """A KV budget that holds the longest recorded prompt (by its recorded metrics, else by bytes)."""
    longest = 0
    for e in entries:
        longest = max(longest, int(e.metrics.get("prompt_tokens") or 0) + int(e.metrics.get("output_tokens") or 0))
    return max(32768, longest + margin)


def run_modes(entries, model: str | None, modes: list[str], opts=None, unforced_max_tokens: int = 32,
              stream: bool = False, concurrent: bool = False, layout: str = "stable") -> dict:
    """Each mode on a fresh engine (fresh cache, fresh policy); the weights are loaded once."""
    from dataclasses import replace

    from engine.build import EngineOptions
    from engine.demo import resolve_model
    from engine.models import load_model

    opts = opts or EngineOptions()
    if opts.context_length is None:
        opts = replace(opts, context_length=context_needed(entries))
    model_dir = resolve_model(model)
    weights = load_model(model_dir, device=opts.device, dtype=opts.dtype)
    warm_up(model_dir, weights, opts)
    out = {}
    for mode in modes:
        out[mode] = asyncio.run(replay_in_process(entries, model_dir, weights, mode, opts, unforced_max_tokens,
                                                  stream, concurrent, layout))
    return out


WARM_UP_TOKENS = 1024


def warm_up(model_dir: Path, weights, opts) -> None:
    """One short request on a throw-away engine without a prefix cache, before any mode is timed: the first
    forward pays one-time costs (allocator, thread pools, kernel choice) that would otherwise land in the
    first mode's first TTFT and make it look slower than the modes after it."""
    import threading
    from dataclasses import replace

    from engine.api import GenerateRequest
    from engine.build import build_core

    vocab = weights.config.vocab_size
    done = threading.Event()
    with build_core(model_dir, replace(opts, prefix_cache=False), model=weights) as core:
        prompt = [3 + i % (vocab - 3) for i in range(WARM_UP_TOKENS)]
        core.submit(GenerateRequest(prompt, max_new_tokens=2), lambda ev: ev.final and done.set())
        if not done.wait(600):
            raise RuntimeError("the warm-up request did not finish in 10 minutes")


def build_mode_app(model_dir: Path, weights, mode: str, opts, layout: str = "stable"):
    from dataclasses import replace

    from engine.build import build_core
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.app import create_app
    from proxy.prompt.render import ChatRenderer
    from proxy.cli.serve import make_planner
    from proxy.replay.sources import ForcedResponses

    if mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)} or all, got {mode!r}")
    core = build_core(model_dir, replace(opts, prefix_cache=mode != "off"), model=weights)
    tok = load_tokenizer(model_dir)
    return create_app(core, tok, ChatRenderer(tok), model_name=model_dir.name, keepalive_s=30.0,
                      planner=make_planner(mode, layout=layout, served_model=model_dir.name), replies=ForcedResponses())


async def replay_in_process(entries, model_dir: Path, weights, mode: str, opts, unforced_max_tokens: int = 32,
                            stream: bool = False, concurrent: bool = False, layout: str = "stable"):
    return await replay_app(build_mode_app(model_dir, weights, mode, opts, layout), entries, unforced_max_tokens,
                            stream, concurrent)


async def replay_app(app, entries, unforced_max_tokens: int = 32, stream: bool = False, concurrent: bool = False):
    """Serve `app` on a free loopback port for as long as the entries take to replay against it."""
    from aiohttp import web

    from proxy.replay.client import replay
    from proxy.cli.serve import MAX_HEADER

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, max_field_size=MAX_HEADER)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return await replay(f"http://127.0.0.1:{port}", entries, unforced_max_tokens, stream=stream,
                            concurrent=concurrent)
    finally:
        await runner.cleanup()


def pick_modes(text: str, known) -> list[str]:
    """A comma list of modes, each one of `known`."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in known for m in modes):
        raise ValueError(f"--modes takes a comma-separated list of {', '.join(known)}; got {text!r}")
    return modes
