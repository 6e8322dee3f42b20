"""Reply sources: answers that replace sampling, plugged in at the edge with create_app(replies=...).

    OutputHeader()           tests: `x-killick-forced-output: TEXT` emits TEXT's tokens
    ForcedResponses()        killick replay, serve --allow-forced-responses: the reply in x-killick-force-response
    Scripted(script)         serve --script: every answer comes from the script (scripted.py)
    FirstReply(a, b, ...)    the first source that answers (serve: a forced response before the script)

Each returns the token ids the engine must emit (GenerateRequest.forced_output_ids) or None to sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from proxy.conversation import Conversation
from proxy.errors import ApiError
from proxy.policy.planner import Plan
from proxy.replay.scripted import FORCE_RESPONSE_HEADER, Script, decode_header, forced_ids

if TYPE_CHECKING:
    from proxy.context import ServerContext
    from proxy.generation import ReplySource

OUTPUT_HEADER = "x-killick-forced-output"


class OutputHeader:
    """The engine emits the header's text, tokenized as is (headers are one line: tests write newlines as \\n)."""

    def reply_ids(self, ctx: ServerContext, conv: Conversation, prompt_text: str, headers: Mapping[str, str],
                  plan: Plan) -> Optional[list[int]]:
        text = headers.get(OUTPUT_HEADER)
        if text is None:
            return None
        return list(ctx.tokenizer.encode(text.replace("\\n", "\n")))


class ForcedResponses:
    """The recorded reply replay sends (base64url JSON), rendered by the chat template as the model writes it.
    A server honours it only when started so: a client must not choose the model's output elsewhere."""

    def reply_ids(self, ctx: ServerContext, conv: Conversation, prompt_text: str, headers: Mapping[str, str],
                  plan: Plan) -> Optional[list[int]]:
        value = headers.get(FORCE_RESPONSE_HEADER)
        if value is None:
            return None
        try:
            reply = decode_header(value)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return forced_ids(ctx.renderer, ctx.tokenizer, conv, prompt_text, reply)


class Scripted:
    """Every answer from a script; side requests (title, compaction) by the kind the cache policy found."""

    def __init__(self, script: Script):
        self.script = script

    def reply_ids(self, ctx: ServerContext, conv: Conversation, prompt_text: str, headers: Mapping[str, str],
                  plan: Plan) -> Optional[list[int]]:
        reply = self.script.reply(conv, plan.side_kind)
        return forced_ids(ctx.renderer, ctx.tokenizer, conv, prompt_text, reply)


class FirstReply:
    """The first of several sources that answers."""

    def __init__(self, *sources: ReplySource):
        self.sources = sources

    def reply_ids(self, ctx: ServerContext, conv: Conversation, prompt_text: str, headers: Mapping[str, str],
                  plan: Plan) -> Optional[list[int]]:
        for source in self.sources:
            ids = source.reply_ids(ctx, conv, prompt_text, headers, plan)
            if ids is not None:
                return ids
        return None
