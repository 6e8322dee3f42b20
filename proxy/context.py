"""What every handler needs, held once per app under a typed AppKey."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
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


PLANNING_THREADS = 2


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
    # normalise, render and plan (proxy/preparing.py: prepare) run here, off the event loop: their time grows
    # with the prompt (0.1-0.4 s for a 200k-token conversation on a 2-core dev box). Two threads: a huge request
    # does not hold up the next one's preparation, and no more than two prompts are tokenized at once. Threads
    # start on first use; the app's cleanup shuts them down.
    planning: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PLANNING_THREADS, thread_name_prefix="killick-plan"))


CTX = web.AppKey("killick_ctx", ServerContext)
