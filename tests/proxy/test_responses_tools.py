"""Responses namespace tools (Codex's multi_agent_v1, MCP servers): offered under flat names, a call goes back out
with its `namespace`, and Codex's echo of it renders as the model wrote it. Stand-in engine (the real one, and the
cache policy's verdict on the echoed turn: test_e2e.py)."""
import json
import logging

import pytest

from conftest import FORCED
from proxy.apis.responses.schema import ResponsesRequest, to_conversation
from proxy.apis.responses.tools import offered_tools

CLOSE = {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}
PATCH = {"type": "custom", "name": "patch", "description": "Edit files.", "format": {"type": "text"}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for managing sub-agents.",
             "tools": [CLOSE, PATCH]}
TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}, NAMESPACE]
CALL = '<tool_call>\\n{"name": "multi_agent_v1__close_agent", "arguments": {"target": "a1"}}\\n</tool_call>'


def _request(**body):
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})


def test_namespace_tools_are_offered_under_flat_names():
    specs = to_conversation(_request(tools=TOOLS), ()).tools
    assert [s.name for s in specs] == ["exec_command", "multi_agent_v1__close_agent", "multi_agent_v1__patch"]
    assert specs[1].description == "Tools for managing sub-agents.\n\nClose an agent."
    assert specs[1].parameters == CLOSE["parameters"] and specs[2].parameters["required"] == ["input"]
    tool = offered_tools(_request(tools=TOOLS).tools)["multi_agent_v1__patch"]
    assert (tool.name, tool.namespace, tool.custom) == ("patch", "multi_agent_v1", True)


def test_the_real_template_lists_namespace_tools_like_any_function():
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer

    text = ChatRenderer(load_tokenizer(None)).render(to_conversation(_request(tools=TOOLS), ())).text
    listed = [json.loads(line) for line in text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()]
    assert [t["function"]["name"] for t in listed] == [
        "exec_command", "multi_agent_v1__close_agent", "multi_agent_v1__patch"]
    assert listed[1]["function"]["description"].startswith("Tools for managing sub-agents.")


def test_flat_names_follow_codex_and_never_shadow_another_tool(caplog):
    mcp = {"type": "namespace", "name": "mcp__files__", "tools": [{"type": "function", "name": "_ls"}]}
    clash = {"type": "namespace", "name": "multi_agent_v1", "tools": [CLOSE, {"type": "web_search"}]}
    tools = [mcp, clash, {"type": "function", "name": "multi_agent_v1__close_agent"}]
    with caplog.at_level(logging.WARNING, logger="killick.proxy"):
        offered = offered_tools(_request(tools=tools).tools)
    assert list(offered) == ["mcp__files__ls", "multi_agent_v1__close_agent"]
    assert offered["multi_agent_v1__close_agent"].namespace is None  # the plain tool keeps its name
    assert "namespace 'multi_agent_v1' is not offered: another tool already has that name" in caplog.text
    assert "'web_search' inside namespace 'multi_agent_v1' is not served" in caplog.text


@pytest.mark.parametrize("tool,param", [({"type": "namespace", "tools": [CLOSE]}, "tools[0].name"),
                                        ({"type": "namespace", "name": "ns"}, "tools[0].tools")])
async def test_a_namespace_without_name_or_tools_is_a_400(aiohttp_client, fake_stack, tool, param):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "tools": [tool]})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert not core.requests


async def _stream_items(resp) -> tuple[list[dict], dict]:
    """(every event, the final response) of a Responses stream."""
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: {")]
    return events, events[-1]["response"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_namespaced_call_goes_out_with_its_namespace_and_comes_back_as_written(aiohttp_client, fake_stack,
                                                                                       stream):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    body = {"model": "m", "input": "close it", "tools": TOOLS, "reasoning": {"effort": "none"}, "stream": stream}
    resp = await client.post("/v1/responses", json=body, headers={FORCED: CALL})
    if stream:
        events, out = await _stream_items(resp)
        added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert (added["name"], added["namespace"], done["name"]) == ("close_agent", "multi_agent_v1", "close_agent")
    else:
        out = await resp.json()
    call = out["output"][-1]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
    assert json.loads(call["arguments"]) == {"target": "a1"}
    first = core.tok.decode(core.requests[-1].prompt_ids)
    model_wrote = CALL.replace("\\n", "\n")
    echo = {k: call[k] for k in ("type", "id", "status", "name", "namespace", "arguments", "call_id")}  # as Codex
    follow = [{"role": "user", "content": "close it"}, echo,
              {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}]
    resp = await client.post("/v1/responses", json={**body, "input": follow, "stream": False})
    assert resp.status == 200
    assert core.tok.decode(core.requests[-1].prompt_ids).startswith(first + model_wrote)


async def test_a_namespaced_custom_tool_call_is_a_custom_tool_call_with_its_namespace(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    patch = '<tool_call>\\n{"name": "multi_agent_v1__patch", "arguments": {"input": "*** Begin"}}\\n</tool_call>'
    out = await (await client.post("/v1/responses", headers={FORCED: patch}, json={
        "model": "m", "input": "fix", "tools": TOOLS, "reasoning": {"effort": "none"}})).json()
    call = out["output"][-1]
    assert (call["type"], call["name"], call["namespace"], call["input"]) == (
        "custom_tool_call", "patch", "multi_agent_v1", "*** Begin")
    follow = [{"role": "user", "content": "fix"}, call,
              {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "ok"}]
    assert (await client.post("/v1/responses", json={"model": "m", "input": follow, "tools": TOOLS})).status == 200
    assert '{"name": "multi_agent_v1__patch", "arguments": {"input": "*** Begin"}}' in core.tok.decode(
        core.requests[-1].prompt_ids)


def test_a_recorded_namespaced_call_replays_under_the_name_the_model_wrote():
    from proxy.replay.log import reply_from_response

    output = [{"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1",
               "arguments": '{"target": "a1"}'},
              {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "namespace": "multi_agent_v1",
               "input": "x"}]
    reply = reply_from_response("/v1/responses", {"output": output})
    assert [name for name, _ in reply.tool_calls] == ["multi_agent_v1__close_agent", "multi_agent_v1__patch"]
