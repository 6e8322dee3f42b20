"""Detection order, side-request kinds, rules as data, and user-declared harnesses from JSON/TOML."""
import json
import re
from pathlib import Path
from typing import get_args

import pytest

from harness_adapters import Registry, default_registry, detect_adapter, load_registry, load_user_rules
from harness_adapters.base import request_system_text
from harness_adapters.opencode import OpenCodeAdapter
from harness_adapters.rules import ElideToolOutputsBeyondN, Rule, VolatileText
from proxy.conversation import Conversation, ToolSpec
from tests.proxy.fake_render import system, user

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("request_json, headers, name", [
    ({"system": [{"type": "text", "text": "x"}]}, {"User-Agent": "claude-cli/2.1.3 (external, cli)"}, "claude_code"),
    ({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli;"}]},
     {}, "claude_code"),
    ({"input": [], "prompt_cache_key": "k"}, {"user-agent": "codex_cli_rs/0.171.0 (Linux)"}, "codex"),
    ({"input": []}, {"originator": "codex_cli_rs"}, "codex"),
    ({"messages": [{"role": "system", "content": "You are opencode, an interactive CLI tool"}]}, {}, "opencode"),
    ({"messages": []}, {"User-Agent": "opencode/1.18.2 ai-sdk/provider-utils"}, "opencode"),
    ({"messages": [{"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nnow"}]},
     {"user-agent": "OpenAI/JS 5.0"}, "openclaw"),
    ({"messages": [], "tools": [BASH]}, {"user-agent": "litellm/1.80"}, "swe_agent"),
    ({"messages": [{"role": "system", "content": "You can interact multiple times with a computer shell"}]},
     {}, "swe_agent"),
    ({"messages": [], "tools": [BASH, BASH]}, {"user-agent": "litellm/1.80"}, "generic"),
    ({"messages": [{"role": "user", "content": "hi"}]}, {"user-agent": "curl/8"}, "generic"),
])
def test_detect(request_json, headers, name):
    assert detect_adapter(request_json, headers).name == name


def test_registry_order_and_lookup():
    assert default_registry.names()[-1] == "generic"
    assert default_registry.get("opencode").name == "opencode"
    with pytest.raises(ValueError, match="no harness adapter named 'nope'"):
        default_registry.get("nope")


def test_system_text_from_every_api_shape():
    assert request_system_text({"system": "A"}) == "A"
    assert request_system_text({"instructions": "B", "input": [{"role": "developer", "content": "C"}]}) == "B\nC"
    assert request_system_text({"messages": [{"role": "system", "content": [{"type": "text", "text": "D"}]}]}) == "D"


def test_side_request_kinds():
    oc = OpenCodeAdapter()
    title = Conversation((system("You are a title generator. You output ONLY a thread title."), user("fix")))
    assert oc.side_request_kind(title) == "title"
    tools = (ToolSpec("bash", "", "{}"),)
    assert oc.side_request_kind(Conversation((user("short, no tools"),))) == "title"
    assert oc.side_request_kind(Conversation((user("fix"),), tools)) is None
    assert oc.side_request_kind(Conversation((system("check"), user("ls " * 2000)))) == "side"
    summariser = Conversation((system("You are a helpful AI assistant tasked with summarizing conversations."),
                               user("history...")))
    assert oc.side_request_kind(summariser) == "compaction"
    assert detect_adapter({}, {}).side_request_kind(Conversation((user("hi"),))) is None


def test_rules_are_frozen_validated_data():
    rule = ElideToolOutputsBeyondN(n=2, placeholder="[cleared]")
    assert rule.kind == "elide_tool_outputs_beyond_n"
    with pytest.raises(ValueError):
        ElideToolOutputsBeyondN(n=-1, placeholder="x")
    with pytest.raises(ValueError):
        rule.n = 3


def test_user_rules_from_json_and_toml(tmp_path):
    spec = {"harnesses": [{"name": "mine", "user_agent_contains": ["my-agent/"], "rules": [
        {"kind": "elide_tool_outputs_beyond_n", "n": 3, "placeholder": "[gone]"},
        {"kind": "replace_trailing_message", "marker": "<<CTX>>"}]}]}
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(spec))
    rules = load_user_rules(path)
    assert [r.kind for r in rules.harnesses[0].rules] == ["elide_tool_outputs_beyond_n", "replace_trailing_message"]
    toml = tmp_path / "rules.toml"
    toml.write_text('[[harnesses]]\nname = "mine"\nuser_agent_contains = ["my-agent/"]\n'
                    '[[harnesses.rules]]\nkind = "elide_tool_outputs_beyond_n"\nn = 3\nplaceholder = "[gone]"\n'
                    '[[harnesses.rules]]\nkind = "replace_trailing_message"\nmarker = "<<CTX>>"\n')
    assert load_user_rules(toml) == rules
    registry = Registry()
    registry.add_first(rules.adapters())
    found = registry.detect({"messages": []}, {"User-Agent": "my-agent/1.0"})
    assert found.name == "mine" and found.rules == rules.harnesses[0].rules
    assert registry.detect({"messages": []}, {"User-Agent": "claude-cli/2.1"}).name == "claude_code"


@pytest.mark.parametrize("spec, field", [
    ({"harnesses": [{"name": "x", "user_agent_contains": ["a"], "rules": [{"kind": "elide_tool_outputs_beyond_n",
                                                                           "n": "many", "placeholder": "p"}]}]},
     "harnesses.0.rules.0.elide_tool_outputs_beyond_n.n"),
    ({"harnesses": [{"name": "x", "user_agent_contains": ["a"], "rules": [{"kind": "drop_everything"}]}]},
     "harnesses.0.rules.0"),
    ({"harnesses": [{"name": "x", "user_agnt": ["a"]}]}, "harnesses.0.user_agnt"),
    ({"harnesses": []}, "harnesses"),
])
def test_bad_user_rules_name_the_field(tmp_path, spec, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"field {field}"):
        load_user_rules(path)


def test_bad_user_rules_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_user_rules(tmp_path / "missing.json")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[harnesses]\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_user_rules(bad)
    undetectable = tmp_path / "u.json"
    undetectable.write_text(json.dumps({"harnesses": [{"name": "ghost"}]}))
    with pytest.raises(ValueError, match="no way to detect"):
        load_user_rules(undetectable)


def test_user_harness_extending_a_builtin_keeps_its_detection(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[[harnesses]]\nname = "opencode-aggressive"\nextends = "opencode"\n'
                    '[[harnesses.rules]]\nkind = "elide_tool_outputs_beyond_n"\nn = 1\n'
                    'placeholder = "[Old tool result content cleared]"\n')
    registry = load_registry(path)
    found = registry.detect({"messages": []}, {"User-Agent": "opencode/1.18"})
    assert found.name == "opencode-aggressive"
    assert [r.n for r in found.rules] == [1]
    assert found.title_markers == OpenCodeAdapter.title_markers
    assert OpenCodeAdapter().rules[0].n == 4  # the built-in is untouched
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"harnesses": [{"name": "x", "extends": "vscode"}]}))
    with pytest.raises(ValueError, match="extends 'vscode' is not a built-in adapter"):
        load_user_rules(bad)


def test_the_rules_file_in_the_docs_loads(tmp_path):
    """docs/PROXY.md's example is a working file, and its table lists exactly the rule kinds there are."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "PROXY.md").read_text()
    example = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "rules.toml").write_text(example)
    (harness,) = load_user_rules(tmp_path / "rules.toml").harnesses
    assert any(isinstance(r, VolatileText) and r.pattern == r"Current time: (\S)" for r in harness.rules)
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", doc, re.M))
    declared = {kind.model_fields["kind"].default for kind in get_args(get_args(Rule)[0])}
    assert documented == declared
