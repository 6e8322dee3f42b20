import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.prompt.output_parser import (
    OutputParser, TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, ToolCallStart, generation_opens_think,
    parse_tool_call,
)


def feed(text, pieces=None, **kw):
    """Every event of feeding text in the given piece sizes (default: one char at a time), and the parser."""
    parser = OutputParser(**{"thinking_open": False, **kw})
    events = []
    step = pieces or 1
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish(), parser


def run(text, pieces=None, **kw):
    """The whole events (a tool call as its final ToolCall, streamed or not), adjacent text deltas merged."""
    events, parser = feed(text, pieces, **kw)
    merged = []
    for ev in events:
        if isinstance(ev, (ToolCallStart, ToolCallDelta)):
            continue
        if merged and type(ev) is type(merged[-1]) and not isinstance(ev, ToolCall):
            merged[-1] = type(ev)(merged[-1].text + ev.text)
        else:
            merged.append(ev)
    return merged, parser


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_thinking_text_and_tool_call_in_any_chunking(step):
    out = ('<think>\nLet me look.\n</think>\n\nI will list files.\n<tool_call>\n'
           '{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>')
    events, parser = run(out, step)
    assert events == [
        ThinkingDelta("Let me look."),
        TextDelta("I will list files."),
        ToolCall(0, "bash", json.dumps({"cmd": "ls -la"}), streamed=True),
        ToolCall(1, "read", json.dumps({"path": "a.py"}), streamed=True),
    ]
    assert parser.tool_calls == 2


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_tool_call_arguments_stream_as_written(step):
    args = '{"cmd": "echo \\"}{\\" [x]", "n": [1, {"a": "}"}], "s": "é"}'
    text = f'go <tool_call>\n{{"name": "bash", "arguments": {args}}}\n</tool_call>'
    events, _ = feed(text, step)
    calls = [e for e in events if isinstance(e, (ToolCallStart, ToolCallDelta, ToolCall))]
    assert calls[0] == ToolCallStart(0, "bash") and calls[-1] == ToolCall(0, "bash", args, streamed=True)
    deltas = [e.text for e in calls[1:-1]]
    assert all(isinstance(e, ToolCallDelta) and e.index == 0 for e in calls[1:-1])
    assert "".join(deltas) == args and json.loads(args)["n"][1] == {"a": "}"}  # braces in strings are text
    if step == 1:
        assert len(deltas) == len(args)                    # one piece per character fed, none held back


def test_generation_prompt_already_opened_think():
    assert generation_opens_think("<|im_start|>assistant\n<think>\n")
    assert not generation_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    events, _ = run("reasoning here\n</think>\n\nanswer", thinking_open=True)
    assert events == [ThinkingDelta("reasoning here"), TextDelta("answer")]


def test_malformed_tool_json_degrades_to_text():
    events, parser = run('ok <tool_call>\n{"name": "bash", "arguments": [oops]\n</tool_call>')
    assert events == [TextDelta('ok <tool_call>\n{"name": "bash", "arguments": [oops]\n</tool_call>')]
    assert parser.tool_calls == 0


def test_a_call_that_started_streaming_ends_as_a_call():
    events, parser = run('<tool_call>\n{"name": "bash", "arguments": {oops}\n</tool_call>')
    assert events == [ToolCall(0, "bash", "{oops}", streamed=True)] and parser.tool_calls == 1
    events, _ = run('<tool_call>\n{"name": "bash", "arguments": {"cmd": "l')   # cut off by max_tokens
    assert events == [ToolCall(0, "bash", '{"cmd": "l', streamed=True)]


def test_unterminated_tool_call_becomes_text_at_finish():
    events, _ = run('<tool_call>\n{"name": "bash"')
    assert events == [TextDelta('<tool_call>\n{"name": "bash"')]


def test_stop_sequence_ends_output_even_across_pieces():
    events, parser = run("hello STOP world", 2, stop_sequences=("STOP",))
    assert events == [TextDelta("hello")]
    assert parser.stopped == "STOP"
    assert parser.feed("more") == []


def test_partial_tag_that_never_completes_is_text():
    events, _ = run("a < b and <thin")
    assert events == [TextDelta("a < b and <thin")]


def test_tools_not_parsed_when_disabled():
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    events, _ = run(text, parse_tools=False)
    assert events == [TextDelta(text)]


def test_parse_tool_call_variants():
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')
    assert parse_tool_call('{"name": "f", "arguments": [1]}') is None
    assert parse_tool_call('{"arguments": {}}') is None
    xml = "<function=bash>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>"
    assert parse_tool_call(xml) == ("bash", json.dumps({"cmd": "ls -la", "n": 3}))


def test_unicode_and_whitespace_inside_text_survive():
    events, _ = run("  héllo\n\n  wörld  \n")
    assert events == [TextDelta("  héllo\n\n  wörld")]


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_blank_lines_before_a_segment_go_and_its_first_lines_indentation_stays(step):
    """An answer that opens with indented code keeps the indent (what the model wrote, and what the template
    renders back after "</think>\n\n"); whole blank lines at a segment's start go, spaces on them too."""
    events, _ = run("<think>\n  plan\n</think>\n\n    return x\n", step)
    assert events == [ThinkingDelta("  plan"), TextDelta("    return x")]
    events, _ = run("\n  \r\n\t  if a:\n        b", step)
    assert events == [TextDelta("\t  if a:\n        b")]
    events, _ = run('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n  done', step)
    assert events == [ToolCall(0, "f", "{}", streamed=True), TextDelta("  done")]
    events, _ = run("   ", step)  # nothing visible: nothing goes out
    assert events == []
    events, _ = run("</think>\n\n Hello", step, thinking_open=True)  # a token's space, not an indent
    assert events == [TextDelta("Hello")]


def test_one_tool_call_when_parallel_calls_are_off():
    two = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    events, parser = run(two, 5, max_tool_calls=1)
    assert events == [ToolCall(0, "a", "{}", streamed=True)] and parser.ended and parser.stopped is None


def test_a_call_that_can_be_no_call_goes_out_as_text_at_once():
    parser = OutputParser(thinking_open=False)
    assert parser.feed("<tool_call>") == [] and parser.feed("\n ") == []  # may still open a call
    assert parser.feed("I") == [TextDelta("<tool_call>\n I")]  # neither JSON nor <function=: shown now
    rest = parser.feed(" think</tool_call> so") + parser.finish()
    assert "".join(e.text for e in rest) == " think</tool_call> so" and parser.tool_calls == 0
    for opening in ('<tool_call>\n{"na', "<tool_call>\n<func", '<tool_call><function=bash>\n'):
        assert OutputParser(thinking_open=False).feed(opening) == []  # held: it may still be a call


@settings(max_examples=200, deadline=None)
@given(before=st.text("ab \n", max_size=6), body=st.text("xy {}<=/\n\t ", max_size=12),
       close=st.booleans(), after=st.text("ab \n", max_size=6), step=st.integers(1, 8))
def test_text_shown_early_is_the_text_shown_at_the_end(before, body, close, after, step):
    """Whatever the chunking, a call that parses is a call, and everything else reads as the text it was."""
    text = before + "<tool_call>" + body + ("</tool_call>" if close else "") + after
    events, parser = run(text, step)
    if parse_tool_call(body) is not None and close:
        assert parser.tool_calls == 1
        return
    if any(isinstance(e, ToolCall) for e in events):  # an unclosed call whose arguments began streaming
        return
    assert events == run(text, len(text) or 1, parse_tools=False)[0]


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_a_continued_text_keeps_its_first_whitespace(step):
    """After a prefill ("The answer") the output's first space or newline is the text's own."""
    events, _ = run(" is 42.\n\n  Done", step, continues=True)
    assert events == [TextDelta(" is 42.\n\n  Done")]
    events, _ = run("\n- b", step, continues=True)
    assert events == [TextDelta("\n- b")]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stop_sequences_match_the_answer_not_the_thinking(step):
    """Anthropic applies stop sequences to the answer: one inside the thinking is thinking, and one that only the
    thinking's tail and the answer's start spell together, or that is the think-end marker itself, does not fire."""
    text = "plan: say END.\nthen</think>\n\nfinal answer END rest"
    events, parser = run(text, step, thinking_open=True, stop_sequences=("END", "thenfinal", "</think>"))
    assert events == [ThinkingDelta("plan: say END.\nthen"), TextDelta("final answer")]
    assert parser.stopped == "END"
    events, parser = run("a</think>b", step, thinking_open=True, stop_sequences=("a</think>b", "</think>"))
    assert events == [ThinkingDelta("a"), TextDelta("b")] and parser.stopped is None
