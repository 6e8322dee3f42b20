"""Scripted replies: which turn answers, how it is rendered into forced ids, and that the parser reads it back."""
import json
from pathlib import Path

import pytest

from proxy.conversation import Conversation, Message, TextPart, ToolCallPart, ToolResultPart, ToolSpec
from proxy.prompt.output_parser import OutputParser, TextDelta, ThinkingDelta, ToolCall, generation_opens_think
from proxy.replay.scripted import OPENCLAW_INTERNAL, Reply, Script, decode_header, encode_header, forced_ids

SCRIPT = Path(__file__).resolve().parents[3] / "fixtures" / "sessions" / "script.json"


def _tools(*names):
    return tuple(ToolSpec(n, "", '{"type": "object"}') for n in names)


def _conv(*messages, tools=("Bash", "Read", "Edit", "Grep")):
    return Conversation(tuple(messages), _tools(*tools) if tools else ())


USER = Message("user", (TextPart("Fix the bug"),))


def _step(i):
    return (Message("assistant", (ToolCallPart("Bash", '{"command": "ls"}', f"c{i}"),)),
            Message("tool", (ToolResultPart("out", f"c{i}"),)))


def test_turn_is_counted_from_the_last_real_user_message():
    script = Script.load(SCRIPT, workdir="/w")
    assert script.reply(_conv(USER)).tool_calls[0][0] == "Bash"
    second = script.reply(_conv(USER, *_step(0)))
    assert second.tool_calls == (("Read", '{"file_path": "/w/README.md"}'),)
    history = [m for i in range(3) for m in _step(i)]
    again = script.reply(_conv(USER, *history, USER))  # a new prompt starts the steps over
    assert again.tool_calls[0][0] == "Bash"


def test_openclaw_internal_context_is_not_a_new_user_turn():
    script = Script.load(SCRIPT, workdir="/w")
    internal = Message("user", (TextPart(OPENCLAW_INTERNAL + "\nruntime notes"),))
    reply = script.reply(_conv(USER, *_step(0), internal))
    assert reply.tool_calls[0][0] == "Read"


def test_the_script_always_ends():
    script = Script.load(SCRIPT, workdir="/w")
    history = [m for i in range(len(script.turns) + 5) for m in _step(i)]
    end = script.reply(_conv(USER, *history))
    assert end.tool_calls == () and end.text == script.final


def test_side_requests_title_and_compaction():
    script = Script.load(SCRIPT, workdir="/w")
    assert script.reply(_conv(USER, tools=())).text == script.title
    summary = script.reply(_conv(USER), "compaction")
    assert summary.text.startswith("Summary:") and "/w" in summary.text


def test_exact_name_beats_case_blind_and_sole_needs_a_single_tool():
    script = Script({"turns": [{"tool": [{"name": "Read", "arguments": {"file_path": "x"}},
                                         {"name": "read", "arguments": {"filePath": "x"}}]},
                               {"tool": [{"name": "bash", "sole": True, "arguments": {"command": "done"}}]}]})
    assert script.reply(_conv(USER, tools=("read", "bash"))).tool_calls == (("read", '{"filePath": "x"}'),)
    assert script.reply(_conv(USER, tools=("Read",))).tool_calls == (("Read", '{"file_path": "x"}'),)
    step = (Message("assistant", (ToolCallPart("bash", "{}", "a"),)), Message("tool", (ToolResultPart("", "a"),)))
    assert script.reply(_conv(USER, *step, tools=("bash",))).tool_calls == (("bash", '{"command": "done"}'),)
    assert script.reply(_conv(USER, *step, tools=("bash", "read"))).tool_calls == ()


def test_bad_scripts_are_refused():
    with pytest.raises(ValueError, match="turns"):
        Script({"turns": []})
    for turns, field in (([{"tool": 5}], r"turns\[0\]\.tool must"), ([{"text": "a"}, {"txt": "b"}], r"turns\[1\] must"),
                         ([{"tool": [{"name": "ls", "arguments": "ls"}]}], r"turns\[0\]\.tool\[0\]: 'arguments'"),
                         ([{"thinking": ["x"]}], r"turns\[0\]\.thinking must be a string")):
        with pytest.raises(ValueError, match=field):
            Script({"turns": turns})


def test_a_turn_without_a_tool_answers_its_text():
    script = Script({"turns": [{"text": "Let me think about it."}], "final": "Still thinking."})
    assert script.reply(_conv(USER)) == Reply(text="Let me think about it.")


def test_a_script_file_error_names_the_file(tmp_path):
    bad = tmp_path / "script.json"
    bad.write_text("turns: [{text: hi}]")
    with pytest.raises(ValueError, match=f"{bad} is not valid JSON"):
        Script.load(bad)
    bad.write_text('{"turns": [{"tool": 5}]}')
    with pytest.raises(ValueError, match=rf"{bad}: turns\[0\]\.tool must"):
        Script.load(bad)


def test_header_round_trip():
    reply = Reply("think", "text", (("Bash", '{"command": "ls -la"}'),))
    assert decode_header(encode_header(reply)) == reply
    with pytest.raises(ValueError, match="x-killick-force-response"):
        decode_header("not base64 json")


def test_forced_ids_parse_back_into_the_reply():
    """The ids a scripted reply is forced as are what the model would write; the parser recovers the reply."""
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.prompt.render import ChatRenderer

    tok = load_tokenizer(None)
    renderer = ChatRenderer(tok)
    conv = _conv(USER)
    prompt = renderer.render(conv).text
    reply = Reply("List first.", "Listing.", (("Bash", json.dumps({"command": "ls"})),))
    ids = forced_ids(renderer, tok, conv, prompt, reply)
    assert ids[-1] in tok.eos_ids
    parser = OutputParser(thinking_open=generation_opens_think(prompt))
    events = parser.feed(tok.decode([i for i in ids if i not in tok.eos_ids])) + parser.finish()
    thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    assert thinking.strip() == "List first." and text.strip() == "Listing."
    assert calls == [("Bash", {"command": "ls"})]


def test_after_a_compaction_with_our_summary_the_script_answers_final():
    """Recorded with Codex auto-compaction: restarting the steps after our own summary looped forever."""
    script = Script.load(SCRIPT, workdir="/w")
    summary = Message("user", (TextPart("Another language model started to solve this problem...\n" +
                                        script.summary),))
    assert script.reply(_conv(USER, summary)).text == script.final
    assert script.reply(_conv(summary, USER)).tool_calls[0][0] == "Bash"  # a new prompt after it: steps again
