"""Harness adapters: detect which agent sent a request, normalise what it alone varies, declare its cuts.

Registry order matters: the first adapter whose detect() says yes wins; generic is always last. Users add
their own harnesses from a config file (load_user_rules); those are tried before the built-in ones.
"""
from __future__ import annotations

from typing import Any, Mapping

from harness_adapters.base import Adapter, BaseAdapter, header
from harness_adapters.builtin import builtin_adapters
from harness_adapters.generic import GenericAdapter
from harness_adapters.rules import (Compaction, ElideObservationsExceptLastN, ElideToolOutputsBeyondN, ModelName,
                                    ReplaceTrailingMessage, Rule, StripThinkingExceptLatestN, VolatileText, rules_of)
from harness_adapters.user_rules import UserHarness, UserRules, load_user_rules

__all__ = [
    "Adapter", "BaseAdapter", "Compaction", "ElideObservationsExceptLastN", "ElideToolOutputsBeyondN", "ModelName",
    "ReplaceTrailingMessage", "Rule", "StripThinkingExceptLatestN", "VolatileText", "Registry", "UserHarness",
    "UserRules", "header", "rules_of", "load_user_rules", "load_registry", "default_registry", "detect_adapter",
]


class Registry:
    """Adapters tried in order; the generic adapter answers when nothing else does."""

    def __init__(self, adapters: list | None = None):
        self._adapters = list(adapters) if adapters is not None else builtin_adapters()
        self._generic = GenericAdapter()

    def add_first(self, adapters: list) -> None:
        """User-declared harnesses go before the built-in ones (they know their own traffic best)."""
        self._adapters = list(adapters) + self._adapters

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str], conv=None) -> Adapter:
        """First adapter recognising the request (raw JSON, headers, and/or its parsed Conversation)."""
        return next((a for a in self._adapters if a.detect(request, headers, conv)), self._generic)

    def get(self, name: str) -> Adapter:
        for adapter in self._adapters + [self._generic]:
            if adapter.name == name:
                return adapter
        raise ValueError(f"no harness adapter named {name!r}; known: {self.names()}")

    def names(self) -> list[str]:
        return [a.name for a in self._adapters] + [self._generic.name]


def load_registry(user_rules_path=None) -> Registry:
    """The built-in adapters, preceded by the user's own from a rules file (JSON or TOML) if given."""
    registry = Registry()
    if user_rules_path is not None:
        registry.add_first(load_user_rules(user_rules_path).adapters())
    return registry


default_registry = Registry()


def detect_adapter(request: Mapping[str, Any], headers: Mapping[str, str], conv=None) -> Adapter:
    return default_registry.detect(request, headers, conv)
