"""Small stand-ins for protocol unit tests ONLY (keep-alive timing, error shapes, parser wiring).

The acceptance tests (test_e2e_*.py) run the real tokenizer, renderer and engine on a synthetic checkpoint.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.api import GenerateRequest, TokenEvent, Usage
from engine.serving import TokenStream
from proxy.conversation import ThinkingPart, ToolCallPart

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]


class CharTokenizer:
    """One id per character; the chat-format markers are single special ids (1..7)."""

    eos_ids = frozenset({2, 7})

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for n, special in enumerate(SPECIALS):
                if text.startswith(special, i):
                    ids.append(n + 1)
                    i += len(special)
                    break
            else:
                ids.append(ord(text[i]) + 16)
                i += 1
        return ids

    def cache_stats(self) -> dict:
        return {}

    def tokens_at_least(self, texts, limit: int) -> int:
        return len(self.encode("".join(texts)))

    def decode(self, ids) -> str:
        return "".join(SPECIALS[i - 1] if i <= len(SPECIALS) else chr(i - 16) for i in ids)

    def incremental_decoder(self):
        tok = self

        class Dec:
            def push(self, ids):
                return tok.decode(ids)

            def flush(self):
                return ""

        return Dec()


@dataclass(frozen=True)
class Rendered:
    ids: list
    text: str
    segments: tuple = ()


class ChatMLRenderer:
    def __init__(self, tok: CharTokenizer):
        self.tok = tok

    def render(self, conv, add_generation_prompt=True) -> Rendered:
        text = "".join(f"<|im_start|>{m.role}\n{''.join(map(_part_text, m.parts))}<|im_end|>\n"
                       for m in conv.messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("<think>\n" if conv.enable_thinking else "")
        return Rendered(self.tok.encode(text), text)


def _part_text(part) -> str:
    if isinstance(part, ThinkingPart):
        return f"<think>\n{part.text}\n</think>\n\n"
    if isinstance(part, ToolCallPart):
        return f'<tool_call>\n{{"name": "{part.name}", "arguments": {part.arguments}}}\n</tool_call>'
    return getattr(part, "text", None) or getattr(part, "content", "")


class SlowCore:
    """Emits forced_output_ids (or 'ok'): queued for `queue_s`, then admitted (reusing half the prompt), then
    `prefill_s` of progress events; tracks what is active."""

    max_running, max_waiting = 2, 2

    def __init__(self, tok: CharTokenizer, prefill_s: float = 0.0, step_s: float = 0.0):
        self.tok, self.prefill_s, self.step_s = tok, prefill_s, step_s
        self.fail_next = False  # end the next request with an engine error
        self.fail_admit = False  # end the next request with an engine error instead of admitting it
        self.queue_s = 0.0
        self.active = 0
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.finished = 0
        self._tasks: set = set()

    def submit(self, req: GenerateRequest, on_event) -> None:
        if len(self.requests) - self.finished >= self.max_running + self.max_waiting:
            raise OverflowError("queue full")
        self._tasks.add(asyncio.get_running_loop().create_task(self._deliver(req, on_event)))

    async def _deliver(self, req: GenerateRequest, on_event) -> None:
        async for ev in self._events(req):
            on_event(ev)
        self.finished += 1

    def stream(self, req: GenerateRequest) -> TokenStream:
        return TokenStream(self, req)

    def stats(self) -> dict:
        return {"active": self.active, "queued": 0, "cache": {"hits": 1}}

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        for req in self.requests:
            if req.request_id == request_id:
                req.abort.abort()

    async def _events(self, req: GenerateRequest):
        self.requests.append(req)
        self.active += 1
        try:
            async for ev in self._run(req):
                yield ev
        finally:
            self.active -= 1

    async def _run(self, req: GenerateRequest):
        loop = asyncio.get_running_loop()
        end = loop.time() + self.queue_s
        while loop.time() < end and not req.abort.aborted:
            await asyncio.sleep(0.02)
        if self.fail_admit:
            self.fail_admit = False
            yield TokenEvent(req.request_id, finish_reason="error", error="cannot restore the prefix")
            return
        yield TokenEvent(req.request_id, reused_tokens=len(req.prompt_ids) // 2)
        end = loop.time() + self.prefill_s
        while loop.time() < end and not req.abort.aborted:
            yield TokenEvent(req.request_id, prefilled_so_far=0)
            await asyncio.sleep(0.02)
        out = (req.forced_output_ids or self.tok.encode("ok")) + [2]
        n = 0
        for tok in out[:req.max_new_tokens]:
            if req.abort.aborted:
                break
            n += 1
            yield TokenEvent(req.request_id, token_ids=(tok,))
            await asyncio.sleep(self.step_s)
        if self.fail_next:
            self.fail_next = False
            yield TokenEvent(req.request_id, finish_reason="error", error="boom")
            return
        ran_out = n < req.max_new_tokens or out[n - 1] in req.stop_ids
        finish = "abort" if req.abort.aborted else ("stop" if ran_out else "length")
        p, reused = len(req.prompt_ids), len(req.prompt_ids) // 2
        usage = Usage(prompt_tokens=p, output_tokens=n, reused_tokens=reused, prefilled_tokens=p - reused)
        yield TokenEvent(req.request_id, finish_reason=finish, usage=usage)
