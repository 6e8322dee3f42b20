"""Which replica answers a request. Torch-free and aiohttp-free: plain state that the pool updates.

    router = Router(urls, policy="session")
    for replica in router.order(session_key): ...     # first choice, then where to fail over
    router.started(replica, session_key)              # a request is sent there (load; a new session's home)
    router.answered(session_key, replica)             # it accepted the request: the session sticks to it
    router.finished(session_key, replica, prompt, cached)   # the upstream's usage: what it reused
    router.failed(replica, why) / router.set_health(replica, ok, why)

policy "session": a session stays on the replica that holds its prefix. A new session (or one whose replica is
down) goes to the replica with the fewest requests in flight, then the fewest sessions; among equals the
rendezvous hash of (session key, replica URL) decides, so the same key finds the same replica again after a
restart of the proxy. A session's side requests and sub-threads (the cache policy's `KEY#title`,
`KEY#compaction`, `KEY~2`) go where KEY goes: they share its system prompt and tools, often its history.
policy "round-robin": every request to the next replica in turn (the benchmark's baseline). Requests without
a session key go to the least-loaded replica either way.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

POLICIES = ("session", "round-robin")
MAX_SESSIONS = 4096  # sessions remembered (least recently used dropped first)
SESSIONS_SHOWN = 32  # the most recent sessions in stats(): /metrics stays bounded


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0  # started here
    failures: int = 0  # connection errors, 5xx, 429, chunks not in the OpenAI shape, streams cut before the end
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_error: Optional[str] = None
    # where its answers put the thinking a prompt opened: "parsed" (the reasoning field), "content" (no reasoning
    # parser: content up to </think>), "unknown" until an answer shows it (--upstream-reasoning auto); an answer
    # that shows otherwise moves it (wire.ChunkReader's shown)
    reasoning: str = "parsed"


@dataclass
class SessionRoute:
    """Where one session runs and how much of its prompts that replica reused (the upstream's cached tokens)."""

    replica: str  # URL
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_prompt_tokens: int = 0
    last_cached_tokens: int = 0
    moves: int = 0  # times the session changed replica (failover, or round-robin)


def routing_key(session_key: str) -> str:
    """The main session a key belongs to: without the side-request kind (#title) and thread number (~2)."""
    return _SUFFIX.sub("", session_key) or session_key


_SUFFIX = re.compile(r"(#[a-z_]+)?(~\d+)?$")


def rendezvous_score(key: str, url: str) -> int:
    """Highest random weight: each (key, replica) pair gets a stable pseudo-random score."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


class Router:
    def __init__(self, urls: list[str], policy: str = "session", max_sessions: int = MAX_SESSIONS,
                 reasoning: str = "parsed"):
        """reasoning: where the replicas put the thinking, as configured (--upstream-reasoning; auto: unknown)."""
        if not urls:
            raise ValueError("upstream mode needs at least one replica URL (--upstream URL)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"an upstream URL is given twice: {urls}")
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        known = "unknown" if reasoning == "auto" else reasoning
        self.replicas = [Replica(u, reasoning=known) for u in urls]
        self.policy = policy
        self.homes: OrderedDict[str, str] = OrderedDict()  # routing key -> URL of the replica holding it
        self.sessions: OrderedDict[str, SessionRoute] = OrderedDict()  # session key -> where and what it reused
        self.max_sessions = max_sessions
        self._turn = itertools.count()
        self.retries = 0  # times a request went to another replica after one failed, before its first output

    def order(self, session_key: Optional[str]) -> list[Replica]:
        """Every replica, best first: healthy ones by the policy, then those marked down (a last resort:
        the health check may be behind)."""
        up = [r for r in self.replicas if r.healthy]
        down = [r for r in self.replicas if not r.healthy]
        if self.policy == "round-robin" or not session_key:
            start = next(self._turn) % max(len(up), 1)
            ring = up[start:] + up[:start]
            if self.policy != "round-robin":  # no session: the least loaded, ring order among equals
                ring.sort(key=lambda r: r.in_flight)
            return ring + down
        key = routing_key(session_key)
        url = self.homes.get(key)
        home = next((r for r in up if r.url == url), None)
        if home is not None:
            return [home] + self._by_score(key, [r for r in up if r is not home]) + self._by_score(key, down)
        held = self._sessions_per_replica()
        up.sort(key=lambda r: (r.in_flight, held.get(r.url, 0), -rendezvous_score(key, r.url)))
        return up + self._by_score(key, down)

    def started(self, replica: Replica, session_key: Optional[str] = None) -> None:
        """A request is sent there. A session's first request makes it the session's home at once: a side
        request sent before that one is answered (a title, a compaction, a subagent of the same key) then
        follows it instead of landing elsewhere and moving the home away from the prefix being computed."""
        replica.in_flight += 1
        replica.requests += 1
        key = routing_key(session_key) if session_key else None
        if key is not None and key not in self.homes:
            self.homes[key] = replica.url
            self._trim()

    def answered(self, session_key: Optional[str], replica: Replica) -> None:
        """The replica took the request: the session (and its side requests) stick to it from now on."""
        if not session_key:
            return
        route = self.sessions.get(session_key)
        if route is None:
            route = self.sessions[session_key] = SessionRoute(replica.url)
        elif route.replica != replica.url:
            route.replica, route.moves = replica.url, route.moves + 1
        self.sessions.move_to_end(session_key)
        self.homes[routing_key(session_key)] = replica.url
        self.homes.move_to_end(routing_key(session_key))
        self._trim()

    def _trim(self) -> None:
        for table in (self.sessions, self.homes):
            while len(table) > self.max_sessions:
                table.popitem(last=False)

    def finished(self, session_key: Optional[str], replica: Replica, prompt_tokens: int, cached_tokens: int,
                 ok: bool = True) -> None:
        """The request left `replica`; with ok, its usage is booked to the replica and the session."""
        replica.in_flight -= 1
        if not ok:
            return
        replica.prompt_tokens += prompt_tokens
        replica.cached_tokens += cached_tokens
        route = self.sessions.get(session_key) if session_key else None
        if route is not None:
            route.turns += 1
            route.prompt_tokens += prompt_tokens
            route.cached_tokens += cached_tokens
            route.last_prompt_tokens, route.last_cached_tokens = prompt_tokens, cached_tokens

    def failed(self, replica: Replica, why: str, down: bool = True) -> None:
        """A request failed there; `down` takes the replica out of rotation until a health check passes."""
        replica.failures += 1
        replica.last_error = why
        replica.healthy = replica.healthy and not down

    def set_health(self, replica: Replica, ok: bool, why: Optional[str] = None) -> None:
        replica.healthy = ok
        if not ok:
            replica.last_error = why

    def _by_score(self, key: str, replicas: list[Replica]) -> list[Replica]:
        return sorted(replicas, key=lambda r: -rendezvous_score(key, r.url))

    def _sessions_per_replica(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for url in self.homes.values():
            held[url] = held.get(url, 0) + 1
        return held

    def stats(self) -> dict:
        """Totals as numbers (they become gauges), replicas and the most recent sessions as lists."""
        held = self._sessions_per_replica()
        prompt = sum(r.prompt_tokens for r in self.replicas)
        cached = sum(r.cached_tokens for r in self.replicas)
        recent = list(self.sessions.items())[-SESSIONS_SHOWN:]
        return {
            "active": sum(r.in_flight for r in self.replicas), "queued": 0,
            "replicas_up": sum(r.healthy for r in self.replicas), "replicas_total": len(self.replicas),
            "sessions": len(self.sessions), "requests": sum(r.requests for r in self.replicas),
            "failures": sum(r.failures for r in self.replicas), "retries": self.retries,
            "session_moves": sum(s.moves for s in self.sessions.values()),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt if prompt else 0.0,
            "routing": self.policy,
            "replicas": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "requests": r.requests,
                          "failures": r.failures, "sessions": held.get(r.url, 0), "prompt_tokens": r.prompt_tokens,
                          "cached_tokens": r.cached_tokens} for r in self.replicas],
            "last_errors": {r.url: r.last_error for r in self.replicas if r.last_error},
            "reasoning": {r.url: r.reasoning for r in self.replicas},  # where each sends the thinking (Replica)
            "recent_sessions": [{"session": k, "replica": s.replica, "turns": s.turns, "moves": s.moves,
                                 "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                                 "last_prompt_tokens": s.last_prompt_tokens,
                                 "last_cached_tokens": s.last_cached_tokens} for k, s in reversed(recent)],
        }
