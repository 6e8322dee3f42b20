"""The cache policy for one request, in two calls: plan before submitting, finish after generating.

    adapter = detect_adapter(request, headers)
    conv = normalize(parse(request), adapter)
    rendered = renderer.render(conv)
    turn = policy.plan_turn(request, headers, conv, rendered, adapter)
    req = GenerateRequest(rendered.ids, ..., checkpoint_positions=turn.checkpoint_positions,
                          session_key=turn.session_key)
    ... stream ...
    record = policy.finish_turn(turn, generated_ids, usage)     # -> TurnRecord for metrics

Torch-free: sessions, diff and anchors are plain Python over token lists and segments.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from proxy.policy.anchors import IMPLICIT_PER_TURN, SHARED_PREFIX, AnchorBudget, AnchorPlan, best_anchor, plan_anchors
from proxy.conversation import Conversation
from proxy.policy.diff import Edit, PreviousTurn, diff_turn
from harness_adapters.normalize import normalize
from proxy.policy.sessions import SessionStore
from proxy.policy.turns import RenderedLike, TurnRecord, summarize


SIDE_BUDGET = AnchorBudget(max_count=IMPLICIT_PER_TURN + 1)


@dataclass(frozen=True)
class TurnPlan:
    session_key: str
    session_source: str  # header name, prompt_cache_key, metadata.user_id, prefix, new
    kind: str  # main, title, compaction
    harness: str
    edit: Edit
    resume_at: int  # deepest known checkpoint at or before the edit point
    anchors: AnchorPlan
    record: TurnRecord
    prompt_ids: tuple[int, ...]
    segments: tuple
    conversation: Conversation

    @property
    def checkpoint_positions(self) -> tuple[int, ...]:
        return self.anchors.checkpoint_positions


class CachePolicy:
    """Sessions + diff + anchor planner. Thread-safe: handlers may plan and finish from any thread."""

    def __init__(self, store: Optional[SessionStore] = None, budget: AnchorBudget = AnchorBudget()):
        self.store = store or SessionStore()
        self.budget = budget
        self._lock = threading.Lock()

    def plan_turn(self, request: Mapping[str, Any], headers: Mapping[str, str], conv: Conversation,
                  rendered: RenderedLike, adapter) -> TurnPlan:
        kind = adapter.side_request_kind(conv) or "main"
        with self._lock:
            key, source = self.store.identify(request, headers, rendered.ids, kind, extras=conv.extras,
                                              from_summary=adapter.starts_from_summary(conv), conv=conv)
            state = self.store.get(key)
            last = len(rendered.ids) - 1  # the engine prefills at least one token to get the first logits
            if state is not None and state.prev is not None:
                edit = diff_turn(state.prev, rendered, conv, adapter.rules)
                resume = best_anchor(state.anchors, min(edit.edit_point, last))
                existing, turn_index = state.anchors, state.turns
            else:  # a new conversation still shares the harness's fixed prefix with the others
                shared, resume = self.store.shared_anchor(rendered.ids, max_position=last)
                edit, existing, turn_index = Edit(shared, "first"), (), 0
            if kind == "main":
                anchors = plan_anchors(rendered, adapter.rules, start=resume, existing=existing,
                                       budget=self.budget, conv=conv)
            else:  # one-off side requests: at most the shared system + tools prefix is worth keeping
                anchors = plan_anchors(rendered, (), start=resume, existing=existing, conv=conv,
                                       budget=SIDE_BUDGET, min_priority=SHARED_PREFIX)
        n = len(rendered.ids)
        record = TurnRecord(key, adapter.name, turn_index, kind, n, edit.edit_point, edit.edit_class,
                            resume, n - resume, anchors.checkpoint_positions)
        return TurnPlan(key, source, kind, adapter.name, edit, resume, anchors, record, tuple(rendered.ids),
                        tuple(rendered.segments), conv)

    def stats(self) -> dict:
        """Sessions held and totals over the turns they remember (see turns.summarize)."""
        with self._lock:
            states = [self.store.get_quiet(k) for kind in ("main", "side") for k in self.store.sessions(kind)]
        records = [r for s in states for r in s.records]
        return {"sessions": len([s for s in states if s.kind == "main"]),
                "side_sessions": len([s for s in states if s.kind != "main"]), **summarize(records)}

    def finish_turn(self, turn: TurnPlan, generated_ids: Sequence[int], usage=None) -> TurnRecord:
        """Remember the turn; the engine kept the planned positions plus the prompt and generation ends."""
        record = turn.record.with_usage(usage) if usage is not None else turn.record
        prev = PreviousTurn(turn.prompt_ids, tuple(generated_ids), turn.segments, turn.conversation)
        n = len(turn.prompt_ids)
        anchors = turn.anchors.keep + turn.anchors.checkpoint_positions + (n, n + len(generated_ids))
        with self._lock:
            self.store.finish_turn(turn.session_key, prev, anchors, record, turn.kind, turn.harness)
        return record


class HarnessNormalizer:
    """The harness normalisation alone, behind the planner seam: what cache modes off and prefix use, so the
    prompt (and with it greedy output) is the same in every cache mode. No sessions, no anchors."""

    def __init__(self, registry=None):
        from harness_adapters import default_registry

        self.registry = registry or default_registry

    def adapter(self, conv: Conversation, headers: Mapping[str, str], request: Optional[Mapping] = None):
        name = conv.extras.get("harness")
        return self.registry.get(name) if name else self.registry.detect(request or {}, headers, conv)

    def normalize(self, conv: Conversation, headers: Mapping[str, str],
                  request: Optional[Mapping] = None) -> Conversation:
        adapter = self.adapter(conv, headers, request)
        out = normalize(conv, adapter)
        return replace(out, extras={**out.extras, "harness": adapter.name})

    def __call__(self, conv: Conversation, rendered: RenderedLike, headers: Mapping[str, str],
                 request: Optional[Mapping] = None):
        from proxy.context import Plan

        return Plan()

    def finish(self, turn, generated_ids: Sequence[int], usage=None) -> None:
        return None


class PolicyPlanner(HarnessNormalizer):
    """The cache policy behind the proxy's planner seam (proxy/context.py: `planner(conv, rendered, headers)`
    returning something with `checkpoint_positions` and `session_key`), plus the two calls that seam lacks:

        conv = planner.normalize(conv, headers)          # before rendering: detect the harness, normalise
        turn = planner(conv, rendered, headers)          # a TurnPlan (checkpoint_positions, session_key, record)
        record = planner.finish(turn, output_ids, usage) # after generation: remember the turn, metrics record

    The harness found by normalize() travels in conv.extras["harness"]; session hints the front-ends parsed
    travel in conv.extras["session_hint"].
    """

    def __init__(self, policy: Optional[CachePolicy] = None, registry=None):
        super().__init__(registry)
        self.policy = policy or CachePolicy()

    def __call__(self, conv: Conversation, rendered: RenderedLike, headers: Mapping[str, str],
                 request: Optional[Mapping] = None) -> TurnPlan:
        return self.policy.plan_turn(request or {}, headers, conv, rendered, self.adapter(conv, headers, request))

    def finish(self, turn: TurnPlan, generated_ids: Sequence[int], usage=None) -> TurnRecord:
        return self.policy.finish_turn(turn, generated_ids, usage)
