"""Official SDKs -> the proxy in upstream mode -> `killick serve` replicas (real processes, tiny checkpoint).

Random weights emit garbage, so answers are forced: the proxy passes replay's x-killick-force-response on to
the replica, which decodes exactly that reply on its model (every step runs, usage and cache are real).
"""
import json

import aiohttp
import pytest

from proxy.conversation import canonical_json
from proxy.replay.scripted import FORCE_RESPONSE_HEADER, Reply, encode_header
from proxy.upstream.bench import free_port
from real_stack import TOOLS_A, TOOLS_C, TOOLS_R

THINK_AND_CALL = Reply("Need to list files.", "Listing.", (("bash", canonical_json({"cmd": "ls"})),))


def forced(reply: Reply, session: str) -> dict:
    return {FORCE_RESPONSE_HEADER: encode_header(reply), "x-session-id": session}


async def _count(base, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages/count_tokens", json=body) as r:
            return (await r.json())["input_tokens"]


def _session(pool, key):
    return next(s for s in pool.stats()["recent_sessions"] if s["session"] == key)


async def test_anthropic_tool_turns_through_one_replica(upstream_proxy, sdk):
    base, pool = await upstream_proxy()
    client = sdk.anthropic(base, default_headers=forced(THINK_AND_CALL, "t-anthropic"))
    messages = [{"role": "user", "content": "What files are here?"}]
    async with client.messages.stream(model="claude-opus-4-8", max_tokens=2000, messages=messages, tools=TOOLS_A,
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = [ev.delta.type async for ev in stream if ev.type == "content_block_delta"]
        msg = await stream.get_final_message()
    assert msg.model == "claude-opus-4-8" and msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Need to list files." and msg.content[1].text == "Listing."
    assert msg.content[2].name == "bash" and msg.content[2].input == {"cmd": "ls"}
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= set(deltas)
    prompt = await _count(base, {"model": "m", "messages": messages, "tools": TOOLS_A})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt  # the upstream's figures

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[2].id,
                                               "content": "a.py\nb.py"}]}]
    answer = sdk.anthropic(base, default_headers=forced(Reply("Done", "Two files."), "t-anthropic"))
    second = await answer.messages.create(model="claude-opus-4-8", max_tokens=50, messages=messages, tools=TOOLS_A)
    assert second.content[-1].text == "Two files." and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens >= prompt  # the first turn's prompt was reused upstream
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == await _count(
        base, {"model": "m", "messages": messages, "tools": TOOLS_A})
    s = _session(pool, "t-anthropic")
    assert (s["turns"], s["moves"], s["cached_tokens"]) == (2, 0, second.usage.cache_read_input_tokens)


async def test_an_anthropic_prefill_is_continued_by_the_replica(upstream_proxy, sdk):
    """A final assistant message (Anthropic's prefill) goes upstream with continue_final_message: the replica
    leaves that turn open, so its prompt is the proxy's own count of it, and the answer is the continuation alone."""
    base, _ = await upstream_proxy()
    messages = [{"role": "user", "content": "What is the answer?"}, {"role": "assistant", "content": "The answer"}]
    client = sdk.anthropic(base, default_headers=forced(Reply("", "s: 42."), "t-prefill"))
    msg = await client.messages.create(model="claude-opus-4-8", max_tokens=20, messages=messages)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "s: 42."
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == await _count(
        base, {"model": "m", "messages": messages})


async def test_a_thinking_budget_is_kept_by_continuing_the_turn_after_the_thinking(upstream_proxy, sdk):
    """thinking.budget_tokens in upstream mode: once the answer has thought the budget's tokens (the proxy's count)
    with nothing else written, the proxy closes it and the same replica continues the turn after the thinking,
    closed there; the thinking holds the budget, the answer follows it, and the usage counts both parts."""
    from proxy.prompt.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    base, pool = await upstream_proxy()
    thought = "Counting: " + "0123456789" * 150  # a token a digit: more than the budget, in a header's room
    assert len(tok.encode(thought)) > 1500
    client = sdk.anthropic(base, default_headers=forced(Reply(thought, "Done."), "t-budget"))
    msg = await client.messages.create(model="claude-opus-4-8", max_tokens=1100, thinking={
        "type": "enabled", "budget_tokens": 1024}, messages=[{"role": "user", "content": "Think it over."}])
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[1].text == "Done."
    kept = msg.content[0].thinking
    assert thought.startswith(kept.strip()) and 1024 <= len(tok.encode(kept)) <= 1024 + 4
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens >= len(tok.encode(kept)) + 2
    assert _session(pool, "t-budget")["turns"] == 1


async def test_chat_completions_stream_tools_and_cached_usage(upstream_proxy, sdk):
    base, pool = await upstream_proxy()
    client = sdk.openai(base, default_headers=forced(THINK_AND_CALL, "t-chat"))
    messages = [{"role": "user", "content": "What files are here?"}]
    chunks = [c async for c in await client.chat.completions.create(
        model="gpt-5", messages=messages, tools=TOOLS_C, stream=True, stream_options={"include_usage": True})]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert reasoning == "Need to list files." and chunks[-2].choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name == "bash" and json.loads(calls[0].function.arguments) == {"cmd": "ls"}
    usage = chunks[-1].usage
    assert usage.prompt_tokens == await _count(base, {"model": "m", "messages": messages,
                                                      "tools": TOOLS_A})
    assert usage.completion_tokens_details.reasoning_tokens > 0
    messages += [{"role": "assistant", "content": "Listing.", "reasoning_content": "Need to list files.",
                  "tool_calls": [{"id": calls[0].id, "type": "function",
                                  "function": {"name": "bash", "arguments": calls[0].function.arguments}}]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "a.py"}]
    plain = sdk.openai(base, default_headers=forced(Reply(text="One file."), "t-chat"))
    done = await plain.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS_C)
    assert done.choices[0].message.content == "One file." and done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens
    assert _session(pool, "t-chat")["turns"] == 2


async def test_responses_stream_and_previous_response(upstream_proxy, sdk):
    base, _ = await upstream_proxy()
    client = sdk.openai(base, default_headers=forced(THINK_AND_CALL, "t-resp"))
    async with client.responses.stream(model="gpt-5", input="What files are here?", tools=TOOLS_R,
                                       instructions="Be brief.") as stream:
        kinds = [ev.type async for ev in stream]
        first = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [i.type for i in first.output] == ["reasoning", "message", "function_call"]
    call = first.output[2]
    assert json.loads(call.arguments) == {"cmd": "ls"}
    follow = sdk.openai(base, default_headers=forced(Reply(text="One file."), "t-resp"))
    second = await follow.responses.create(
        model="gpt-5", previous_response_id=first.id, tools=TOOLS_R, instructions="Be brief.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a.py"}])
    assert second.output_text == "One file." and second.status == "completed"
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


async def test_errors_keep_each_api_shape(upstream_proxy, sdk):
    import anthropic
    import openai

    base, _ = await upstream_proxy()
    bad = {FORCE_RESPONSE_HEADER: "!!not-base64!!"}  # the replica refuses it: a 400 of the upstream's
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", headers=bad, json={
                "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()
        assert r.status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "x-killick-force-response" in body["error"]["message"]
        async with s.post(base + "/v1/chat/completions", headers=bad, json={
                "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()
        assert r.status == 400 and body["error"]["type"] == "invalid_request_error"

    dead, _ = await upstream_proxy(urls=[f"http://127.0.0.1:{free_port()}"])
    with pytest.raises(anthropic.APIStatusError) as a_err:
        await sdk.anthropic(dead, max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert a_err.value.status_code == 503 and a_err.value.body["error"]["type"] == "overloaded_error"
    assert "no upstream replica answered" in a_err.value.body["error"]["message"]
    with pytest.raises(openai.APIStatusError) as o_err:
        await sdk.openai(dead, max_retries=0).responses.create(model="m", input="hi")
    assert o_err.value.status_code == 503 and "Cannot connect" in o_err.value.body["message"]


async def test_keepalives_while_the_upstream_prefills(upstream_proxy):
    base, _ = await upstream_proxy(keepalive_s=0.01)
    long = " ".join(f"word{i}" for i in range(2500))
    body = {"model": "m", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": long}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json=body, headers={"x-session-id": "t-ka"}) as r:
            lines = [line.strip() async for line in r.content]
    first_data = next(i for i, line in enumerate(lines) if b'"delta":{"role"' not in line and line.startswith(b"data:"))
    assert b": keep-alive" in lines[:first_data] and lines[-2] == b"data: [DONE]"


async def test_auto_reasoning_learns_a_killick_replica_splits_the_thinking(upstream_proxy, sdk):
    """--upstream-reasoning auto in front of killick replicas (which send the thinking as reasoning_content): the
    first thinking answer shows it, the replica is taken as parsed from then on, and the agent gets the same
    thinking and answer as under the default."""
    base, pool = await upstream_proxy(reasoning="auto")
    client = sdk.anthropic(base, default_headers=forced(THINK_AND_CALL, "t-auto"))
    assert set(pool.stats()["reasoning"].values()) == {"unknown"}
    msg = await client.messages.create(model="claude-opus-4-8", max_tokens=1100, tools=TOOLS_A,
                                       thinking={"type": "enabled", "budget_tokens": 1024},
                                       messages=[{"role": "user", "content": "List files."}])
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert (msg.content[0].thinking, msg.content[1].text) == ("Need to list files.", "Listing.")
    replica = _session(pool, "t-auto")["replica"]
    assert pool.stats()["reasoning"][replica] == "parsed"
