"""Edit point and edit class of a turn against the previous one, on renders shaped like the real template."""
from harness_adapters import Compaction, ElideObservationsExceptLastN
from proxy.conversation import Conversation, ToolSpec
from proxy.policy.diff import PreviousTurn, diff_turn
from tests.proxy.fake_render import assistant, render, reply_ids, system, tool, user

TOOLS = (ToolSpec("bash", "run a command", '{"type": "object"}'),)
SYS = system("You are a coding agent.")


def prev_of(conv: Conversation, reply) -> PreviousTurn:
    r = render(conv)
    return PreviousTurn(tuple(r.ids), tuple(reply_ids(reply)), r.segments, conv)


def test_first_turn_has_no_previous():
    e = diff_turn(None, render(Conversation((SYS, user("hi")), TOOLS)))
    assert (e.edit_point, e.edit_class) == (0, "first")


def test_append_after_generated_reply():
    a1 = assistant("ok", thinking="plan", calls=(("bash", '{"cmd": "ls"}', "c1"),))
    c1 = Conversation((SYS, user("list files")), TOOLS)
    c2 = Conversation(c1.messages + (a1, tool("a.py")), TOOLS)
    prev = prev_of(c1, a1)
    e = diff_turn(prev, render(c2))
    assert e.edit_class == "append"
    assert e.edit_point == len(prev.ids)


def test_retry_of_the_same_request_is_a_rewind():
    c1 = Conversation((SYS, user("q")), TOOLS)
    prev = prev_of(c1, assistant("a"))
    e = diff_turn(prev, render(c1))
    assert (e.edit_class, e.edit_point) == ("rewind", len(prev.prompt_ids))


def test_system_and_tools_changes():
    c1 = Conversation((SYS, user("q")), TOOLS)
    prev = prev_of(c1, assistant("a"))
    dated = Conversation((system("You are a coding agent. Today is Monday."), user("q")), TOOLS)
    assert diff_turn(prev, render(dated)).edit_class == "system_changed"
    more = Conversation(c1.messages, TOOLS + (ToolSpec("edit", "edit a file", "{}"),))
    e = diff_turn(prev, render(more))
    assert e.edit_class == "tools_changed"
    assert e.edit_point < render(c1).segments[-1].start


def test_trailing_internal_context_replaced():
    marker = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> time=10:00"
    a1 = assistant("", calls=(("bash", '{"cmd": "ls"}', "c1"),))
    c1 = Conversation((SYS, user("fix bug"), user(marker)), TOOLS)
    c2 = Conversation((SYS, user("fix bug"), a1, tool("a.py"), user(marker.replace("10:00", "10:01"))), TOOLS)
    prev = prev_of(c1, a1)
    e = diff_turn(prev, render(c2))
    r1 = render(c1)
    tail = next(s for s in r1.segments if s.kind == "message" and s.message_index == 2)
    assert (e.edit_class, e.message_index) == ("tail_replacement", 2)
    assert tail.start <= e.edit_point < tail.end


def test_old_tool_output_cleared():
    a1 = assistant("", calls=(("bash", '{"cmd": "cat a.py"}', "c1"),))
    a2 = assistant("", calls=(("bash", '{"cmd": "cat b.py"}', "c2"),))
    c2 = Conversation((SYS, user("read"), a1, tool("print('a')\n" * 20), a2, tool("b")), TOOLS)
    prev = prev_of(c2, assistant("done"))
    pruned = Conversation((SYS, user("read"), a1, tool("[Old tool result content cleared]"), a2, tool("b"),
                           assistant("done"), user("next")), TOOLS)
    e = diff_turn(prev, render(pruned))
    assert (e.edit_class, e.message_index, e.segment_kind) == ("tool_output_elision", 3, "tool_response")


def test_observation_elided_in_user_message_needs_the_rule():
    a = assistant("```bash\nls\n```")
    c = Conversation((SYS, user("task"), a, user("<output>\nbig listing\n</output>"), a, user("<output>x</output>")))
    prev = prev_of(c, a)
    short = user("Old environment output: (2 lines omitted)")
    edited = Conversation(c.messages[:3] + (short,) + c.messages[4:] + (a, user("y")))
    rule = ElideObservationsExceptLastN(n=1, placeholder="Old environment output:")
    assert diff_turn(prev, render(edited), edited, (rule,)).edit_class == "tool_output_elision"
    assert diff_turn(prev, render(edited), edited).edit_class == "history_edit"


def test_old_thinking_stripped_inside_history():
    a1 = assistant("reading", thinking="I should look at the file first", calls=(("bash", '{"cmd": "ls"}', "c1"),))
    c = Conversation((SYS, user("q"), a1, tool("out")), TOOLS)
    prev = prev_of(c, assistant("done"))
    stripped = Conversation((SYS, user("q"), assistant("reading", calls=(("bash", '{"cmd": "ls"}', "c1"),)),
                             tool("out"), assistant("done"), user("more")), TOOLS)
    e = diff_turn(prev, render(stripped))
    assert (e.edit_class, e.message_index, e.segment_kind) == ("thinking_stripped", 2, "think")


def test_generated_reasoning_not_sent_back():
    c1 = Conversation((SYS, user("q")), TOOLS)
    gen = assistant("answer", thinking="long reasoning")
    prev = prev_of(c1, gen)
    c2 = Conversation(c1.messages + (assistant("answer"), user("thanks")), TOOLS)
    e = diff_turn(prev, render(c2))
    assert e.edit_class == "thinking_stripped"
    assert e.edit_point == len(prev.prompt_ids)  # right after the generation prompt's "<think>\n"


def test_reply_rerendered_after_reasoning():
    c1 = Conversation((SYS, user("q")), TOOLS)
    prev = prev_of(c1, assistant("answer  with two spaces", thinking="r"))
    c2 = Conversation(c1.messages + (assistant("answer with two spaces", thinking="r"), user("ok")), TOOLS)
    assert diff_turn(prev, render(c2)).edit_class == "reply_rerendered"


def test_compaction_and_new_history():
    c = Conversation((SYS, user("build the thing"), assistant("step 1"), user("go on")), TOOLS)
    prev = prev_of(c, assistant("step 2"))
    summary = "This session is being continued from a previous conversation. Summary: step 1, step 2."
    compacted = Conversation((SYS, user(summary)), TOOLS)
    rule = Compaction(history_markers=("This session is being continued from a previous conversation",))
    e = diff_turn(prev, render(compacted), compacted, (rule,))
    assert e.edit_class == "compaction"
    assert diff_turn(prev, render(compacted), compacted).edit_class == "new_history"
    other = Conversation((SYS, user("something else entirely")), TOOLS)
    assert diff_turn(prev, render(other), other, (rule,)).edit_class == "new_history"


def test_old_summary_in_history_is_not_a_new_compaction():
    summary = user("This session is being continued from a previous conversation. S.")
    marker = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
    c = Conversation((SYS, summary, assistant("ok"), user(marker + " 1")), TOOLS)
    prev = prev_of(c, assistant("x"))
    c2 = Conversation((SYS, summary, assistant("ok"), assistant("x"), user(marker + " 2")), TOOLS)
    rule = Compaction(history_markers=("This session is being continued",))
    assert diff_turn(prev, render(c2), c2, (rule,)).edit_class == "tail_replacement"
