"""Rules for the user's own harness, from a JSON or TOML file, validated with pydantic.

    [[harnesses]]
    name = "my-agent"
    user_agent_contains = ["my-agent/"]
    [[harnesses.rules]]
    kind = "elide_tool_outputs_beyond_n"
    n = 3
    placeholder = "[output cleared]"

A harness may instead `extends = "opencode"` (any built-in name): it keeps that adapter's detection and
normalisation and replaces only what it declares (e.g. its rules). A bad file raises ValueError naming the
file and the field.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harness_adapters.base import BaseAdapter
from harness_adapters.rules import Rule


DETECTION = ("user_agent_contains", "headers_present", "system_contains")


class UserHarness(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    extends: Optional[str] = None  # a built-in adapter's name
    user_agent_contains: Optional[tuple[str, ...]] = None
    headers_present: Optional[tuple[str, ...]] = None
    system_contains: Optional[tuple[str, ...]] = None
    title_markers: Optional[tuple[str, ...]] = None
    title_without_tools: Optional[bool] = None
    rules: Optional[tuple[Rule, ...]] = None  # None: keep the extended adapter's rules (or none)

    def adapter(self, builtins: dict) -> BaseAdapter:
        """An adapter detecting and behaving as declared, on top of `builtins[extends]` if given."""
        if self.extends is not None and self.extends not in builtins:
            raise ValueError(f"harness {self.name!r}: extends {self.extends!r} is not a built-in adapter; "
                             f"known: {sorted(builtins)}")
        adapter = copy.copy(builtins[self.extends]) if self.extends else BaseAdapter()
        adapter.name = self.name
        for attr, value in self.model_dump(exclude={"name", "extends", "rules"}).items():
            if value is not None:
                setattr(adapter, attr, tuple(value) if isinstance(value, list) else value)
        if self.rules is not None:
            adapter.rules = self.rules
        if not any(getattr(adapter, attr) for attr in DETECTION):
            raise ValueError(f"harness {self.name!r} declares no way to detect it: set extends, "
                             "user_agent_contains, headers_present or system_contains")
        return adapter


class UserRules(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    harnesses: tuple[UserHarness, ...] = Field(min_length=1)

    def adapters(self) -> list[BaseAdapter]:
        from harness_adapters.builtin import builtin_adapters

        builtins = {a.name: a for a in builtin_adapters()}
        return [h.adapter(builtins) for h in self.harnesses]


def _read(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise ValueError(f"{path}: TOML needs Python 3.11+; write the rules as JSON instead") from exc
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc


def load_user_rules(path: Union[str, Path]) -> UserRules:
    """Validated rules from a .json or .toml file; ValueError names the offending field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"harness rules file {path} does not exist")
    data = _read(path)
    try:
        rules = UserRules.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ValueError(f"{path}: field {where}: {first['msg']}") from None
    try:
        rules.adapters()  # a harness that cannot be detected, or extends an unknown one
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return rules
