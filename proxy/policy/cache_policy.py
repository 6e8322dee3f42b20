"""The cache policy for one request, in two calls: plan before submitting, finish after generating.

    adapter = registry.detect(request, headers, conv)
    conv = normalize(parse(request), adapter)
    rendered = renderer.render(conv)
    turn = policy.plan_turn(request, headers, conv, rendered, adapter)
    req = GenerateRequest(rendered.ids, ..., checkpoint_positions=turn.checkpoint_positions,
                          session_key=turn.session_key)
    turn = policy.admit_turn(turn)                              # the engine took it: its turn number
    ... stream ...
    record = policy.finish_turn(turn, generated_ids, usage)     # -> TurnRecord for metrics

`PolicyPlanner` puts this behind the proxy's planner seam (proxy/policy/planner.py). Torch-free: sessions,
diff and anchors are plain Python over token lists and segments.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from engine.common_prefix import id_array
from harness_adapters import Registry
from proxy.conversation import Conversation
from proxy.policy.anchors import (IMPLICIT_PER_TURN, SHARED_PREFIX, AnchorBudget, AnchorPlan, plan_anchors,
                                  resume_position)
from proxy.policy.diff import Edit, PreviousTurn, diff_turn
from proxy.policy.planner import HarnessNormalizer, Plan
from proxy.policy.sessions import SessionStore
from proxy.policy.turns import RenderedLike, TurnRecord, summarize


if TYPE_CHECKING:
    from engine.api import Usage

SIDE_BUDGET = AnchorBudget(max_count=IMPLICIT_PER_TURN + 1)
RECENT_TURNS = 8  # per session, in stats()


@dataclass(frozen=True, kw_only=True)
class TurnPlan(Plan):
    """The Plan of one turn, with what finish_turn() needs to remember it."""

    session_source: str  # header name, prompt_cache_key, metadata.user_id, prefix, new
    kind: str  # main, title, side, compaction
    harness: str
    edit: Edit
    resume_at: int  # deepest known checkpoint at or before the edit point
    anchors: AnchorPlan
    prompt_ids: tuple[int, ...]
    segments: tuple
    conversation: Conversation


class CachePolicy:
    """Sessions + diff + anchor planner. Thread-safe: handlers may plan and finish from any thread."""

    def __init__(self, store: Optional[SessionStore] = None, budget: AnchorBudget = AnchorBudget()):
        self.store = store or SessionStore()
        self.budget = budget
        self._lock = threading.Lock()

    def plan_turn(self, request: Mapping[str, Any], headers: Mapping[str, str], conv: Conversation,
                  rendered: RenderedLike, adapter) -> TurnPlan:
        kind = adapter.side_request_kind(conv) or "main"
        ids = id_array(rendered.ids)  # once: the session scans below compare it with every earlier prompt
        with self._lock:
            key, source = self.store.identify(request, headers, ids, kind, extras=conv.extras,
                                              from_summary=adapter.starts_from_summary(conv), conv=conv)
            state = self.store.get(key)
            last = len(rendered.ids) - 1  # the engine prefills at least one token to get the first logits
            if state is not None and state.prev is not None:
                edit = diff_turn(state.prev, rendered, conv, adapter.rules)
                resume = resume_position(state.checkpoint_positions, min(edit.edit_point, last))
                existing = state.checkpoint_positions
            else:  # a new conversation still shares the harness's fixed prefix with the others
                shared, resume = self.store.shared_checkpoint(ids, max_position=last)
                edit, existing = Edit(shared, "first"), ()
            self.store.plan(key, kind, adapter.name)  # apart until admitted; one sent meanwhile under its hint joins it
            if kind == "main":
                anchors = plan_anchors(rendered, adapter.rules, start=resume, existing=existing,
                                       budget=self.budget, conv=conv)
            else:  # one-off side requests: at most the shared system + tools prefix is worth keeping
                anchors = plan_anchors(rendered, (), start=resume, existing=existing, conv=conv,
                                       budget=SIDE_BUDGET, min_priority=SHARED_PREFIX)
        n = len(rendered.ids)
        record = TurnRecord(key, adapter.name, None, kind, n, edit.edit_point, edit.edit_class,
                            resume, n - resume, anchors.checkpoint_positions)
        return TurnPlan(checkpoint_positions=anchors.checkpoint_positions, session_key=key, record=record,
                        session_source=source, kind=kind, harness=adapter.name, edit=edit, resume_at=resume,
                        anchors=anchors, prompt_ids=tuple(rendered.ids), segments=tuple(rendered.segments),
                        conversation=conv, snapshot=conv.extras.get("snapshot"))

    def admit_turn(self, turn: TurnPlan) -> TurnPlan:
        """The turn numbered, once the engine (or an upstream) took the request: one refused after planning (a
        full queue, a forced reply that does not decode) takes no number, so a session's turns have no gaps, and
        leaves no session where the admitted ones are held (SessionStore.plan)."""
        with self._lock:
            n = self.store.next_turn(turn.session_key, turn.kind, turn.harness)
        return replace(turn, record=replace(turn.record, turn_index=n))

    def stats(self, recent: int = RECENT_TURNS) -> dict:
        """Sessions held, totals over the turns they remember (see turns.summarize), and `recent_turns`: the
        last `recent` turns of each session (most recently used session last), one row each."""
        with self._lock:
            states = [self.store.get_quiet(k) for kind in ("main", "side") for k in self.store.sessions(kind)]
        records = [r for s in states for r in s.records]
        return {"sessions": len([s for s in states if s.kind == "main"]),
                "side_sessions": len([s for s in states if s.kind != "main"]), **summarize(records),
                "recent_turns": [r.row() for s in states for r in s.records[-recent:]]}

    def finish_turn(self, turn: TurnPlan, generated_ids: Sequence[int], usage: Usage) -> TurnRecord:
        """Remember the turn, and where the session now has checkpoints: the earlier ones the plan keeps and
        the ones the engine reports it kept for this request (Usage.checkpoints_kept). The stop id that ended
        the output is the turn's too: the engine cached through it, and the next prompt repeats it."""
        record = turn.record.with_usage(usage)
        ended = () if usage.stop_token is None else (usage.stop_token,)
        prev = PreviousTurn(turn.prompt_ids, tuple(generated_ids) + ended, turn.segments, turn.conversation)
        positions = turn.anchors.keep + tuple(usage.checkpoints_kept)
        with self._lock:
            self.store.finish_turn(turn.session_key, prev, positions, record, turn.kind, turn.harness)
        return record


class PolicyPlanner:
    """The cache policy behind the planner seam: the harness normalisation, then CachePolicy. The harness
    found by normalize() travels in conv.extras["harness"]; session hints the front-ends parsed travel in
    conv.extras["session_hint"]."""

    def __init__(self, policy: Optional[CachePolicy] = None, registry: Optional[Registry] = None,
                 harness: Optional[HarnessNormalizer] = None):
        if harness is not None and registry is not None:
            raise ValueError("give PolicyPlanner a registry or a HarnessNormalizer (which has one), not both")
        self.harness = harness or HarnessNormalizer(registry)
        self.policy = policy or CachePolicy()

    def normalize(self, conv: Conversation, headers: Mapping[str, str],
                  request: Optional[Mapping] = None) -> Conversation:
        return self.harness.normalize(conv, headers, request)

    def __call__(self, conv: Conversation, rendered: RenderedLike, headers: Mapping[str, str],
                 request: Optional[Mapping] = None) -> TurnPlan:
        adapter = self.harness.adapter(conv, headers, request)
        return self.policy.plan_turn(request or {}, headers, conv, rendered, adapter)

    def admit(self, plan: TurnPlan) -> TurnPlan:
        self.harness.snapshots.commit(plan.snapshot)
        return self.policy.admit_turn(plan)

    def finish(self, plan: TurnPlan, output_ids: Sequence[int], usage: Usage) -> TurnRecord:
        return self.policy.finish_turn(plan, output_ids, usage)

    def stats(self) -> dict:
        return self.policy.stats()
