"""detect() on every request of the real recorded sessions (fixtures/sessions/, see fixtures/README.md)."""
import gzip
import json
from pathlib import Path

import pytest

from harness_adapters import default_registry
from tests.proxy.fake_render import engine_usage

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sessions"
EXPECTED = {"claude": "claude_code", "opencode": "opencode", "codex": "codex", "mini-swe-agent": "swe_agent",
            "openclaw": "openclaw", "codex-compact": "codex"}


def _lines(name):
    with gzip.open(FIXTURES / f"{name}.jsonl.gz", "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.mark.parametrize("name", sorted(p.name.split(".jsonl")[0] for p in FIXTURES.glob("*.jsonl.gz")))
def test_every_recorded_request_is_detected(name):
    lines = _lines(name)
    assert len(lines) >= (6 if name == "codex-compact" else 8)
    for line in lines:
        adapter = default_registry.detect(line["body"], line["headers"])
        assert adapter.name == EXPECTED[name], (line["headers"].get("user-agent"), line["metrics"].get("kind"))


def test_mini_swe_agent_is_known_by_its_task_prompt_not_only_litellm():
    line = _lines("mini-swe-agent")[0]
    headers = {k.lower(): v for k, v in line["headers"].items()}
    assert headers["user-agent"].startswith("OpenAI/Python")
    assert default_registry.detect(line["body"], {"user-agent": "OpenAI/Python 3.57.0"}).name == "swe_agent"
    plain = {**line["body"], "messages": [{"role": "user", "content": "hello"}]}
    assert default_registry.detect(plain, {"user-agent": "OpenAI/Python 3.57.0"}).name != "swe_agent"


def test_codex_is_known_by_originator_alone():
    line = _lines("codex")[0]
    assert {k.lower(): v for k, v in line["headers"].items()}.get("originator") == "codex_exec"
    assert default_registry.detect({"input": []}, {"originator": "codex_exec"}).name == "codex"


def test_claude_code_default_arguments_do_not_break_the_append():
    """Recorded: Claude Code re-sends the model's Edit call with `"replace_all": false` added. With the
    defaults dropped, the next prompt extends the previous prompt + generated reply exactly."""
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.prompt.render import ChatRenderer
    from proxy.replay.log import load
    from proxy.apis.anthropic.schema import MessagesRequest, to_conversation
    from proxy.replay.scripted import forced_ids

    tok = load_tokenizer(None)
    renderer, planner = ChatRenderer(tok), PolicyPlanner()
    entries = load([FIXTURES / "claude.jsonl.gz"])[:6]
    assert entries[4].reply().tool_calls[0][0] == "Edit"
    classes = []
    for e in entries:
        conv = planner.normalize(to_conversation(MessagesRequest.model_validate(e.body)), e.headers, e.body)
        rendered = renderer.render(conv)
        turn = planner(conv, rendered, e.headers, e.body)
        classes.append(turn.record.edit_class)
        ids = forced_ids(renderer, tok, conv, rendered.text, e.reply())
        planner.finish(turn, ids, engine_usage(turn, ids))
    assert e.metrics["edit_class"] == "reply_rerendered"  # the recording server kept the default arguments
    assert classes == ["first"] + ["append"] * 5
