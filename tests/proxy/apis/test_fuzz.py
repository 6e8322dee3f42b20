"""Throw >= 1,000 malformed bodies at every POST endpoint: never a 5xx, always the API's error shape.

Bodies are random JSON, random bytes, and mutations of a valid request (a field deleted, replaced by a
random value, or a random field added at any depth), so most reach deep into validation. The app runs
in-process on one event loop; valid requests go to a cheap engine stand-in (this tests the edge).
"""
import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MSG = [{"role": "user", "content": "hi"}]
VALID = {
    "/v1/messages": {"model": "m", "max_tokens": 1025, "stream": True, "system": [{"type": "text", "text": "s"}],
                     "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["x"],
                     "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
                     "tool_choice": {"type": "auto"},
                     "messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": [
                                      {"type": "thinking", "thinking": "t", "signature": "s"},
                                      {"type": "tool_use", "id": "t1", "name": "bash", "input": {"c": 1}}]},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                "content": "r", "is_error": False}]}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": MSG, "system": "s",
                                  "tools": [{"name": "bash", "input_schema": {"type": "object"}}]},
    "/v1/chat/completions": {"model": "m", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                             "stop": ["x"], "tool_choice": "auto",
                             "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
                             "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "reasoning_content": "r", "tool_calls": [
                                              {"id": "c", "type": "function",
                                               "function": {"name": "bash", "arguments": "{}"}}]},
                                          {"role": "tool", "tool_call_id": "c", "content": "o"}]},
    "/v1/responses": {"model": "m", "max_output_tokens": 4, "stream": True, "instructions": "i", "store": False,
                      "include": ["reasoning.encrypted_content"], "truncation": "auto", "background": False,
                      "tools": [{"type": "function", "name": "bash", "parameters": {}}],
                      "input": [{"role": "developer", "content": "d"},
                                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                                {"type": "reasoning", "summary": [], "encrypted_content": "e"},
                                {"type": "function_call", "call_id": "c", "name": "bash", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c", "output": "o"}]},
}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["text", "user", "assistant", "function", "message",
                                                           "tool_use", "reasoning", "", "none", "auto"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["type", "text", "role", "content", "name", "x"]), inner,
                                        max_size=3), max_leaves=8)


@st.composite
def mutated(draw, valid):
    body = json.loads(json.dumps(valid))
    node = body
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node = node[key]
    keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
    action = draw(st.sampled_from(["replace", "delete", "add"])) if keys else "add"
    if action == "add" or not keys:
        if isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(VALUES)
        else:
            node.append(draw(VALUES))
    else:
        key = draw(st.sampled_from(keys))
        if action == "delete":
            del node[key]
        else:
            node[key] = draw(VALUES)
    return json.dumps(body).encode()


def bodies(path):
    return st.one_of(mutated(VALID[path]), mutated(VALID[path]), mutated(VALID[path]),
                     VALUES.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64))


def _check_error(path, resp_status, text):
    assert resp_status < 500, text
    if resp_status >= 400:
        body = json.loads(text)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
        else:
            assert body["error"]["message"] and body["error"]["type"]


def test_fuzz_every_endpoint_no_5xx(fake_stack, caplog):
    from proxy.policy.cache_policy import PolicyPlanner

    app, core = fake_stack(context_length=512, planner=PolicyPlanner())
    loop = asyncio.new_event_loop()
    client = TestClient(TestServer(app, host="127.0.0.1"), loop=loop)
    loop.run_until_complete(client.start_server())
    counts = {}
    try:
        for path in VALID:
            @settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
            @given(bodies(path))
            def fuzz(raw):
                async def one():
                    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
                    return resp.status, await resp.text()

                _check_error(path, *loop.run_until_complete(one()))
                counts[path] = counts.get(path, 0) + 1

            fuzz()
        assert all(counts[p] >= 1000 for p in VALID), counts
        ok = loop.run_until_complete(client.get("/health"))
        assert ok.status == 200
        assert core.active == 0
        failures = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert not failures, failures[:3]
    finally:
        loop.run_until_complete(client.close())
        loop.close()
