"""Session identity: harness hints first, then the longest rendered-prefix match; side requests apart."""
import json

import pytest

from harness_adapters.generic import GenericAdapter
from proxy.conversation import Conversation, Message, TextPart, ToolSpec
from proxy.policy.cache_policy import CachePolicy
from proxy.policy.sessions import SessionStore, claude_code_session, session_hint
from tests.proxy.fake_render import assistant, engine_usage, play, render, reply_ids, system, user

UUID = "0f8c5d1e-9a3b-4c2d-8e7f-112233445566"


def test_hints_from_each_harness():
    assert session_hint({}, {"X-Session-Id": "ses_1"}) == ("x-session-id", "ses_1")
    assert session_hint({}, {"session_id": "s2"}) == ("session-id", "s2")
    assert session_hint({}, {"thread-id": "t3"}) == ("thread-id", "t3")
    assert session_hint({"prompt_cache_key": "k4"}, {}) == ("prompt_cache_key", "k4")
    legacy = {"metadata": {"user_id": f"user_{'ab' * 32}_account_{UUID}_session_{UUID}"}}
    assert session_hint(legacy, {}) == ("metadata.user_id", UUID)
    as_json = {"metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "a", "session_id": UUID})}}
    assert session_hint(as_json, {}) == ("metadata.user_id", UUID)
    assert session_hint({"metadata": {"user_id": "user_only"}}, {}) is None
    assert session_hint({}, {"user-agent": "curl"}) is None


def test_claude_code_user_id_variants():
    assert claude_code_session(f"user_x_account__session_{UUID}") == UUID
    assert claude_code_session("{not json") is None
    assert claude_code_session(None) is None
    assert claude_code_session(json.dumps({"session_id": ""})) is None


def test_hint_keys_side_requests_apart_from_the_main_conversation():
    store = SessionStore()
    assert store.identify({}, {"x-session-id": "s"}, [1, 2]) == ("s", "x-session-id")
    assert store.identify({}, {"x-session-id": "s"}, [1, 2], kind="title") == ("s#title", "x-session-id")


def run(policy, conv, reply, **kw):
    return play(policy, GenericAdapter(), conv, reply, **kw)


def test_prefix_match_needs_more_than_the_shared_system_prompt():
    policy = CachePolicy()
    sys = system("You are a helpful agent. " * 20)
    a, _ = run(policy, Conversation((sys, user("task A"))), assistant("a1"))
    b, _ = run(policy, Conversation((sys, user("task B"))), assistant("b1"))
    assert (a.session_source, b.session_source) == ("new", "new")
    assert a.session_key != b.session_key
    a2, rec = run(policy, Conversation((sys, user("task A"), assistant("a1"), user("more"))), assistant("a2"))
    assert (a2.session_key, a2.session_source, rec.edit_class) == (a.session_key, "prefix", "append")
    b2, rec = run(policy, Conversation((sys, user("task B"), assistant("b1"), user("more"))), assistant("b2"))
    assert (b2.session_key, rec.edit_class, rec.turn_index) == (b.session_key, "append", 1)


def test_main_lru_is_bounded_and_side_requests_never_evict_it():
    policy = CachePolicy(SessionStore(max_sessions=2, max_side_sessions=2))
    for k in range(3):
        run(policy, Conversation((user(f"conv {k}"),)), assistant("r"), headers={"x-session-id": f"s{k}"})
    assert policy.store.sessions() == ["s1", "s2"]

    class TitleAdapter(GenericAdapter):
        def side_request_kind(self, conv):
            return "title"

    for k in range(5):
        play(policy, TitleAdapter(), Conversation((user(f"title {k}"),)), assistant("t"),
             headers={"x-session-id": "s2"} if k == 0 else {})
    assert policy.store.sessions() == ["s1", "s2"]
    assert len(policy.store.sessions("title")) == 2
    assert policy.store.get("s2").turns == 1


def test_store_validates_sizes():
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)


def test_records_and_anchors_remembered_per_session():
    policy = CachePolicy()
    conv = Conversation((system("s"), user("q")))
    turn, rec = run(policy, conv, assistant("answer", thinking="r"), headers={"session-id": "x"})
    state = policy.store.get("x")
    n = len(render(conv).ids)
    assert state.records == [rec] and state.turns == 1
    assert n in state.checkpoint_positions and max(state.checkpoint_positions) == len(state.prev.ids)
    assert set(turn.checkpoint_positions) <= set(state.checkpoint_positions)


def test_user_id_as_an_object():
    assert claude_code_session({"device_id": "d", "session_id": UUID}) == UUID


def test_stats_and_engine_usage_in_turn_records():
    from engine.api import Usage

    policy = CachePolicy()
    msgs = (system("s"), user("q"))
    for k in range(3):
        turn, rec = run(policy, Conversation(msgs), assistant(f"a{k}"), headers={"x-session-id": "m"})
        msgs += (assistant(f"a{k}"), user(f"q{k}"))
    done = rec.with_usage(Usage(prompt_tokens=rec.prompt_tokens, output_tokens=3, reused_tokens=rec.anchor_used,
                                prefilled_tokens=rec.expected_reprefill, cache_tier="host", ttft_s=0.5))
    assert (done.reused_tokens, done.cache_tier, done.wasted_tokens) == (rec.anchor_used, "host", 0)
    stats = policy.stats()
    assert (stats["sessions"], stats["turns"]) == (1, 3)
    assert stats["by_edit_class"] == {"first": 1, "append": 2}
    assert stats["expected_reprefill_tokens"] < stats["prompt_tokens"]


def test_retry_of_the_same_prompt_resumes_one_token_before_its_end():
    policy = CachePolicy()
    conv = Conversation((system("s"), user("question")))
    first, _ = run(policy, conv, assistant("a"), headers={"x-session-id": "r"})
    again, rec = run(policy, conv, assistant("a"), headers={"x-session-id": "r"})
    n = len(first.prompt_ids)
    assert rec.edit_class == "rewind"
    assert (rec.anchor_used, rec.expected_reprefill) == (n - 1, 1)  # the engine always prefills one token


def test_policy_planner_fits_the_proxy_seam_with_hints_from_extras():
    from dataclasses import replace

    from proxy.policy.cache_policy import PolicyPlanner

    planner = PolicyPlanner()
    bill = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli;"
    hint = f"user_{'1' * 64}_account__session_{UUID}"
    msgs = (Message("system", (TextPart(bill), TextPart("You are Claude Code."))), user("go"))
    for k in range(2):
        tools = (ToolSpec("bash", "run", "{}"),)
        conv = planner.normalize(replace(Conversation(msgs, tools), extras={"session_hint": hint}), headers={})
        assert conv.extras["harness"] == "claude_code" and conv.messages[0].text == "You are Claude Code."
        rendered = render(conv)
        turn = planner(conv, rendered, {})
        assert (turn.session_key, turn.session_source) == (UUID, "metadata.user_id")
        assert all(0 < p < len(rendered.ids) for p in turn.checkpoint_positions)
        ids = reply_ids(assistant(f"r{k}"))
        record = planner.finish(turn, ids, engine_usage(turn, ids))
        assert record.edit_class == ("first" if k == 0 else "append")
        msgs += (assistant(f"r{k}"), user(f"q{k}"))
    plain = planner.normalize(replace(Conversation((user("x"),)), extras={"session_hint": "end-user-7"}), {})
    assert planner(plain, render(plain), {}).session_key == "end-user-7"


def test_requests_of_one_session_planned_before_either_finishes_get_their_own_turn_numbers():
    """Two requests of a session sent at the same moment are both planned before either finishes: each gets its
    own turn number once admitted (the first request of a session too), and the second joins the first's
    session."""
    adapter, headers = GenericAdapter(), {"x-session-id": "twin"}
    policy = CachePolicy()
    msgs = (system("s"), user("q"))
    for k in range(2):  # turn k of the conversation, sent twice at once
        conv = Conversation(msgs)
        turns = [policy.plan_turn({}, headers, conv, render(conv), adapter) for _ in range(2)]
        assert [t.record.turn_index for t in turns] == [None, None]  # numbered when the engine takes them
        turns = [policy.admit_turn(t) for t in turns]
        for turn in turns:
            ids = reply_ids(assistant(f"a{k}"))
            policy.finish_turn(turn, ids, engine_usage(turn, ids))
        assert [t.session_key for t in turns] == ["twin", "twin"]
        assert [t.record.turn_index for t in turns] == [2 * k, 2 * k + 1]
        msgs += (assistant(f"a{k}"), user(f"q{k}"))
    rows = policy.stats()["recent_turns"]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4]  # as killick ctl stats shows them
    assert policy.store.get("twin").turns == 4


def test_sessions_planned_but_never_admitted_displace_no_session():
    """Requests refused after planning (planned, never admitted) that name no session, more than the store holds:
    the admitted sessions keep their places, their next turns resume from their checkpoints, and the refused
    requests leave no session behind."""
    policy = CachePolicy(SessionStore(max_sessions=2))
    for k in range(2):
        run(policy, Conversation((system("s"), user(f"conv {k}"))), assistant("r"), headers={"x-session-id": f"s{k}"})
    for k in range(40):
        conv = Conversation((system("s"), user(f"refused {k}")))
        policy.plan_turn({}, {}, conv, render(conv), GenericAdapter())
    assert policy.store.sessions() == ["s0", "s1"] and policy.stats()["sessions"] == 2
    conv = Conversation((system("s"), user("conv 0"), assistant("r"), user("more")))
    turn, rec = run(policy, conv, assistant("r2"), headers={"x-session-id": "s0"})
    assert (turn.session_key, rec.edit_class, rec.turn_index) == ("s0", "append", 1)
    assert rec.anchor_used > 0 and rec.anchor_used == turn.resume_at
    assert policy.store.sessions() == ["s1", "s0"]


def test_a_new_thread_planned_twice_before_either_is_admitted_is_one_thread():
    """A sub-agent's first request under its main session's hint, sent twice at once: the second finds the thread
    the first opened while it waits for admission, and each gets its own turn of it."""
    policy, headers = CachePolicy(), {"x-session-id": "h"}
    run(policy, Conversation((system("s"), user("main task"))), assistant("m"), headers=headers)
    conv = Conversation((system("s"), user("sub-agent task")))
    turns = [policy.plan_turn({}, headers, conv, render(conv), GenericAdapter()) for _ in range(2)]
    thread = turns[0].session_key
    assert thread.startswith("h~") and [t.session_key for t in turns] == [thread, thread]
    assert policy.store.sessions() == ["h"]  # planned, not yet admitted
    assert [policy.admit_turn(t).record.turn_index for t in turns] == [0, 1]
    assert policy.store.sessions() == ["h", thread]
