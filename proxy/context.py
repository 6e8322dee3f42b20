"""What every handler needs, held once per app under a typed AppKey."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Protocol

from aiohttp import web

from proxy.conversation import Conversation
from proxy.metrics import Metrics
from proxy.apis.responses.store import ResponseStore


class Plan(NamedTuple):
    """Cache advice for one request: where the engine should checkpoint, and which session pins it."""

    checkpoint_positions: tuple[int, ...] = ()
    session_key: str | None = None


class Planner(Protocol):
    """The cache-policy seam (proxy/cache_policy.PolicyPlanner fills it). Per request:

        conv = planner.normalize(conv, headers, request)     # before rendering (harness normalisation)
        turn = planner(conv, rendered, headers, request)      # -> .checkpoint_positions, .session_key
        planner.finish(turn, output_ids, usage)               # after generation (remember the turn)
    `request` is the raw JSON body. `stats()` (or `.policy.stats()`) feeds /metrics as killick_policy_*.
    """

    def normalize(self, conv: Conversation, headers: Mapping[str, str], request: Mapping | None = None
                  ) -> Conversation: ...

    def __call__(self, conv: Conversation, rendered: Any, headers: Mapping[str, str],
                 request: Mapping | None = None) -> Any: ...

    def finish(self, turn: Any, output_ids: list[int], usage: Any = None) -> Any: ...


class NoPlanner:
    """The default: no normalisation, no checkpoints beyond the engine's own, no session."""

    def normalize(self, conv, headers, request=None):
        return conv

    def __call__(self, conv, rendered, headers, request=None) -> Plan:
        return Plan()

    def finish(self, turn, output_ids, usage=None) -> None:
        return None


def planner_stats(planner: Planner) -> dict:
    for owner in (planner, getattr(planner, "policy", None)):
        stats = getattr(owner, "stats", None)
        if callable(stats):
            return stats()
    return {}


@dataclass
class ServerContext:
    core: Any  # engine.serving.EngineCore: submit / abort / stats
    tokenizer: Any  # proxy.prompt.tokenizer.Tokenizer
    renderer: Any  # proxy.prompt.render.ChatRenderer
    model_name: str
    context_length: int  # tokens one request may hold (prompt + output): the engine's real KV budget
    keepalive_s: float = 5.0
    default_max_tokens: int = 8192
    planner: Planner = field(default_factory=NoPlanner)
    test_hooks: bool = False  # honour x-killick-forced-output (scripted output for end-to-end tests)
    force_responses: bool = False  # honour x-killick-force-response (killick replay; serve --allow-forced)
    script: Any = None  # proxy.replay.scripted.Script: every answer comes from the script (serve --script)
    metrics: Metrics = field(default_factory=Metrics)
    responses: ResponseStore = field(default_factory=ResponseStore)
    in_flight: int = 0  # requests submitted by this proxy and not yet finished


CTX = web.AppKey("killick_ctx", ServerContext)
