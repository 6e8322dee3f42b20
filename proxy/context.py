"""What every handler needs, held once per app under a typed AppKey."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

from aiohttp import web

from proxy.conversation import Conversation
from proxy.metrics import Metrics
from proxy.response_store import ResponseStore


class Plan(NamedTuple):
    """Cache advice for one request: where the engine should checkpoint, and which session pins it."""

    checkpoint_positions: tuple[int, ...] = ()
    session_key: str | None = None


# planner(conv, rendered, headers) -> Plan. The seam the cache-policy code fills in (anchors, sessions).
Planner = Callable[[Conversation, Any, Mapping[str, str]], Plan]


def no_plan(conv: Conversation, rendered: Any, headers: Mapping[str, str]) -> Plan:
    return Plan()


@dataclass
class ServerContext:
    core: Any  # engine.serving.EngineCore: submit / abort / stats
    tokenizer: Any  # engine.tokenizer.Tokenizer
    renderer: Any  # proxy.render.ChatRenderer
    model_name: str
    context_length: int  # tokens one request may hold (prompt + output): the engine's real KV budget
    keepalive_s: float = 5.0
    default_max_tokens: int = 8192
    planner: Planner = no_plan
    test_hooks: bool = False  # honour x-killick-forced-output (scripted output for end-to-end tests)
    metrics: Metrics = field(default_factory=Metrics)
    responses: ResponseStore = field(default_factory=ResponseStore)
    in_flight: int = 0  # requests submitted by this proxy and not yet finished


CTX = web.AppKey("killick_ctx", ServerContext)
