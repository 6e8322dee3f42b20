"""The planner seam: what the proxy asks the cache policy about each request, and the planners that answer.

Per request, around rendering and generation (proxy/preparing.py, proxy/generation.py):

    conv = planner.normalize(conv, headers, request)      # before rendering: the harness's normalisation
    plan = planner(conv, rendered, headers, request)      # -> Plan: checkpoint positions, session key
    plan = planner.admit(plan)                            # the engine took the request: the turn's number
    planner.finish(plan, output_ids, usage)               # after generation, with the engine's Usage
    planner.stats()                                       # /metrics (killick_policy_*), /v1/killick/stats

`request` is the raw JSON body. normalize() and the call run in the proxy's planning threads, two requests at
a time at most, so a planner is thread-safe; admit(), finish() and stats() run on the event loop. A request
refused after planning (a full queue, a bad header) is never admitted, so it takes no turn number and no
place among the sessions the policy holds. Two planners fill the seam: `NoAnchors` here plans nothing (the
engine keeps only its own checkpoints, at the prompt end and the generation end), and the cache policy's
`PolicyPlanner` (proxy/policy/cache_policy.py: sessions, diff, anchors). Both normalise through a
`HarnessNormalizer`, so every cache mode renders the same prompt. Torch-free and aiohttp-free.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from harness_adapters import Adapter, Registry, default_registry
from harness_adapters.layout import LAYOUTS, name_served_model, stable_first
from harness_adapters.normalize import normalize
from harness_adapters.snapshots import Pending, Snapshots
from proxy.conversation import Conversation
from proxy.policy.sessions import session_hint
from proxy.policy.turns import RenderedLike, TurnRecord, from_other_sessions

if TYPE_CHECKING:
    from engine.api import Usage


@dataclass(frozen=True)
class Plan:
    """Cache advice for one request: the positions where the engine should keep a checkpoint, the session that
    pins what it caches, and (from the cache policy) the record of what the policy expects of this turn."""

    checkpoint_positions: tuple[int, ...] = ()
    session_key: Optional[str] = None
    record: Optional[TurnRecord] = None
    snapshot: Optional[Pending] = None  # the harness snapshot to keep once the request is admitted (Snapshots)

    @property
    def side_kind(self) -> Optional[str]:
        """'title', 'side' or 'compaction' for a harness's side requests; None for the main conversation."""
        kind = self.record.request_kind if self.record is not None else None
        return None if kind == "main" else kind

    def shared_tokens(self, usage: Usage) -> Optional[int]:
        """Of the tokens the engine reused for this request, those from another session (None: no policy)."""
        r = self.record
        return None if r is None else from_other_sessions(usage.reused_tokens, r.edit_point, r.edit_class)

    def fields(self) -> dict:
        """The plan as recordings and the x-killick-* response headers name it."""
        r = self.record
        if r is None:
            return {"session": self.session_key}
        return {"session": r.session_key, "harness": r.harness, "turn_index": r.turn_index,
                "kind": r.request_kind, "edit_point": r.edit_point, "edit_class": r.edit_class,
                "anchor_used": r.anchor_used, "expected_reprefill": r.expected_reprefill}


class Planner(Protocol):
    def normalize(self, conv: Conversation, headers: Mapping[str, str],
                  request: Optional[Mapping] = None) -> Conversation: ...

    def __call__(self, conv: Conversation, rendered: RenderedLike, headers: Mapping[str, str],
                 request: Optional[Mapping] = None) -> Plan: ...

    def admit(self, plan: Plan) -> Plan: ...

    def finish(self, plan: Plan, output_ids: Sequence[int], usage: Usage) -> Optional[TurnRecord]: ...

    def stats(self) -> dict: ...


class HarnessNormalizer:
    """Detects the harness (or takes the one a previous call noted in conv.extras["harness"]) and applies
    its normalisation (harness_adapters/normalize.py), then its prompt layout. "stable": the lines its
    model_name rules match name `served_model` (the model killick serves; None: not known), a resumed
    conversation keeps the snapshot lines of its first request (harness_adapters/snapshots.py), and the
    system lines its volatile_text rules match go after the tool definitions (harness_adapters/layout.py).
    "template": the request as sent, in the chat template's own order."""

    def __init__(self, registry: Optional[Registry] = None, layout: str = "stable",
                 served_model: Optional[str] = None):
        if layout not in LAYOUTS:
            raise ValueError(f"prompt layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.registry = registry or default_registry
        self.layout = layout
        self.served_model = served_model
        self.snapshots = Snapshots()

    def adapter(self, conv: Conversation, headers: Mapping[str, str], request: Optional[Mapping] = None) -> Adapter:
        name = conv.extras.get("harness")
        return self.registry.get(name) if name else self.registry.detect(request or {}, headers, conv)

    def normalize(self, conv: Conversation, headers: Mapping[str, str],
                  request: Optional[Mapping] = None) -> Conversation:
        adapter = self.adapter(conv, headers, request)
        out = normalize(conv, adapter)
        if self.layout == "stable":
            out = name_served_model(out, adapter.rules, self.served_model)
            hint = session_hint(request or {}, headers, conv.extras)
            out = self.snapshots.keep(out, adapter.rules, hint[1] if hint else None)
            out = stable_first(out, adapter.rules)
        return replace(out, extras={**out.extras, "harness": adapter.name})


class NoAnchors:
    """Plans no checkpoints and remembers no sessions. Without a HarnessNormalizer the conversation is
    rendered as parsed (the default of create_app); with one (cache modes off and prefix) it is normalised
    like the cache policy's, so greedy output does not depend on the cache mode."""

    def __init__(self, harness: Optional[HarnessNormalizer] = None):
        self.harness = harness

    def normalize(self, conv: Conversation, headers: Mapping[str, str],
                  request: Optional[Mapping] = None) -> Conversation:
        return conv if self.harness is None else self.harness.normalize(conv, headers, request)

    def __call__(self, conv: Conversation, rendered: RenderedLike, headers: Mapping[str, str],
                 request: Optional[Mapping] = None) -> Plan:
        return Plan(snapshot=conv.extras.get("snapshot"))

    def admit(self, plan: Plan) -> Plan:
        if self.harness is not None:
            self.harness.snapshots.commit(plan.snapshot)
        return plan

    def finish(self, plan: Plan, output_ids: Sequence[int], usage: Usage) -> None:
        return None

    def stats(self) -> dict:
        return {}
