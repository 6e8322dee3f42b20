"""The prompt of every request of the bundled recordings (fixtures/sessions/), rendered as `killick serve`
renders it: with `--prompt-layout template` the chat template's own prompt, which the stable-first layout leaves
alone (digests in data/recorded_render_digests.json, written by `PYTHONPATH=. python
tests/proxy/prompt/test_layout_recorded.py template`; only a change meant to change prompts rewrites them)."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "sessions"
DIGESTS = Path(__file__).resolve().parent / "data" / "recorded_render_digests.json"


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def render_digests(layout: str | None = None) -> dict:
    """recording -> "sha of the prompt text, sha of its token ids" per request."""
    from proxy.policy.planner import HarnessNormalizer
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.log import conversation, load

    renderer = ChatRenderer(load_tokenizer(None))
    harness = HarnessNormalizer() if layout is None else HarnessNormalizer(layout=layout)
    out = {}
    for path in sorted(FIXTURES.glob("*.jsonl.gz")):
        rows = []
        for entry in load([path]):
            conv = harness.normalize(conversation(entry), entry.headers, entry.body)
            rendered = renderer.render(conv)
            rows.append(f"{_sha(rendered.text)} {_sha(json.dumps(rendered.ids))}")
        out[path.name.split(".jsonl")[0]] = rows
    return out


if __name__ == "__main__":
    DIGESTS.write_text(json.dumps(render_digests(*sys.argv[1:2]), indent=1) + "\n")


def test_template_layout_renders_every_recorded_prompt_as_before():
    assert render_digests("template") == json.loads(DIGESTS.read_text())


def test_stable_layout_only_reorders_the_system_turn():
    """Same characters in the system turn once the model is named as served, the volatile lines after the
    tools, everything after it as before."""
    from collections import Counter

    from harness_adapters.layout import name_served_model
    from proxy.policy.planner import HarnessNormalizer
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.log import conversation, load

    renderer = ChatRenderer(load_tokenizer(None))
    moved = renamed = 0
    for path in sorted(FIXTURES.glob("*.jsonl.gz")):
        for entry in load([path]):
            texts = []
            for layout in ("template", "stable"):
                harness = HarnessNormalizer(layout=layout, served_model="served-model")
                conv = harness.normalize(conversation(entry), entry.headers, entry.body)
                if layout == "template":
                    named = name_served_model(conv, harness.adapter(conv, {}).rules, "served-model")
                    renamed += named != conv
                    conv = named
                rendered = renderer.render(conv)
                texts.append(rendered.text)
            (old, new), (a, b) = texts, (t.find("<|im_end|>") for t in texts)
            assert new[b:] == old[a:] and Counter(new[:b].replace("\n", "")) == Counter(old[:a].replace("\n", ""))
            volatile = rendered.of_kind("volatile")
            if volatile:
                moved += 1
                (tools,) = rendered.of_kind("tools")
                assert tools.end <= volatile[0].start and volatile[0].end <= rendered.of_kind("system")[0].end
    assert moved >= 40  # Claude Code, OpenCode and OpenClaw requests carry volatile lines
    assert renamed >= 40  # and name their model


@pytest.mark.parametrize("name", ["claude", "opencode", "codex"])
def test_sessions_in_other_directories_share_most_of_their_first_prompt(name):
    """fixtures/sharing/: the first prompt of sessions b, c, d (other working directories) against a's. Stable
    first, they part after >= 85% of the prompt; in the template's order Claude Code's part after 3%."""
    from engine.common_prefix import common_prefix_len
    from proxy.policy.planner import HarnessNormalizer
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.log import conversation, first_turns, load

    renderer = ChatRenderer(load_tokenizer(None))
    entries = [e for e in first_turns(load([FIXTURES.parent / "sharing" / f"{name}.jsonl.gz"]), 1)
               if e.metrics.get("kind") == "main" and "~" not in e.session][:4]
    shares = {}
    for layout in ("stable", "template"):
        ids = [renderer.render(HarnessNormalizer(layout=layout).normalize(conversation(e), e.headers, e.body)).ids
               for e in entries]
        shares[layout] = [common_prefix_len(ids[0], other) / len(other) for other in ids[1:]]
    assert len(shares["stable"]) == 3 and min(shares["stable"]) >= 0.85, shares
    if name == "claude":
        assert max(shares["template"]) < 0.05, shares


def test_a_continue_with_another_model_keeps_the_system_turn():
    """fixtures/sharing/: session b, then `claude --continue --model killick-other` (another model line and a
    new git status). Stable first, with the served model named and b's snapshot kept, the continue's system
    turn is b's to the token and it parts from b's last prompt in the history (where the re-sent replies
    lost their reasoning), leaving < 2,000 tokens to prefill; in the template's order it parts at the model
    line, before the tools."""
    from engine.common_prefix import common_prefix_len
    from proxy.policy.planner import HarnessNormalizer
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.log import conversation, load

    renderer = ChatRenderer(load_tokenizer(None))
    sharing = FIXTURES.parent / "sharing"
    (resumed,) = load([sharing / "claude-continue.jsonl.gz"])
    session = [e for e in load([sharing / "claude.jsonl.gz"]) if e.session == resumed.session.split("~")[0]]
    assert len(session) == 8 and resumed.body["model"] != session[0].body["model"]
    for layout in ("stable", "template"):
        harness = HarnessNormalizer(layout=layout, served_model=session[0].body["model"])

        def admitted(e):  # normalised, then its snapshot kept as the request's admission does
            out = harness.normalize(conversation(e), e.headers, e.body)
            harness.snapshots.commit(out.extras.get("snapshot"))
            return out

        last, cont = [renderer.render(admitted(e)) for e in session + [resumed]][-2:]
        shared = common_prefix_len(last.ids, cont.ids)
        (system,) = cont.of_kind("system")
        if layout == "stable":
            assert shared > system.end and len(cont.ids) - shared < 2000, (shared, len(cont.ids))
        else:
            assert shared < 2000, shared
