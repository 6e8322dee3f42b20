"""Time to first token and decode rate of streamed requests through a running `killick serve`.

    python -m engine.bench.serve --url http://127.0.0.1:8421 [--prompt-words 6000] [--max-tokens 256]
                                 [--runs 3] [--json out.json]

Sends OpenAI chat-completion requests with `stream: true` (one warm-up, then --runs timed ones, each with a
fresh prompt so nothing is reused from the prefix cache), and reports per run: prompt tokens (the
server's usage), TTFT, prefill tok/s (prompt tokens / TTFT), output tokens and decode tok/s between the
first and the last streamed chunk. Compare with `bench model`'s rows: the same engine without HTTP.
Talks to loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

WORDS = ("the engine streams layer weights while the agent edits files and runs tests against a small "
         "repository with many modules each holding functions classes and comments about caching").split()


def prompt_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))


def _has_output(delta: dict) -> bool:
    """A chunk that carries generated text (the first chunk's bare role does not)."""
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def one(session, url: str, text: str, max_tokens: int) -> dict:
    body = {"model": "killick", "stream": True, "max_tokens": max_tokens, "temperature": 0,
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
    n_out = usage["completion_tokens"]
    ttft = chunks[0] - t0
    decode = (n_out - 1) / (chunks[-1] - chunks[0]) if n_out > 1 and chunks[-1] > chunks[0] else float("nan")
    return {"prompt_tokens": usage["prompt_tokens"], "ttft_s": ttft, "prefill_tok_s": usage["prompt_tokens"] / ttft,
            "output_tokens": n_out, "decode_tok_s": decode}


async def run(args) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, args.url, prompt_text(args.prompt_words, 0), args.max_tokens)  # warm-up
        runs = [await one(session, args.url, prompt_text(args.prompt_words, i + 1), args.max_tokens)
                for i in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"what": "killick serve over HTTP (OpenAI chat, streamed)", "url": args.url, "runs": runs, "median": med}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8421")
    p.add_argument("--prompt-words", type=int, default=6000, help="words of each prompt (default 6000)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error("--url must be a loopback address")
    res = asyncio.run(run(args))
    m = res["median"]
    print(f"serve (median of {args.runs}): {m['prompt_tokens']:.0f} prompt tokens, TTFT {m['ttft_s'] * 1e3:.1f} ms "
          f"({m['prefill_tok_s']:.0f} tok/s), {m['output_tokens']:.0f} output tokens at {m['decode_tok_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
