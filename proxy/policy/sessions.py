"""Which conversation a request belongs to, and what the session remembers of its last turn.

A request names its conversation where the harness says so: `x-session-id` (OpenCode), `session-id` /
`session_id` / `thread-id` headers and `prompt_cache_key` (Codex), the session id inside Claude Code's
`metadata.user_id`. Otherwise the session whose last turn shares the longest rendered-token prefix with the
request, provided the match runs past that session's first conversation message (a shared system prompt
alone is not the same conversation). Several conversations under one hint (Claude Code's sub-agents reuse
the main session id) become threads `id`, `id~2`, ... of it, told apart the same way. Side requests
(title, compaction summary) live in their own bounded LRU under their own key, so they can never evict or
overwrite the main conversation. A session new to the store waits in a third bounded LRU, of planned
sessions, until a turn of it is admitted: requests refused after planning (a full queue, a forced reply that
does not decode) never push out the sessions of the agents that work.
"""
from __future__ import annotations

import itertools
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from engine.common_prefix import common_prefix_len, id_array
from harness_adapters import header
from proxy.policy.diff import PreviousTurn
from proxy.policy.turns import first_conversation_message, message_spans

SESSION_HEADERS = ("x-session-id", "session-id", "session_id", "thread-id", "thread_id")
_CC_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,})")


def claude_code_session(user_id: Any) -> Optional[str]:
    """Session id inside Claude Code's metadata.user_id: a JSON object (or its text) or `user_…_session_<uuid>`."""
    if isinstance(user_id, dict):
        user_id = json.dumps(user_id)
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.lstrip().startswith("{"):
        try:
            value = json.loads(user_id)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("session_id"), str) and value["session_id"]:
            return value["session_id"]
    m = _CC_SESSION.search(user_id)
    return m.group(1) if m else None


def session_hint(request: Mapping[str, Any], headers: Mapping[str, str],
                 extras: Optional[Mapping[str, Any]] = None) -> Optional[tuple[str, str]]:
    """(source, id) naming the conversation, or None when the request does not say.

    `extras` is Conversation.extras: the API front-ends put what they parsed under "session_hint"
    (Anthropic metadata.user_id, Responses prompt_cache_key, chat `user`) when the raw request is not at hand.
    """
    for name in SESSION_HEADERS:
        value = header(headers, name)
        if value:
            return name.lower().replace("_", "-"), value
    key = request.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return "prompt_cache_key", key
    metadata = request.get("metadata")
    if isinstance(metadata, dict):
        sid = claude_code_session(metadata.get("user_id"))
        if sid:
            return "metadata.user_id", sid
    value = (extras or {}).get("session_hint")
    if isinstance(value, str) and value:
        sid = claude_code_session(value)
        return ("metadata.user_id", sid) if sid else ("session_hint", value)
    return None


@dataclass
class SessionState:
    key: str
    kind: str  # "main", "title", "compaction"
    harness: str = "generic"
    prev: Optional[PreviousTurn] = None
    checkpoint_positions: tuple[int, ...] = ()  # where the engine holds checkpoints along prev.ids
    turns: int = 0  # turns finished (finish_turn)
    numbered: int = 0  # turn numbers handed out (next_turn): one per admitted request, finished or not
    first_message_end: int = 0  # end of prev's first non-system message: the prefix-match threshold
    records: list = field(default_factory=list)  # recent TurnRecords (bounded by the store)


class SessionStore:
    """Two bounded LRUs of sessions (main conversations and side requests), and one of planned sessions: those
    none of whose turns the engine has admitted yet, held apart so that they count against neither bound."""

    def __init__(self, max_sessions: int = 32, max_side_sessions: int = 16, max_records: int = 64,
                 max_planned: int = 16):
        if min(max_sessions, max_side_sessions, max_planned) < 1:
            raise ValueError("session store sizes must be >= 1")
        self._main: OrderedDict[str, SessionState] = OrderedDict()
        self._side: OrderedDict[str, SessionState] = OrderedDict()
        # planned, none admitted yet: only requests in the planning threads or just out of them wait here
        self._planned: OrderedDict[str, SessionState] = OrderedDict()
        self._limits = {"main": max_sessions, "side": max_side_sessions, "planned": max_planned}
        self.max_records = max_records
        self._anon = itertools.count(1)
        self._threads = itertools.count(2)  # thread numbers are never reused, even after eviction

    def _lru(self, kind: str) -> OrderedDict:
        return self._main if kind == "main" else self._side

    def _held(self, kind: str) -> dict[str, SessionState]:
        """The sessions of kind's LRU then the planned ones of its kind, least recently used first."""
        planned = {k: s for k, s in self._planned.items() if (s.kind == "main") == (kind == "main")}
        return {**self._lru(kind), **planned}

    def identify(self, request: Mapping[str, Any], headers: Mapping[str, str], ids: Sequence[int],
                 kind: str = "main", from_summary: bool = False,
                 extras: Optional[Mapping[str, Any]] = None, conv=None) -> tuple[str, str]:
        """(session key, how it was found: a hint source, 'prefix' or 'new').

        One hint may carry several conversations (Claude Code's sub-agents share the session id): they are
        threads `id`, `id~2`, ... told apart by prefix match. A history rebuilt from a summary
        (`from_summary`, see BaseAdapter.starts_from_summary) continues the thread it shares most with.
        A thread whose last messages all open `conv` (the Conversation) is the same conversation with its
        system prompt or tools changed (an MCP server connected), however early that edit falls.
        """
        suffix = f"#{kind}" if kind != "main" else ""
        hint = session_hint(request, headers, extras)
        if hint is None:
            match = self._prefix_match(ids, kind, self._lru(kind))
            return (match, "prefix") if match else (f"anon-{next(self._anon)}{suffix}", "new")
        base = hint[1] + suffix
        threads = [k for k in self._held(kind) if k == base or k.startswith(base + "~")]
        match = self._prefix_match(ids, kind, threads)
        if match is None and threads and from_summary:
            match = self._prefix_match(ids, kind, threads, threshold=False)
        if match is None and threads and conv is not None:
            match = self._same_history(conv, kind, threads)
        if match is None:
            match = self._first_in_flight(kind, threads)
        if match is None and threads:
            match = f"{base}~{next(self._threads)}"
        return match or base, hint[0]

    def _prefix_match(self, ids: Sequence[int], kind: str, keys, threshold: bool = True) -> Optional[str]:
        """The session among `keys` sharing the longest prefix with `ids` (ties: most recent), provided the
        match runs past its first conversation message (unless threshold is False)."""
        lru, wanted = self._lru(kind), set(keys)
        best, best_len = None, -1
        new = id_array(ids)
        for key in reversed([k for k in lru if k in wanted]):
            state = lru[key]
            if state.prev is None:
                continue
            n = common_prefix_len(state.prev.id_array, new)
            if n > best_len and (not threshold or n >= max(1, state.first_message_end)):
                best, best_len = key, n
        return best

    def _first_in_flight(self, kind: str, keys) -> Optional[str]:
        """The most recent thread among `keys` whose first request is planned and not finished: nothing of it is
        known to tell a request apart from it, so one sent meanwhile under the same hint joins it."""
        held, wanted = self._held(kind), set(keys)
        for key in reversed([k for k in held if k in wanted]):
            if held[key].prev is None:
                return key
        return None

    def _same_history(self, conv, kind: str, keys) -> Optional[str]:
        """The most recent thread among `keys` whose previous prompt's messages, system ones aside, open `conv`."""
        talk = _talk(conv)
        for key in reversed([k for k in self._lru(kind) if k in set(keys)]):
            prev = self._lru(kind)[key].prev
            old = _talk(prev.conversation) if prev is not None and prev.conversation is not None else ()
            if old and talk[:len(old)] == old:
                return key
        return None

    def shared_checkpoint(self, ids: Sequence[int], max_position: Optional[int] = None) -> tuple[int, int]:
        """(common prefix, deepest checkpoint within it and <= max_position) over every session, side ones
        included: what a new conversation can reuse from the others (e.g. a harness's system + tools)."""
        limit = len(ids) if max_position is None else max_position
        best = (0, 0)
        new = id_array(ids)
        for state in list(self._main.values()) + list(self._side.values()):
            if state.prev is not None:
                n = common_prefix_len(state.prev.id_array, new)
                deepest = max((p for p in state.checkpoint_positions if p <= min(n, limit)), default=0)
                best = max(best, (deepest, n))
        return best[1], best[0]

    def get(self, key: str) -> Optional[SessionState]:
        for lru in (self._main, self._side):
            if key in lru:
                lru.move_to_end(key)
                return lru[key]
        return None

    def get_quiet(self, key: str) -> Optional[SessionState]:
        """Like get, without touching the LRU order (for stats)."""
        return self._main.get(key) or self._side.get(key)

    def plan(self, key: str, kind: str = "main", harness: str = "generic") -> None:
        """A request of `key` is planned. A session new to the store waits among the planned ones, where a request
        sent meanwhile under its hint finds it (identify), until a turn of it is admitted (next_turn); one whose
        requests were all refused falls out of that LRU without having displaced an admitted session."""
        if self.get(key) is None:
            self._planned[key] = self._planned.pop(key, None) or SessionState(key, kind, harness)
            _bound(self._planned, self._limits["planned"])

    def get_or_create(self, key: str, kind: str = "main", harness: str = "generic") -> SessionState:
        """The session, admitted to kind's LRU (from the planned ones, or new) if it is not there yet."""
        state = self.get(key)
        if state is None:
            lru = self._lru(kind)
            state = lru[key] = self._planned.pop(key, None) or SessionState(key, kind, harness)
            _bound(lru, self._limits["main" if kind == "main" else "side"])
        return state

    def next_turn(self, key: str, kind: str = "main", harness: str = "generic") -> int:
        """The session's next turn number (0 for its first request), handed out once: requests of one session
        admitted before any of them finishes each get their own. A planned session joins its LRU here."""
        state = self.get_or_create(key, kind, harness)
        state.numbered += 1
        return state.numbered - 1

    def finish_turn(self, key: str, prev: PreviousTurn, checkpoint_positions: Sequence[int], record: Any = None,
                    kind: str = "main", harness: str = "generic") -> SessionState:
        """Remember this turn (prompt, generated ids, segments) and the checkpoints it leaves behind."""
        state = self.get_or_create(key, kind, harness)
        state.prev, state.turns, state.harness = prev, state.turns + 1, harness
        state.checkpoint_positions = tuple(sorted(set(p for p in checkpoint_positions if 0 < p <= len(prev.ids))))
        state.first_message_end = _first_message_end(prev)
        if record is not None:
            state.records = (state.records + [record])[-self.max_records:]
        return state

    def sessions(self, kind: str = "main") -> list[str]:
        """Keys held, least recently used first; kind "main" or any side kind (they share one LRU)."""
        return list(self._lru(kind))


def _bound(lru: OrderedDict, limit: int) -> None:
    while len(lru) > limit:
        lru.popitem(last=False)


def _first_message_end(prev: PreviousTurn) -> int:
    idx = first_conversation_message(prev.segments, prev.conversation)
    return message_spans(prev.segments)[idx][1] if idx is not None else len(prev.prompt_ids)


def _talk(conv) -> tuple:
    return tuple(m for m in conv.messages if m.role != "system")
