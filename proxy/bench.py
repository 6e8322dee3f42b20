"""Where the server's time goes between a request's arrival and the engine submit, without a model.

    python -m proxy.bench [--prompt-words 1850] [--sessions 5] [--turns 4] [--json OUT]

Each session is a first request (a system prompt, one tool and a user message of --prompt-words words, the text
`python -m engine.bench.serve` sends) and --turns - 1 later ones that re-send the whole history with the reply
and a short user message, through the Anthropic Messages API, streamed. The stack is serve's (shipped tokenizer
and chat template, the anchors cache policy, the stable layout); the engine is a stand-in that notes when a
request is submitted and answers at once with a short reply. Printed per kind of turn (first, later), medians:

- each stage of prepare() run in-process in its order, on a second identical stack fed the same requests:
  parse (JSON), validate (pydantic, Conversation), normalise, size check, render (template and segments),
  encode (the tokenizer's part of render), plan (sessions, diff, anchors), request (GenerateRequest);
- over HTTP on loopback: arrival (the access middleware) to submit, and submit to the first content event in
  the server (detokenizer, output parser) and at the client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict

from aiohttp import ClientSession, web

from engine.api import GenerateRequest, TokenEvent, Usage
from engine.bench.args import print_and_save
from engine.bench.serve import prompt_text
from proxy.apis.anthropic.schema import MessagesRequest, check_supported, gen_params, to_conversation
from proxy.body import check_json
from proxy.preparing import _texts
from proxy.sse import read_lines

SYSTEM = "You are a coding agent. Read files before you edit them and run the tests after."
TOOLS = [{"name": "bash", "description": "Run a shell command", "input_schema": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
REPLY = "I will read the file first.</think>\n\nThe bug is in add(): it subtracts. Let me fix it."
STAGES = ("parse", "validate", "normalise", "size check", "render", "encode", "plan", "request")
HTTP = ("arrival to submit", "submit to first event (server)", "client TTFT")


class StandInCore:
    """The engine seam (stream, stats): notes the submit time, answers each request with REPLY's ids."""

    def __init__(self, reply_ids: list[int]):
        self.reply_ids, self.submitted = reply_ids, 0.0

    def stream(self, req: GenerateRequest) -> "_Reply":
        self.submitted = time.monotonic()
        return _Reply(req, self.reply_ids)

    def stats(self) -> dict:
        return {}


class _Reply:
    def __init__(self, req: GenerateRequest, ids: list[int]):
        n = len(req.prompt_ids)
        self.events = [TokenEvent(req.request_id, (t,)) for t in ids]
        self.events.append(TokenEvent(req.request_id, finish_reason="stop", usage=Usage(n, len(ids), 0, n)))

    def __aiter__(self) -> "_Reply":
        return self

    async def __anext__(self) -> TokenEvent:
        if not self.events:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.events.pop(0)

    def abort(self) -> None:
        self.events = self.events[-1:]

    async def aclose(self) -> None:
        self.abort()


class Observer:
    """Keeps each finished request's Turn (the app's one observing hook)."""

    def __init__(self):
        self.turns = []

    async def turn_done(self, request, turn, status, started) -> None:
        self.turns.append(turn)


def serve_stack(context_length: int):
    """The pieces `killick serve` builds (tokenizer, renderer, planner), each with its own caches."""
    from harness_adapters import load_registry
    from proxy.cli.serve import make_planner
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    return tok, ChatRenderer(tok), make_planner("anchors", load_registry(None), "stable", "killick")


def staged(stack, raw: bytes, times: dict, context_length: int) -> None:
    """prepare()'s stages for one request body, each timed into times[stage]."""
    tok, renderer, planner = stack
    encode, spent = tok.encode_with_starts, []

    def timed_encode(*args):
        t = time.perf_counter()
        out = encode(*args)
        spent.append(time.perf_counter() - t)
        return out

    tok.encode_with_starts = timed_encode
    try:
        t0 = time.perf_counter()
        body = json.loads(raw)
        check_json(body)
        t1 = time.perf_counter()
        req = MessagesRequest.model_validate(body)
        check_supported(req)
        conv = to_conversation(req)
        t2 = time.perf_counter()
        conv = planner.normalize(conv, {}, body)
        t3 = time.perf_counter()
        tok.tokens_at_least(_texts(conv), context_length)
        t4 = time.perf_counter()
        rendered = renderer.render(conv, add_generation_prompt=True)
        t5 = time.perf_counter()
        plan = planner(conv, rendered, {}, body)
        t6 = time.perf_counter()
        GenerateRequest(list(rendered.ids), 256, gen_params(req).sampling, frozenset(tok.eos_ids),
                        tuple(plan.checkpoint_positions), plan.session_key)
        t7 = time.perf_counter()
    finally:
        del tok.encode_with_starts
    planner.finish(planner.admit(plan), tok.encode(REPLY), Usage(len(rendered.ids), 1, 0, len(rendered.ids)))
    encoded = sum(spent)
    for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4 - encoded, encoded, t6 - t5,
                                       t7 - t6)):
        times[stage].append(seconds)


async def stream_once(session: ClientSession, url: str, body: dict) -> tuple[float, str, str]:
    """(seconds to the first content delta, thinking, text) of one streamed Messages request."""
    t0, first, parts = time.monotonic(), None, {"thinking_delta": "", "text_delta": ""}
    async with session.post(url + "/v1/messages", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in read_lines(r):
            if not line.startswith("data: "):
                continue
            delta = json.loads(line[6:]).get("delta") or {}
            kind = delta.get("type")
            if kind in parts:
                first = first or time.monotonic()
                parts[kind] += delta.get("thinking") or delta.get("text") or ""
    if first is None:
        raise RuntimeError("the stream carried no content")
    return first - t0, parts["thinking_delta"], parts["text_delta"]


def request_body(messages: list[dict], session: int) -> dict:
    return {"model": "killick", "max_tokens": 256, "stream": True, "system": SYSTEM, "tools": TOOLS,
            "messages": messages, "metadata": {"user_id": f"user_bench_session_{session:08d}-bench"}}


async def run(args) -> dict:
    context_length = 262144
    http_stack, stage_stack = serve_stack(context_length), serve_stack(context_length)
    tok = http_stack[0]
    core, observer = StandInCore(tok.encode(REPLY)), Observer()
    from proxy.app import create_app

    app = create_app(core, tok, http_stack[1], context_length=context_length, planner=http_stack[2],
                     observer=observer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    times = {kind: defaultdict(list) for kind in ("first", "later")}
    try:
        async with ClientSession() as session:
            for s in range(args.sessions + 1):  # session 0 warms up (imports, template compile, pools)
                messages = [{"role": "user", "content": prompt_text(args.prompt_words, args.seed * 1000 + s)}]
                for turn in range(args.turns):
                    body = request_body(messages, s)
                    staged(stage_stack, json.dumps(body).encode(), t := times["first" if turn == 0 else "later"],
                           context_length)
                    ttft, thinking, text = await stream_once(session, url, body)
                    seen = observer.turns[-1]
                    submit = core.submitted - seen.arrived
                    if s:
                        t["arrival to submit"].append(submit)
                        t["submit to first event (server)"].append(seen.first_output_s - submit)
                        t["client TTFT"].append(ttft)
                    else:
                        t.clear()
                    messages += [{"role": "assistant", "content": [
                        {"type": "thinking", "thinking": thinking, "signature": "s"}, {"type": "text", "text": text}]},
                        {"role": "user", "content": prompt_text(60, args.seed * 1000 + 500 + s * 50 + turn)}]
    finally:
        await runner.cleanup()
    return {"what": "arrival to engine submit, stand-in engine (python -m proxy.bench)",
            "prompt_words": args.prompt_words, "sessions": args.sessions, "turns": args.turns,
            "median_ms": {kind: {k: statistics.median(v) * 1e3 for k, v in t.items()} for kind, t in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-words", type=int, default=1850,
                   help="words of a session's first message (1850: ~8.2k tokens)")
    p.add_argument("--sessions", type=int, default=5)
    p.add_argument("--turns", type=int, default=4, help="requests per session, the first included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.turns < 1:
        p.error("--sessions and --turns must be >= 1")
    return print_and_save(asyncio.run(run(args)), print_table, args.json)


def print_table(res: dict) -> None:
    med = res["median_ms"]
    print(f"{'stage (median ms)':<32} {'first':>8} {'later':>8}")
    for k in (*STAGES, *HTTP):
        print(f"{k:<32} {med['first'].get(k, float('nan')):>8.2f} {med['later'].get(k, float('nan')):>8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
