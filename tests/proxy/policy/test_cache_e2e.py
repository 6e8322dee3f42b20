"""Acceptance of the context-aware cache through the real HTTP proxy on the tiny hybrid checkpoint.

For a 10-turn session of each edit kind (cache_sessions.py), with the policy planner as `killick serve`
builds it, every turn after the first must re-prefill no more than the tokens after its edit point (+ one
tokenizer-merge token), the API's cached-token field must carry the engine's reused count, and the outputs
must equal a cold run (prefix cache off) token for token. The edit point is computed here, independently:
the first token where the prompt the engine received differs from the previous request's prompt + the ids
the engine generated for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from cache_sessions import SCRIPTS, STRIPPING_HARNESS, TURNS, opencode_prune
from real_stack import real_app, synth_model_dir

MERGE_SLACK = 1  # one token at the boundary may tokenise differently (e.g. "\n" + "\n" -> "\n\n")


@dataclass
class EngineCall:
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    usage: object = None


@dataclass
class Turn:
    prompt_tokens: int  # from the API's usage
    cached_tokens: int
    output: str  # the API's answer body, as JSON
    call: EngineCall
    record: object = None  # the planner's TurnRecord


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "harnesses.json"
    path.write_text(json.dumps(STRIPPING_HARNESS))
    return path


def recorded_stack(model_dir, rules_file, **engine_options):
    """The real app with the planner `killick serve` builds; the engine's requests and the planner's turn
    records are observed on their way through (the calls go on to the real objects unchanged)."""
    from harness_adapters import load_registry
    from proxy.policy.cache_policy import PolicyPlanner

    planner = PolicyPlanner(registry=load_registry(rules_file))
    app, core, tok = real_app(model_dir, planner=planner, **engine_options)
    calls, records = [], []
    submit, finish = core.submit, planner.finish

    def observed_submit(req, callback):
        call = EngineCall(list(req.prompt_ids))
        calls.append(call)

        def on_event(ev):
            call.out += ev.token_ids
            if ev.final:
                call.usage = ev.usage
            callback(ev)

        return submit(req, on_event)

    def observed_finish(turn, output_ids, usage=None):
        records.append(finish(turn, output_ids, usage))
        return records[-1]

    core.submit, planner.finish = observed_submit, observed_finish
    return app, core, calls, records


def api_usage(path: str, data: dict) -> tuple[int, int, str]:
    """(prompt tokens, cached tokens, answer) as the agent reads them from this API."""
    u = data["usage"]
    if path == "/v1/messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"], \
            json.dumps(data["content"])
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], json.dumps(data["choices"][0]["message"])


async def run_session(aiohttp_client, stack, script, turns: int = TURNS, after_turn=None) -> list[Turn]:
    app, core, calls, records = stack
    client = await aiohttp_client(app)
    out = []
    for k in range(turns):
        path, headers, body = script(k)
        r = await client.post(path, json=body, headers=headers)
        assert r.status == 200, await r.text()
        prompt, cached, answer = api_usage(path, await r.json())
        out.append(Turn(prompt, cached, answer, calls[-1], records[-1]))
        if after_turn is not None:
            await after_turn(client, k)
    assert len(calls) == turns and len(records) == turns
    return out


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def edit_point(prev: Turn, cur: Turn) -> int:
    """First token where this prompt differs from the previous prompt + the ids generated for it."""
    return common_prefix(prev.call.prompt + prev.call.out, cur.call.prompt)


def check_usage(turn: Turn) -> int:
    """The API's fields carry the engine's counts; returns the tokens prefilled."""
    usage = turn.call.usage
    assert turn.prompt_tokens == len(turn.call.prompt) == usage.prompt_tokens
    assert turn.cached_tokens == usage.reused_tokens == turn.record.reused_tokens
    assert turn.prompt_tokens - turn.cached_tokens == usage.prefilled_tokens
    return usage.prefilled_tokens


def assert_same_outputs(warm: list[Turn], cold: list[Turn]) -> None:
    for k, (w, c) in enumerate(zip(warm, cold)):
        assert w.call.prompt == c.call.prompt, f"turn {k}: the two runs rendered different prompts"
        assert (w.call.out, w.output) == (c.call.out, c.output), f"turn {k}: cached output differs from cold"
    assert all(c.cached_tokens == 0 for c in cold)


EXPECTED_CLASS = {  # the planner's edit class on the turns that make the edit (others are reply edits)
    "append": {},
    "tail_replacement": {k: "tail_replacement" for k in range(1, TURNS)},
    "tool_output_elision": {k: "tool_output_elision" for k in range(4, TURNS)},
    "thinking_stripped": {k: "thinking_stripped" for k in range(2, TURNS)},
    "system_tools_changed": {3: "tools_changed", 6: "tools_changed", 8: "system_changed"},
    "compaction": {5: "first", 6: "compaction"},  # 5: the summary request, a side session of its own
}
REPLY_EDITS = {"append", "reply_rerendered", "thinking_stripped"}


@pytest.mark.parametrize("kind", list(SCRIPTS))
async def test_each_edit_kind_reprefills_only_what_follows_the_edit(kind, aiohttp_client, model_dir, rules_file):
    warm = await run_session(aiohttp_client, recorded_stack(model_dir, rules_file), SCRIPTS[kind])
    cold = await run_session(aiohttp_client, recorded_stack(model_dir, rules_file, prefix_cache=False),
                             SCRIPTS[kind])
    assert_same_outputs(warm, cold)
    for k in range(1, TURNS):
        prev, cur = warm[k - 1], warm[k]
        e = edit_point(prev, cur)
        prefilled = check_usage(cur)
        n = len(cur.call.prompt)
        print(f"{kind} turn {k}: prompt {n} edit point {e} prefilled {prefilled} "
              f"class {cur.record.edit_class} anchor {cur.record.anchor_used}")
        assert prefilled <= n - e + MERGE_SLACK, (kind, k, n, e, prefilled, cur.record)
        if cur.record.session_key == prev.record.session_key:
            assert cur.record.edit_point == e  # the policy's diff agrees with ours
        want = EXPECTED_CLASS[kind].get(k)
        assert cur.record.edit_class == want if want else cur.record.edit_class in REPLY_EDITS, (k, cur.record)


async def test_budgets_hold_over_a_long_session(aiohttp_client, model_dir, rules_file, caplog):
    """30 OpenCode turns under tiny prefix-cache budgets: after every turn each tier is within its budget,
    nodes were demoted and dropped on the way, and the outputs still equal the cold run."""
    turns, stats = 30, []
    warm_stack = recorded_stack(model_dir, rules_file, cache_device_mb=2, cache_host_mb=1)
    device_budget, host_budget = 2 << 20, 1 << 20  # ~6 MB of KV and checkpoints pass through

    async def read_stats(client, k):
        r = await client.get("/v1/killick/stats")
        stats.append((await r.json())["engine"])

    warm = await run_session(aiohttp_client, warm_stack, opencode_prune, turns, read_stats)
    cold = await run_session(aiohttp_client, recorded_stack(model_dir, rules_file, prefix_cache=False),
                             opencode_prune, turns)
    assert_same_outputs(warm, cold)
    for s in stats:
        assert s["cache_device_budget"] == device_budget and s["cache_host_budget"] == host_budget
        assert s["cache_device_bytes"] <= device_budget and s["cache_host_bytes"] <= host_budget
    last = stats[-1]
    print({k: v for k, v in last.items() if k.startswith("cache_")})
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text  # e.g. "release failed"
    assert last["cache_demotions"] > 0 and last["cache_dropped_nodes"] > 0
    for k in range(1, turns):  # the live session's path fits the device: reuse stays as good as unbounded
        assert check_usage(warm[k]) <= len(warm[k].call.prompt) - edit_point(warm[k - 1], warm[k]) + MERGE_SLACK


def test_a_turn_that_ends_on_a_stop_id_is_remembered_through_it(model_dir):
    """The engine caches a turn through the stop id that ended it (the next prompt repeats `<|im_end|>`) and
    reports that checkpoint; the session remembers it too, so the next turn's plan resumes where the engine
    does, expects to re-prefill what the engine prefills, and counts nothing as another session's."""
    import threading

    from engine.api import GenerateRequest
    from engine.build import EngineOptions, build_core
    from fake_render import FakeRendered
    from harness_adapters import default_registry
    from proxy.conversation import Conversation
    from proxy.policy.cache_policy import CachePolicy

    core = build_core(model_dir, EngineOptions(cache_device_mb=64, cache_host_mb=64))
    core.start()

    def serve(prompt, turn, stop_ids=frozenset()):
        out, done = [], threading.Event()
        final = []

        def sink(ev):
            out.extend(ev.token_ids)
            if ev.final:
                final.append(ev)
                done.set()

        core.submit(GenerateRequest(prompt, 8, stop_ids=stop_ids, session_key=turn.session_key,
                                    checkpoint_positions=turn.checkpoint_positions), sink)
        assert done.wait(120)
        return out, final[0]

    try:
        policy, adapter, conv = CachePolicy(), default_registry.get("generic"), Conversation(())
        headers, prompt = {"x-session-id": "S"}, list(range(5, 45))
        probe = policy.plan_turn({}, {"x-session-id": "probe"}, conv, FakeRendered(prompt, "", ()), adapter)
        greedy, _ = serve(prompt, probe)
        stop = greedy[2]  # the third greedy token ends the turn: two tokens out, then the stop id
        first = policy.plan_turn({}, headers, conv, FakeRendered(prompt, "", ()), adapter)
        out, ended = serve(prompt, first, frozenset({stop}))
        assert (ended.finish_reason, ended.usage.stop_token, out) == ("stop", stop, greedy[:2])
        through = len(prompt) + len(out) + 1
        assert through in ended.usage.checkpoints_kept
        policy.finish_turn(first, out, ended.usage)
        assert through in policy.store.get("S").checkpoint_positions
        nxt = prompt + out + [stop] + list(range(50, 60))
        second = policy.plan_turn({}, headers, conv, FakeRendered(nxt, "", ()), adapter)
        _, done = serve(nxt, second)
        assert second.resume_at == done.usage.reused_tokens == through
        assert second.record.expected_reprefill == done.usage.prefilled_tokens == 10
        assert second.shared_tokens(done.usage) == 0
    finally:
        core.stop()
