"""Rules for the user's own harness, from a JSON or TOML file, validated with pydantic.

    [[harnesses]]
    name = "my-agent"
    user_agent_contains = ["my-agent/"]
    [[harnesses.rules]]
    kind = "elide_tool_outputs_beyond_n"
    n = 3
    placeholder = "[output cleared]"

A bad file raises ValueError naming the file and the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harness_adapters.base import BaseAdapter, Rule


class UserHarness(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    user_agent_contains: tuple[str, ...] = ()
    headers_present: tuple[str, ...] = ()
    system_contains: tuple[str, ...] = ()
    title_markers: tuple[str, ...] = ()
    title_without_tools: bool = False
    rules: tuple[Rule, ...] = ()

    def adapter(self) -> BaseAdapter:
        """An adapter detecting and behaving as declared."""
        adapter = BaseAdapter()
        for attr in ("name", "user_agent_contains", "headers_present", "system_contains", "title_markers",
                     "title_without_tools", "rules"):
            setattr(adapter, attr, getattr(self, attr))
        if not (self.user_agent_contains or self.headers_present or self.system_contains):
            raise ValueError(f"harness {self.name!r} declares no way to detect it: set user_agent_contains, "
                             "headers_present or system_contains")
        return adapter


class UserRules(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    harnesses: tuple[UserHarness, ...] = Field(min_length=1)

    def adapters(self) -> list[BaseAdapter]:
        return [h.adapter() for h in self.harnesses]


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
    for harness in rules.harnesses:
        harness.adapter()  # raises when a harness cannot be detected
    return rules
