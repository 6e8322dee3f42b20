"""Time to first token and decode rate of streamed requests through a running `killick serve`.

    python -m engine.bench.serve --url http://127.0.0.1:8421 [--prompt-words 6000] [--max-tokens 256]
                                 [--runs 3] [--json out.json]

Sends OpenAI chat-completion requests with `stream: true` (one warm-up, then --runs timed ones, each with a
fresh prompt so nothing is reused from the prefix cache; a second run against the same server takes another
--seed), and reports per run: prompt tokens (the
server's usage); TTFT as the client sees it (the first chunk carrying text); the engine's own TTFT and
decode rate for that request (the change of `killick_ttft_seconds_sum` and
`killick_decode_tokens_per_second_sum` in /metrics); the server's own time from arrival to submit and to
the engine's first token in the proxy and the first output event (`killick_prepare_seconds_sum`,
`killick_first_token_seconds_sum`, `killick_first_output_seconds_sum`); and prefill tok/s. The client-side decode
rate is not reported: the output parser holds back text that may open a tool call or a thinking block, so chunk
arrival times undercount the decode span. Compare with `bench model`'s rows: the same engine without
HTTP. Talks to loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from engine.bench.args import print_and_save

WORDS = ("the engine streams layer weights while the agent edits files and runs tests against a small "
         "repository with many modules each holding functions classes and comments about caching").split()


def prompt_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))


def _has_output(delta: dict) -> bool:
    """A chunk that carries generated text (the first chunk's bare role does not)."""
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def one(session, url: str, text: str, max_tokens: int, temperature: float = 0.0) -> dict:
    body = {"model": "killick", "stream": True, "max_tokens": max_tokens, "temperature": temperature,
            "messages": [{"role": "user", "content": text}], "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, usage = [], None
    async with session.post(url.rstrip("/") + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if any(_has_output(c.get("delta") or {}) for c in ev.get("choices", [])):
                chunks.append(time.perf_counter())
    if usage is None or not chunks:
        raise RuntimeError("the stream carried no usage or no content")
    ttft = chunks[0] - t0
    return {"prompt_tokens": usage["prompt_tokens"], "ttft_s": ttft, "prefill_tok_s": usage["prompt_tokens"] / ttft,
            "output_tokens": usage["completion_tokens"]}


SUMS = ("killick_ttft_seconds_sum", "killick_decode_tokens_per_second_sum", "killick_prepare_seconds_sum",
        "killick_first_token_seconds_sum", "killick_first_output_seconds_sum", "killick_engine_decode_steps",
        "killick_engine_decode_step_seconds", "killick_engine_decode_runner_seconds")


async def engine_sums(session, url: str) -> dict[str, float]:
    """The server's running sums of per-request times and decode rate, from /metrics (SUMS)."""
    async with session.get(url.rstrip("/") + "/metrics") as r:
        text = await r.text()
    sums = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SUMS:
            sums[name] = float(value)
    return sums


async def measured(session, url: str, text: str, max_tokens: int, temperature: float = 0.0) -> dict:
    before = await engine_sums(session, url)
    run = await one(session, url, text, max_tokens, temperature)
    after = await engine_sums(session, url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    run["engine_ttft_s"] = delta.get("killick_ttft_seconds_sum", float("nan"))
    run["engine_decode_tok_s"] = delta.get("killick_decode_tokens_per_second_sum", float("nan"))
    run["server_prepare_s"] = delta.get("killick_prepare_seconds_sum", float("nan"))
    run["server_first_token_s"] = delta.get("killick_first_token_seconds_sum", float("nan"))
    run["server_first_output_s"] = delta.get("killick_first_output_seconds_sum", float("nan"))
    run.update(decode_split(delta.get("killick_engine_decode_steps", 0.0),
                            delta.get("killick_engine_decode_step_seconds", float("nan")),
                            delta.get("killick_engine_decode_runner_seconds", float("nan"))))
    return run


def decode_split(steps: float, step_s: float, runner_s: float) -> dict:
    """Per back-to-back decode step: its period and the runner's part (forward, sampling, device wait), in ms;
    what bench model prints beside its decode rows, to tell serve's extra time from the engine's."""
    if not steps:
        return {"decode_step_ms": float("nan"), "decode_runner_ms": float("nan")}
    return {"decode_step_ms": step_s / steps * 1e3, "decode_runner_ms": runner_s / steps * 1e3}


async def run(args) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        seed = args.seed * 1000  # prompts of another --seed share no prefix with these
        warm = prompt_text(args.prompt_words, seed)
        await one(session, args.url, warm, args.max_tokens, args.temperature)  # compiles, captures
        runs = [await measured(session, args.url, prompt_text(args.prompt_words, seed + i + 1), args.max_tokens,
                               args.temperature)
                for i in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"what": "killick serve over HTTP (OpenAI chat, streamed)", "url": args.url,
            "temperature": args.temperature, "runs": runs, "median": med}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8421")
    p.add_argument("--prompt-words", type=int, default=6000, help="words of each prompt (default 6000)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the requests (default 0: greedy; an agent that sends none gets 1)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0, help="prompt set: runs against the same server with different "
                   "seeds send prompts none of which it has seen (default 0)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error("--url must be a loopback address")
    return print_and_save(asyncio.run(run(args)), print_summary, args.json)


def print_summary(res: dict) -> None:
    m = res["median"]
    print(f"serve (median of {len(res['runs'])}): {m['prompt_tokens']:.0f} prompt tokens, TTFT "
          f"{m['ttft_s'] * 1e3:.1f} ms at the client ({m['prefill_tok_s']:.0f} tok/s), "
          f"{m['engine_ttft_s'] * 1e3:.1f} ms in the engine; "
          f"{m['output_tokens']:.0f} output tokens at {m['engine_decode_tok_s']:.1f} tok/s (engine)")
    print(f"  the server's part: {m['server_prepare_s'] * 1e3:.1f} ms from arrival to submit (read, render, "
          f"tokenize, plan), the engine's first token in the proxy {m['server_first_token_s'] * 1e3:.1f} ms and "
          f"the first output event {m['server_first_output_s'] * 1e3:.1f} ms after arrival (the detokenizer "
          f"and output parser hold back half characters and text that may open a tool call; the access log's "
          f"held= counts the tokens that had come by then)")
    print(f"  a decode step {m['decode_step_ms']:.3f} ms end to end, {m['decode_runner_ms']:.3f} ms of it in the "
          f"runner (forward, sampling, device wait); the rest on the engine thread (scheduling, publishing)")


if __name__ == "__main__":
    raise SystemExit(main())
