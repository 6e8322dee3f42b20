"""Multi-turn request sequences shaped like each harness's traffic (fixtures/harness_requests/), through the whole
policy: detect -> normalise -> render -> session -> diff -> anchors. Asserts edit classes, where prefill resumes,
and that side requests leave the main conversation alone."""
import json

from harness_adapters import detect_adapter
from proxy.conversation import Conversation, Message, TextPart, ToolSpec
from proxy.policy.anchors import past_opening_token
from proxy.policy.cache_policy import CachePolicy
from tests.proxy.fake_render import assistant, play, render, reply_ids, system, tool, user

TOOLS = tuple(ToolSpec(n, f"{n} tool", json.dumps({"type": "object", "properties": {"x": {"type": "string"}}}))
              for n in ("bash", "read", "edit"))
SID = "5e2b7c1a-0d4f-4b8e-9c3a-aabbccddeeff"


def call(k: int):
    return (("bash", json.dumps({"cmd": f"step {k}"}), f"call_{k}"),)


def message_start(conv: Conversation, index: int) -> int:
    """Where a replacement of message `index` starts to differ: after the opening token all messages share."""
    r = render(conv)
    return past_opening_token(r, next(s.start for s in r.segments if s.kind == "message" and s.message_index == index))


def turn(policy, request, headers, conv, reply):
    adapter = detect_adapter(request, headers)
    plan, record = play(policy, adapter, conv, reply, request, headers)
    return adapter, plan, record


def test_claude_code_session_with_billing_line_title_and_compaction():
    policy = CachePolicy()
    headers = {"user-agent": "claude-cli/2.1.3 (external, cli)"}
    request = {"metadata": {"user_id": f"user_{'0' * 64}_account__session_{SID}"}}
    bill = "x-anthropic-billing-header: cc_version=2.1.3.f00; cc_entrypoint=cli;"
    sys_msg = Message("system", (TextPart(bill), TextPart("You are Claude Code, Anthropic's official CLI.")))
    msgs = (sys_msg, user("fix the failing test"))
    records = []
    for k in range(4):
        reply = assistant(f"running step {k}", thinking=f"I think {k}", calls=call(k))
        adapter, plan, rec = turn(policy, request, headers, Conversation(msgs, TOOLS), reply)
        records.append(rec)
        msgs += (reply, tool(f"output {k}"))
        if k == 1:  # the title side request, no tools, between main turns
            _, side, srec = turn(policy, request, headers, Conversation((user("fix the failing test"),)),
                                 assistant("Fix failing test"))
            assert (side.kind, side.session_key, srec.edit_class) == ("title", f"{SID}#title", "first")
    assert adapter.name == "claude_code"
    assert [r.edit_class for r in records] == ["first", "append", "append", "append"]
    assert all(r.session_key == SID for r in records)
    for r in records[1:]:  # resumes at the end of the previous generation: only the new tool result is prefilled
        assert r.anchor_used == r.edit_point
        assert r.expected_reprefill == r.prompt_tokens - r.edit_point
    summary_request = Conversation(msgs + (user("Your task is to create a detailed summary of the conversation "
                                                "so far, paying close attention to..."),), TOOLS)
    _, side, srec = turn(policy, request, headers, summary_request, assistant("<summary>...</summary>"))
    assert (side.kind, side.session_key) == ("compaction", f"{SID}#compaction")
    assert side.checkpoint_positions == ()  # one-off: the system + tools prefix is already anchored
    assert policy.store.get(SID).turns == 4  # the summary request did not touch the main state
    compacted = Conversation((sys_msg, user("This session is being continued from a previous conversation that "
                                            "ran out of context. Summary: tests fixed up to step 3.")), TOOLS)
    _, plan, rec = turn(policy, request, headers, compacted, assistant("continuing"))
    r = render(plan.conversation)
    prefix = next(s.end for s in r.segments if s.kind == "system")
    assert (rec.edit_class, rec.anchor_used) == ("compaction", past_opening_token(r, prefix))


def test_claude_code_billing_hash_does_not_break_the_shared_prefix():
    policy = CachePolicy()
    plans = []
    for hexes, sid in (("a1f", "s-one"), ("7c0", "s-two")):
        bill = f"x-anthropic-billing-header: cc_version=2.1.3.{hexes}; cc_entrypoint=cli;"
        conv = Conversation((Message("system", (TextPart(bill), TextPart("You are Claude Code."))),
                             user(f"task {sid}")), TOOLS)
        _, plan, rec = turn(policy, {"metadata": {"user_id": json.dumps({"session_id": sid})}}, {}, conv,
                            assistant("ok"))
        assert (plan.session_key, rec.edit_class) == (sid, "first")
        plans.append((plan, rec))
    (a, _), (b, second) = plans
    prefix = next(s.end for s in a.segments if s.kind == "system")
    assert a.prompt_ids[:prefix] == b.prompt_ids[:prefix]  # the billing hex differed: the system turn did not
    assert prefix in a.checkpoint_positions
    # the second conversation starts from the first one's system turn and the "<|im_start|>" after it
    assert second.anchor_used == prefix + 1 and a.prompt_ids[prefix] == b.prompt_ids[prefix]
    assert second.expected_reprefill == len(b.prompt_ids) - prefix - 1


def test_claude_code_subagents_sharing_the_session_id_are_threads_of_their_own():
    policy = CachePolicy()
    request = {"metadata": {"user_id": json.dumps({"session_id": SID})}}
    headers = {"user-agent": "claude-cli/2.1.3"}
    main = (system("You are Claude Code."), user("refactor everything"))
    agent = (system("You are a file search specialist."), user("find the parser"))
    keys = {}
    for k in range(3):
        for name in ("main", "agent"):
            msgs = main if name == "main" else agent
            reply = assistant(f"{name} {k}", calls=call(k))
            _, plan, rec = turn(policy, request, headers, Conversation(msgs, TOOLS), reply)
            assert rec.edit_class == ("first" if k == 0 else "append")
            assert keys.setdefault(name, plan.session_key) == plan.session_key
            msgs += (reply, tool(f"{name} out {k}"))
            main, agent = (msgs, agent) if name == "main" else (main, msgs)
    assert keys == {"main": SID, "agent": f"{SID}~2"}
    compacted = Conversation((system("You are Claude Code."), user("This session is being continued from a "
                                                                   "previous conversation. Summary: ...")), TOOLS)
    _, plan, rec = turn(policy, request, headers, compacted, assistant("ok"))
    assert (plan.session_key, rec.edit_class) == (SID, "compaction")


def test_claude_code_tools_added_mid_session_stay_in_the_same_thread():
    """An MCP server connecting adds tools (the edit falls before the first message): still the same
    conversation, not a sub-agent thread; the diff names it."""
    policy = CachePolicy()
    request = {"metadata": {"user_id": json.dumps({"session_id": SID})}}
    headers = {"user-agent": "claude-cli/2.1.3"}
    msgs = (system("You are Claude Code."), user("refactor everything"))
    for k, tools in enumerate((TOOLS[:1], TOOLS[:1], TOOLS)):
        reply = assistant(f"step {k}", calls=call(k))
        _, plan, rec = turn(policy, request, headers, Conversation(msgs, tools), reply)
        assert plan.session_key == SID
        msgs += (reply, tool(f"out {k}"))
    assert rec.edit_class == "tools_changed"


def test_opencode_append_then_prune_resumes_at_the_cleared_output():
    policy = CachePolicy()
    headers = {"user-agent": "opencode/1.18.2", "x-session-id": "ses_abc"}
    sys_msg = system("You are opencode, an interactive CLI tool. Today is 2026-11-29.")
    msgs = (sys_msg, user("refactor the parser"))
    outputs = []
    for k in range(6):
        reply = assistant("", thinking=f"reasoning {k}", calls=call(k))
        _, plan, rec = turn(policy, {}, headers, Conversation(msgs, TOOLS), reply)
        assert rec.edit_class == ("first" if k == 0 else "append")
        outputs.append(len(msgs) + 1)
        msgs += (reply, tool(f"file contents {k}\n" * 30))
    # the title request runs in parallel and is a session of its own
    _, side, _ = turn(policy, {}, headers, Conversation((system("You are a title generator. You output ONLY a "
                                                                "thread title."), user("refactor"))), assistant("t"))
    assert side.session_key == "ses_abc#title"
    pruned = list(msgs)
    pruned[outputs[1]] = tool("[Old tool result content cleared]")
    conv = Conversation(tuple(pruned) + (assistant("", calls=call(9)), tool("x")), TOOLS)
    _, plan, rec = turn(policy, {}, headers, conv, assistant("done"))
    assert rec.edit_class == "tool_output_elision"
    response = next(s for s in plan.segments if s.kind == "tool_response" and s.message_index == outputs[1])
    assert rec.anchor_used == response.start  # anchored as a future cut when that output was new
    assert rec.edit_point - rec.anchor_used == len("\n<tool_response>\n")


def test_codex_append_with_reasoning_and_changing_client_metadata():
    policy = CachePolicy()
    headers = {"user-agent": "codex_cli_rs/0.171.0", "session-id": "019a-codex"}
    msgs = (system("You are Codex, a coding agent running in the Codex CLI."), user("add a flag"))
    for k in range(5):
        request = {"prompt_cache_key": "019a-codex", "client_metadata": {"turn": k, "ts": 1000 + k}}
        reply = assistant(f"did {k}", thinking=f"**Planning** step {k}", calls=call(k))
        adapter, plan, rec = turn(policy, request, headers, Conversation(msgs, TOOLS), reply)
        assert (adapter.name, plan.session_key) == ("codex", "019a-codex")
        assert rec.edit_class == ("first" if k == 0 else "append")
        msgs += (reply, tool(f"ok {k}"))
    compact = Conversation(msgs + (user("You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff "
                                        "summary for another LLM that will resume the task."),), TOOLS)
    _, side, _ = turn(policy, {"prompt_cache_key": "019a-codex"}, headers, compact, assistant("summary"))
    assert side.kind == "compaction" and policy.store.get("019a-codex").turns == 5


def test_mini_swe_agent_append_by_prefix_match_and_parallel_runs():
    policy = CachePolicy()
    headers = {"user-agent": "litellm/1.80.0"}
    sys_msg = system("You are a helpful assistant that can interact multiple times with a computer shell.")
    bash_tool = {"tools": [{"type": "function", "function": {"name": "bash"}}]}
    runs = {name: (sys_msg, user(f"<pr_description>{name}</pr_description>")) for name in ("a", "b")}
    keys = {}
    for k in range(4):
        for name in ("a", "b"):
            reply = assistant(f"{name} {k}", thinking="r", calls=call(k))
            adapter, plan, rec = turn(policy, bash_tool, headers, Conversation(runs[name], TOOLS), reply)
            assert adapter.name == "swe_agent"
            assert plan.session_source == ("new" if k == 0 else "prefix")
            assert keys.setdefault(name, plan.session_key) == plan.session_key
            assert rec.edit_class == ("first" if k == 0 else "append")
            runs[name] += (reply, tool(f"returncode 0 {k}"))
    assert keys["a"] != keys["b"]


def test_openclaw_tail_replacement_resumes_at_the_replaced_message():
    policy = CachePolicy()
    headers = {"user-agent": "openclaw/2026.9"}
    marker = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
    history = (system("You are OpenClaw."), user("check the build"))
    prev_tail = None
    for k in range(5):
        conv = Conversation(history + (user(f"{marker}\nclock={k}\n<<<END>>>"),), TOOLS)
        reply = assistant("", thinking=f"t{k}", calls=call(k))
        adapter, plan, rec = turn(policy, {}, headers, conv, reply)
        assert adapter.name == "openclaw"
        if k == 0:
            assert rec.edit_class == "first"
        else:
            assert rec.edit_class == "tail_replacement"
            assert rec.anchor_used == prev_tail  # kept at the replaced message, past its shared opening token
        prev_tail = message_start(conv, len(conv.messages) - 1)
        assert prev_tail in plan.checkpoint_positions
        history += (reply, tool(f"built {k}"))


def test_expected_reprefill_never_exceeds_tokens_after_resume_point():
    policy = CachePolicy()
    msgs = (system("generic agent"), user("go"))
    for k in range(3):
        reply = assistant(f"r{k}")
        _, plan, rec = turn(policy, {}, {"x-session-id": "g"}, Conversation(msgs, TOOLS), reply)
        assert rec.prompt_tokens == len(plan.prompt_ids)
        assert rec.expected_reprefill == rec.prompt_tokens - rec.anchor_used
        assert rec.anchor_used <= rec.edit_point
        msgs += (reply, user(f"next {k}"))
    assert len(reply_ids(assistant("x"))) > 0


def test_claude_code_keeps_its_system_prompt_when_the_billing_line_shares_its_text():
    """The Anthropic front-end joins system blocks into one text: only the billing line may go, not the prompt."""
    from harness_adapters.normalize import normalize

    bill = "x-anthropic-billing-header: cc_version=2.1.3.a1f; cc_entrypoint=cli;"
    conv = Conversation((Message("system", (TextPart(bill + "\n\nYou are Claude Code.\n<env>x</env>"),)),
                         user("task")), TOOLS)
    adapter = detect_adapter({}, {"user-agent": "claude-cli/2.1.3"}, conv)
    out = normalize(conv, adapter)
    assert adapter.name == "claude_code"
    assert out.messages[0].role == "system" and out.messages[0].text == "You are Claude Code.\n<env>x</env>"
