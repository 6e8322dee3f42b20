"""What a resumed conversation keeps of its first request: the text of its `snapshot` volatile rules.

Claude Code writes a git status into its system prompt when a conversation starts and never updates it
("a snapshot in time, and will not update during the conversation"); `claude --continue` resumes the same
conversation (same session id, same history) in a new process, which takes a new snapshot. In the
stable-first layout that text lies between the tool definitions and the history, so a new snapshot would
cost a prefill of the whole history. `Snapshots.keep` gives every request that resumes a conversation the
snapshot its first request carried: the prompt the conversation would have had if the harness had never
restarted.

A conversation is the harness's session id together with its first conversation message (sub-agents share
the main session id but open with their own task). A request without an assistant message starts one and
sets its snapshot; so does the first request this server sees of a conversation. Either is set once the
request is admitted (`commit`, with what `keep` left in conv.extras["snapshot"]): one refused after planning,
or only counted, sets nothing. Bounded: the least recently used conversations are forgotten, and a forgotten
one just keeps the snapshot it sends.
"""
from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Iterable, NamedTuple, Optional

from harness_adapters.rules import VolatileText, rules_of
from proxy.conversation import Conversation, Message, TextPart


class Snapshots:
    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._texts: OrderedDict[tuple[str, str], tuple[Optional[str], ...]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, conv: Conversation, rules: Iterable, session: Optional[str]) -> Conversation:
        """conv with the first match of each snapshot rule in its first system message (matches that do not
        overlap) as its conversation's first request had it. `session`: the harness's session id (None: not
        said, so nothing is kept). A request that sets its conversation's snapshot carries it in
        extras["snapshot"], for commit() once admitted."""
        rules = [r for r in rules_of(rules, VolatileText) if r.snapshot]
        first = conv.messages[0] if conv.messages else None
        opening = next((m for m in conv.messages[1:] if m.role != "system"), None)
        if not rules or session is None or opening is None or first.role != "system":
            return conv
        text = first.text
        spans = [snapshot_span(text, rule) for rule in rules]
        sent = tuple(None if span is None else text[span[0]:span[1]] for span in spans)
        key = (session, hashlib.sha256(repr(opening).encode()).hexdigest())
        resumed = any(m.role == "assistant" for m in conv.messages)
        with self._lock:
            kept = self._texts.get(key) if resumed else None
            if kept is not None:
                self._texts.move_to_end(key)
        if kept is None:  # this request's own snapshot, kept for its conversation once it is admitted
            return replace(conv, extras={**conv.extras, "snapshot": Pending(key, sent, not resumed)})
        if kept == sent:
            return conv
        swaps = sorted((span, old) for span, old in zip(spans, kept) if span is not None and old is not None)
        for (start, end), old in reversed(swaps):  # from the end, so earlier spans keep their offsets
            text = text[:start] + old + text[end:]
        parts = (TextPart(text),) + tuple(p for p in first.parts if not isinstance(p, TextPart))
        return replace(conv, messages=(Message("system", parts),) + conv.messages[1:])

    def commit(self, pending: Optional["Pending"]) -> None:
        """An admitted request's snapshot (keep's extras["snapshot"]; None: nothing) kept for its conversation: a
        conversation's start replaces what was kept; a resumed one unknown here sets it unless a request of it
        admitted meanwhile did."""
        if pending is None:
            return
        with self._lock:
            if pending.starts or pending.key not in self._texts:
                self._texts[pending.key] = pending.texts
            self._texts.move_to_end(pending.key)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)


class Pending(NamedTuple):
    """A request's snapshot, to keep for its conversation once admitted (Snapshots.commit)."""

    key: tuple[str, str]  # (session id, digest of the opening message)
    texts: tuple[Optional[str], ...]  # each snapshot rule's match in the request (None: none)
    starts: bool  # the request starts its conversation (no assistant message yet)


def snapshot_span(text: str, rule: VolatileText) -> Optional[tuple[int, int]]:
    """Where the rule's first match lies in `text` (the line break a pattern opens with left out): only what
    the pattern covers is a snapshot, whatever `moves` takes with it."""
    match = re.search(rule.pattern, text)
    if match is None:
        return None
    start = match.start()
    while start < match.end() and text[start] == "\n":
        start += 1
    return start, match.end()
