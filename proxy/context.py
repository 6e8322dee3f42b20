"""What every handler needs, held once per app under a typed AppKey."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from proxy.metrics import Metrics
from proxy.policy.planner import NoAnchors, Planner

if TYPE_CHECKING:
    from engine.serving import EngineCore
    from proxy.generation import ReplySource
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import Tokenizer


@dataclass
class ServerContext:
    core: EngineCore  # stream / abort / stats / call (tests use stand-ins), or an AnswerSource: proxy/upstream
    tokenizer: Tokenizer
    renderer: ChatRenderer
    model_name: str
    context_length: int  # tokens one request may hold (prompt + output): the engine's real KV budget
    keepalive_s: float = 5.0
    default_max_tokens: int = 8192
    planner: Planner = field(default_factory=NoAnchors)
    replies: ReplySource | None = None  # answers that replace sampling (scripts, replay, tests)
    metrics: Metrics = field(default_factory=Metrics)
    in_flight: int = 0  # requests submitted by this proxy and not yet finished


CTX = web.AppKey("killick_ctx", ServerContext)
