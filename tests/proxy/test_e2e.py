"""End to end: official SDKs -> aiohttp server on loopback -> real renderer -> EngineCore -> tiny model.

Random weights emit garbage, so tool-call and reasoning paths use the forced-output test hook: the engine
still runs every decode step and reports real usage, it only emits the given tokens instead of sampling.
"""
import asyncio
import json

import aiohttp
import openai
import pytest

from conftest import FORCED
from real_stack import TOOLS_A, TOOLS_C, TOOLS_R, real_app

THINK_AND_CALL = ('Need to list files.\\n</think>\\n\\nListing.\\n<tool_call>\\n'
                  '{"name": "bash", "arguments": {"cmd": "ls"}}\\n</tool_call>')


async def _count(base, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages/count_tokens", json=body) as r:
            return (await r.json())["input_tokens"]


async def test_anthropic_plain_stream_and_not(serve, sdk):
    base, core, _ = await serve()
    client = sdk.anthropic(base)
    messages = [{"role": "user", "content": "Say hi."}]
    greedy = {"temperature": 0}  # this SDK version has no temperature argument
    msg = await client.messages.create(model="claude-opus-4-8", max_tokens=6, messages=messages, extra_body=greedy)
    assert msg.model == "claude-opus-4-8" and msg.stop_reason in ("max_tokens", "end_turn")
    prompt = await _count(base, {"model": "m", "messages": messages})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    assert 1 <= msg.usage.output_tokens <= 6
    async with client.messages.stream(model="m", max_tokens=6, messages=messages, extra_body=greedy) as stream:
        kinds = [ev.type async for ev in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.output_tokens == msg.usage.output_tokens  # greedy: same answer, same usage
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert core.stats()["active"] == 0


async def test_anthropic_tool_use_then_tool_result_turn(serve, sdk):
    base, core, _ = await serve()
    client = sdk.anthropic(base, default_headers={FORCED: THINK_AND_CALL})
    messages = [{"role": "user", "content": "What files are here?"}]
    async with client.messages.stream(model="m", max_tokens=2000, messages=messages, tools=TOOLS_A,
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = [ev.delta.type async for ev in stream if ev.type == "content_block_delta"]
        msg = await stream.get_final_message()
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Need to list files." and msg.content[1].text == "Listing."
    assert msg.content[2].name == "bash" and msg.content[2].input == {"cmd": "ls"}
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= set(deltas)
    assert msg.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[2].id,
                                               "content": "a.py\nb.py"}]}]
    answer = sdk.anthropic(base, default_headers={FORCED: "Done\\n</think>\\n\\nTwo files."})
    second = await answer.messages.create(model="m", max_tokens=50, messages=messages, tools=TOOLS_A)
    assert second.content[-1].text == "Two files." and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens >= msg.usage.input_tokens  # the first prompt was reused
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == await _count(
        base, {"model": "m", "messages": messages, "tools": TOOLS_A})


async def test_chat_completions_tools_usage_and_tool_turn(serve, sdk):
    base, core, _ = await serve()
    client = sdk.openai(base, default_headers={FORCED: THINK_AND_CALL})
    messages = [{"role": "user", "content": "What files are here?"}]
    chunks = [c async for c in await client.chat.completions.create(
        model="gpt-5", messages=messages, tools=TOOLS_C, stream=True, stream_options={"include_usage": True})]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert reasoning == "Need to list files."
    assert calls[0].function.name == "bash" and calls[0].id and len(calls) > 2   # streamed in pieces
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"cmd": "ls"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0 and usage.completion_tokens_details.reasoning_tokens > 0
    done = await client.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS_C)
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].message.model_extra["reasoning_content"] == "Need to list files."
    assert done.usage.prompt_tokens == usage.prompt_tokens
    messages += [{"role": "assistant", "content": done.choices[0].message.content,
                  "reasoning_content": "Need to list files.",
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": "bash", "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "a.py"}]
    plain = sdk.openai(base)
    third = await plain.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS_C, max_tokens=4,
                                                temperature=0)
    assert third.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert third.usage.prompt_tokens > usage.prompt_tokens and 1 <= third.usage.completion_tokens <= 4
    assert third.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens  # earlier prompt reused


async def test_responses_stream_and_previous_response(serve, sdk):
    base, core, _ = await serve()
    client = sdk.openai(base, default_headers={FORCED: THINK_AND_CALL})
    async with client.responses.stream(model="gpt-5", input="What files are here?", tools=TOOLS_R,
                                       instructions="Be brief.") as stream:
        kinds = [ev.type async for ev in stream]
        first = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta", "response.output_item.done"} <= set(kinds)
    assert [i.type for i in first.output] == ["reasoning", "message", "function_call"]
    call = first.output[2]
    assert json.loads(call.arguments) == {"cmd": "ls"}
    u = first.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens >= 0
    follow = sdk.openai(base, default_headers={FORCED: "ok\\n</think>\\n\\nOne file."})
    second = await follow.responses.create(
        model="gpt-5", previous_response_id=first.id, tools=TOOLS_R, instructions="Be brief.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a.py"}])
    assert second.output_text == "One file." and second.status == "completed"
    assert second.usage.input_tokens > u.input_tokens + 10  # the previous turn is in the prompt
    assert second.usage.input_tokens_details.cached_tokens >= u.input_tokens  # ... and its prompt was reused


async def test_responses_namespaced_call_and_its_echo_reuse_the_whole_turn(aiohttp_server, model_dir):
    """Codex's shape: a call to a tool of a namespace goes out with `namespace`; Codex sends it back with its output
    (store:false, reasoning as encrypted_content) and the next prompt extends the first prompt and the answer."""
    from proxy.policy.cache_policy import PolicyPlanner

    app, _, _ = real_app(model_dir, planner=PolicyPlanner())
    base = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "parameters": TOOLS_R[0]["parameters"]}]}
    body = {"model": "m", "instructions": "Be brief.", "tools": TOOLS_R + [namespace], "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "ns-e2e", "stream": True}
    forced = THINK_AND_CALL.replace('"bash"', '"multi_agent_v1__close_agent"')
    asked = [{"role": "user", "content": "Close it."}]
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/responses", json={**body, "input": asked}, headers={FORCED: forced}) as r:
            events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
        first = events[-1]["response"]
        call = first["output"][-1]
        assert (call["name"], call["namespace"]) == ("close_agent", "multi_agent_v1")
        echo = asked + first["output"] + [{"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
        async with s.post(base + "/v1/responses", json={**body, "input": echo, "stream": False},
                          headers={FORCED: "ok\\n</think>\\n\\nClosed."}) as r:
            second, edit = await r.json(), (r.headers["x-killick-edit-class"], int(r.headers["x-killick-edit-point"]))
    turn = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert edit == ("append", turn)  # the echoed turn renders as the model wrote it, token for token
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= turn


async def test_a_tool_call_nested_deeper_than_a_request_may_be_is_still_the_models_answer(serve, sdk):
    """A request's tool-call arguments nested past 64 levels are a 400; the same in the model's own output is its
    answer, as written: the whole response, and a stream that ends with response.completed."""
    base, core, _ = await serve()
    deep = "[" * 70 + "]" * 70
    client = sdk.openai(base, default_headers={
        FORCED: 'x\\n</think>\\n\\n<tool_call>\\n{"name": "bash", "arguments": {"cmd": ' + deep + '}}\\n</tool_call>'})
    whole = await client.responses.create(model="gpt-5", input="go", tools=TOOLS_R)
    assert whole.status == "completed" and whole.output[-1].arguments == '{"cmd": ' + deep + "}"
    async with client.responses.stream(model="gpt-5", input="go", tools=TOOLS_R) as stream:
        kinds = [ev.type async for ev in stream]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    with pytest.raises(openai.BadRequestError, match="nested deeper than 64"):  # from the client: its error
        await client.responses.create(model="gpt-5", tools=TOOLS_R, input=[
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": ' + deep + "}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}])


async def test_keepalive_while_queued_behind_a_running_request(serve):
    """max_running=1: the second stream waits in the engine queue and must still hear from us."""
    base, core, tok = await serve(max_running=1, keepalive_s=0.1)
    long_reply = "word " * 400  # ~400 decode steps: close to a second even on a fast box
    async with aiohttp.ClientSession() as s:
        blocker = asyncio.ensure_future(s.post(
            base + "/v1/chat/completions", headers={FORCED: long_reply},
            json={"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": "go"}]}))
        await asyncio.sleep(0.3)
        async with s.post(base + "/v1/messages", json={
                "model": "m", "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "me too"}]}) as r:
            events = [line[7:] for line in (await r.text()).splitlines() if line.startswith("event: ")]
        assert (await blocker).status == 200
    before_output = events[:events.index("message_delta")]
    assert before_output.count("ping") >= 3, events


async def test_disconnect_releases_the_request(serve):
    base, core, _ = await serve()
    async with aiohttp.ClientSession() as s:
        r = await s.post(base + "/v1/chat/completions", headers={FORCED: "word " * 1000}, json={
            "model": "m", "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "talk"}]})
        for _ in range(100):  # until decoding has begun (the answer is reasoning: thinking is on)
            line = await r.content.readline()
            if b"word" in line or not line:
                break
        assert core.stats()["active"] == 1
        r.close()
    for _ in range(100):
        if core.stats()["active"] == 0:
            break
        await asyncio.sleep(0.05)
    stats = core.stats()
    assert stats["active"] == 0 and stats["queued"] == 0 and stats["aborted"] == 1


async def test_errors_and_models_with_the_real_engine(serve, sdk):
    import anthropic
    import openai

    base, core, _ = await serve(context_length=64)
    long = [{"role": "user", "content": "many words " * 60}]
    with pytest.raises(anthropic.BadRequestError) as err:
        await sdk.anthropic(base, max_retries=0).messages.create(model="m", max_tokens=5, messages=long)
    assert "prompt is too long" in err.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        await sdk.openai(base, max_retries=0).responses.create(model="m", input="many words " * 60)
    models = await sdk.openai(base).models.list()
    assert models.data[0].id == "tiny" and models.data[0].model_extra["context_length"] == 64
    ok = await sdk.openai(base).chat.completions.create(model="x", max_tokens=3,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.completion_tokens <= 3 and core.stats()["active"] == 0
    async with aiohttp.ClientSession() as s:
        metrics = await (await s.get(base + "/metrics")).text()
    assert 'killick_requests_total{api="anthropic",status="400"} 1' in metrics
    assert "killick_engine_active 0" in metrics and "killick_engine_cache_misses" in metrics


async def test_cache_policy_planner_end_to_end(aiohttp_server, model_dir, sdk):
    """Claude Code shape, two turns, billing line changing: the policy normalises it away and plans anchors,
    so the second turn reuses the first prompt. Runs once proxy/policy/cache_policy.py is on the branch."""
    cache_policy = pytest.importorskip("proxy.policy.cache_policy")
    from real_stack import real_app

    planner = cache_policy.PolicyPlanner()
    app, core, _ = real_app(model_dir, planner=planner)
    base = str((await aiohttp_server(app)).make_url("")).rstrip("/")

    def system(hexes):
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3.{hexes}; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are Claude Code, a coding agent."}]

    client = sdk.anthropic(base, default_headers={FORCED: THINK_AND_CALL})
    messages = [{"role": "user", "content": "What files are here?"}]
    first = await client.messages.create(model="claude-opus-4-8", max_tokens=200, system=system("a1b"),
                                         messages=messages, tools=TOOLS_A, metadata={"user_id": "session_x"})
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[-1].id,
                                               "content": "a.py"}]}]
    second = await client.messages.create(model="claude-opus-4-8", max_tokens=200, system=system("c2d"),
                                          messages=messages, tools=TOOLS_A, metadata={"user_id": "session_x"})
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
    async with aiohttp.ClientSession() as s:
        metrics = await (await s.get(base + "/metrics")).text()
    assert "killick_policy_" in metrics


async def test_anthropic_prefill_is_continued(serve, sdk):
    """A last assistant message is text the answer goes on from (Anthropic's prefill): the prompt leaves that turn
    open, the answer holds the continuation alone, and the next turn, which joins the two,
    reuses the prompt up to that turn's text."""
    import anthropic

    from proxy.cli.serve import make_planner

    base, core, _ = await serve(planner=make_planner("anchors"))  # as serve plans checkpoints by default
    messages = [{"role": "user", "content": "What is the answer?"}, {"role": "assistant", "content": "The answer"}]
    msg = await sdk.anthropic(base, default_headers={FORCED: "s: 42."}).messages.create(
        model="m", max_tokens=20, messages=messages)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "s: 42."
    assert msg.stop_reason == "end_turn"
    prompt = await _count(base, {"model": "m", "messages": messages})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    following = messages[:1] + [{"role": "assistant", "content": "The answers: 42."},
                                {"role": "user", "content": "Why?"}]
    second = await sdk.anthropic(base, default_headers={FORCED: "Because\\n</think>\\n\\nIt is."}).messages.create(
        model="m", max_tokens=20, messages=following)
    assert second.content[-1].text == "It is." and second.usage.cache_read_input_tokens > 0
    client = sdk.anthropic(base, max_retries=0)
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}
    refused = [(messages, thinking, "cannot be combined with thinking"),
               (messages[:1] + [{"role": "assistant", "content": "The answer "}], {}, "trailing whitespace"),
               (messages[:1] + [{"role": "assistant", "content": [
                   {"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]}], {}, "text alone")]
    for msgs, extra, needle in refused:
        with pytest.raises(anthropic.BadRequestError, match=needle):
            await client.messages.create(model="m", messages=msgs, **{"max_tokens": 5, **extra})
    assert core.stats()["active"] == 0


async def test_chat_continue_final_message_is_continued(serve, sdk):
    """continue_final_message (vLLM's and SGLang's, which upstream mode sends for a prefill): the final assistant
    message is left open and the answer holds its continuation alone, on a prompt shorter than the same messages
    answered anew (no end of turn and generation prompt after it); refused beside a generation prompt, with no
    final assistant message or tool calls in it, and add_generation_prompt false alone."""
    base, core, _ = await serve()
    messages = [{"role": "user", "content": "What is the answer?"}, {"role": "assistant", "content": "The answer"}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    forced = sdk.openai(base, default_headers={FORCED: "s: 42."})
    out = await forced.chat.completions.create(model="m", max_tokens=20, messages=messages, extra_body=go_on)
    assert out.choices[0].message.content == "s: 42." and out.choices[0].finish_reason == "stop"
    anew = await forced.chat.completions.create(model="m", max_tokens=20, messages=messages)
    assert out.usage.prompt_tokens < anew.usage.prompt_tokens
    reasoned = messages[:1] + [{"role": "assistant", "content": "", "reasoning_content": "Think it through."}]
    after_thinking = await forced.chat.completions.create(model="m", max_tokens=20, messages=reasoned,
                                                          extra_body=go_on)
    assert after_thinking.choices[0].message.content == "s: 42."
    client = sdk.openai(base, max_retries=0)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
    refused = [(messages, {"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
               (messages[:1], go_on, "must be the assistant's"),
               (messages[:1] + [call], go_on, "not tool calls"),
               (messages, {"add_generation_prompt": False}, "served only with continue_final_message")]
    for msgs, extra, needle in refused:
        with pytest.raises(openai.BadRequestError, match=needle):
            await client.chat.completions.create(model="m", max_tokens=5, messages=msgs, extra_body=extra)
    assert core.stats()["active"] == 0


async def test_chat_penalties_change_the_greedy_answer_and_zero_changes_nothing(serve, sdk):
    base, core, _ = await serve()
    client = sdk.openai(base)

    async def answer(**penalties) -> str:
        out = await client.chat.completions.create(
            model="m", max_tokens=24, temperature=0, messages=[{"role": "user", "content": "say it again"}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **penalties)
        assert out.choices[0].message.content
        return out.choices[0].message.content

    plain = await answer()
    assert await answer(frequency_penalty=0, presence_penalty=0) == plain
    assert await answer(presence_penalty=-2) != plain  # the tiny model repeats what it already wrote
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        await sdk.openai(base, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], presence_penalty=2.5)


async def test_responses_retrieve_and_delete_through_the_sdk(serve, sdk):
    base, _, _ = await serve()
    client = sdk.openai(base, max_retries=0, default_headers={FORCED: THINK_AND_CALL})
    created = await client.responses.create(model="gpt-5", input="What files are here?", tools=TOOLS_R)
    got = await client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert [i.type for i in got.output] == ["reasoning", "message", "function_call"] and got.status == "completed"
    assert await client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(created.id)
    unstored = await client.responses.create(model="gpt-5", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_anthropic_stop_sequences_skip_the_thinking(serve, sdk):
    """A stop sequence the model thinks about is thinking; the one in its answer ends the answer, streaming or
    not, and the engine request stops there."""
    base, core, _ = await serve()
    client = sdk.anthropic(base, default_headers={FORCED: "I must not say STOP early.\\n</think>\\n\\nOK then STOP x"})
    ask = {"model": "m", "max_tokens": 100, "stop_sequences": ["STOP"], "messages": [{"role": "user", "content": "go"}]}
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for msg in (whole, streamed):
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in msg.content] == [
            ("thinking", "I must not say STOP early."), ("text", "OK then")]
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "STOP")
    assert core.stats()["active"] == 0


async def test_anthropic_message_start_carries_the_cache_split(serve, sdk):
    """A second turn reuses the first one's cache: its message_start already says so (Claude Code reads the split
    there), with the figures message_delta confirms at the end."""
    base, core, _ = await serve()
    client = sdk.anthropic(base, default_headers={FORCED: "Hm.\\n</think>\\n\\nShort."})
    messages = [{"role": "user", "content": "Tell me about caches."}]
    splits = []
    for _ in range(2):
        async with client.messages.stream(model="m", max_tokens=50, messages=messages) as stream:
            usage = {ev.type: ev.message.usage if ev.type == "message_start" else ev.usage
                     async for ev in stream if ev.type in ("message_start", "message_delta")}
            answer = await stream.get_final_message()
        prompt = await _count(base, {"model": "m", "messages": messages})
        splits.append([(u.input_tokens, u.cache_read_input_tokens, prompt) for u in usage.values()])
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in answer.content]},
                     {"role": "user", "content": "And then?"}]
    (start, end), (again, again_end) = splits
    assert start == end and start[0] + start[1] == start[2]
    assert again == again_end and again[1] >= start[2] and again[0] + again[1] == again[2]


async def test_anthropic_thinking_is_closed_at_its_budget_and_the_answer_follows(serve, sdk):
    """Random weights never close their thinking: past budget_tokens the engine writes </think> itself, the
    model goes on from it, and what it writes next is the answer."""
    base, core, _ = await serve()
    msg = await sdk.anthropic(base).messages.create(
        model="m", max_tokens=1100, messages=[{"role": "user", "content": "Think hard."}],
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[0].thinking and msg.content[1].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 1100
