"""GET and DELETE /v1/responses/{id}: the stored response object as its create call answered it, streaming or
not; 404 in OpenAI's shape for ids never stored, created with store:false, deleted or evicted. The store's
bounds: a count, and the memory of the text it holds."""
import json
import logging

import pytest

from conftest import FORCED
from proxy.apis.responses.store import MB, RESPONSES, ResponseStore, message_bytes
from proxy.conversation import Message, TextPart


def not_found(body: dict, response_id: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and response_id in body["error"]["message"]


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


async def test_get_answers_the_created_response_and_delete_forgets_it(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    created = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 50},
                                       headers={FORCED: "an answer"})).json()
    got = await client.get(f"/v1/responses/{created['id']}")
    assert got.status == 200 and await got.json() == created
    assert created["status"] == "completed" and created["output"] and created["usage"]["output_tokens"] > 0
    gone = await client.delete(f"/v1/responses/{created['id']}")
    assert gone.status == 200
    assert await gone.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}
    for again in (client.get(f"/v1/responses/{created['id']}"), client.delete(f"/v1/responses/{created['id']}")):
        resp = await again
        assert resp.status == 404
        not_found(await resp.json(), created["id"])
    follow = await client.post("/v1/responses", json={"model": "m", "input": "x",
                                                      "previous_response_id": created["id"]})
    assert follow.status == 400


async def test_a_streamed_response_is_stored_as_its_last_event_carried_it(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post("/v1/responses", headers={FORCED: "a longer answer than four tokens"},
                             json={"model": "m", "input": "hi", "stream": True, "max_output_tokens": 4})
    last = sse_events(await resp.text())[-1]
    assert last["type"] == "response.incomplete"
    final = last["response"]
    got = await client.get(f"/v1/responses/{final['id']}")
    assert await got.json() == final and final["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_unknown_and_unstored_ids_are_404(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    unstored = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "store": False})).json()
    for response_id in ("resp_never_made", unstored["id"]):
        for method in (client.get, client.delete):
            resp = await method(f"/v1/responses/{response_id}")
            assert resp.status == 404
            not_found(await resp.json(), response_id)
        streamed = await client.get(f"/v1/responses/{response_id}?stream=true")
        assert streamed.status == 404
        not_found(await streamed.json(), response_id)


def test_the_apps_store_takes_its_memory_bound_in_mb(fake_stack):
    assert fake_stack()[0][RESPONSES].max_bytes == 512 * MB
    assert fake_stack(responses_store_mb=3)[0][RESPONSES].max_bytes == 3 * MB
    with pytest.raises(ValueError, match="max_bytes"):
        fake_stack(responses_store_mb=0)


async def test_the_store_keeps_its_bound(aiohttp_client, fake_stack):
    app = fake_stack()[0]
    app[RESPONSES] = ResponseStore(capacity=2)
    client = await aiohttp_client(app)
    ids = [(await (await client.post("/v1/responses", json={"model": "m", "input": f"q{i}"})).json())["id"]
           for i in range(3)]
    assert [(await client.get(f"/v1/responses/{i}")).status for i in ids] == [404, 200, 200]
    assert len(app[RESPONSES]) == 2


def test_least_recently_used_goes_first():
    store = ResponseStore(capacity=2)
    message = (Message("user", (TextPart("x"),)),)
    store.put("a", message, {"id": "a"})
    store.put("b", message, {"id": "b"})
    assert store.get("a").response == {"id": "a"}  # a read keeps it
    store.put("c", message, {"id": "c"})
    assert store.get("b") is None and store.get("a").messages == message
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def _said(text: str, role="user") -> Message:
    return Message(role, (TextPart(text),))


def test_the_byte_bound_drops_the_oldest_and_keeps_the_one_just_put(caplog):
    one = message_bytes(_said("x" * 1000))
    store = ResponseStore(capacity=10, max_bytes=2 * one + one // 2)
    for name in "abc":
        store.put(name, (_said("x" * 1000),), {"id": name})
    assert store.get("a") is None and store.get("b") and store.get("c")
    assert store.held_bytes <= store.max_bytes
    with caplog.at_level(logging.WARNING, logger="killick.proxy"):
        store.put("huge", (_said("y" * 10_000),), {"id": "huge", "instructions": "z" * 10_000})
    assert len(store) == 1 and store.get("huge").response["instructions"] == "z" * 10_000  # kept, alone
    assert store.held_bytes > 20_000 and "kept alone" in caplog.text and "--responses-store-mb" in caplog.text
    store.put("small", (_said("s"),), {"id": "small"})
    assert store.get("huge") is None and len(store) == 1 and store.held_bytes < 200


def test_a_chains_shared_messages_count_once_until_the_last_holder_goes():
    store = ResponseStore(max_bytes=10 * MB)
    history: tuple[Message, ...] = ()
    for turn in range(4):  # each turn's conversation is the previous one's tuple plus its own messages
        history += (_said("q" * 10_000), _said("a" * 10_000, "assistant"))
        store.put(f"r{turn}", history, {"id": f"r{turn}"})
    every = sum(message_bytes(m) for m in history)
    assert store.held_bytes - every < 4 * 200  # 8 messages once, not 2 + 4 + 6 + 8, plus each response's id
    for turn in range(3):
        store.delete(f"r{turn}")
    assert store.held_bytes - every < 200  # r3 still holds all of them
    store.delete("r3")
    assert store.held_bytes == 0


def test_response_text_held_by_the_messages_is_not_counted_twice():
    text = "o" * 10_000
    answer = Message("assistant", (TextPart(text),))
    store = ResponseStore()
    store.put("r", (_said("q"), answer), {"id": "r", "output": [{"content": [{"text": text}]}]})
    assert store.held_bytes < message_bytes(answer) + 200
    store.put("copy", (_said("q"), answer), {"id": "copy", "output": [{"content": [{"text": "o" * 10_000}]}]})
    assert store.held_bytes > 2 * message_bytes(answer)  # an equal string that is another object is memory too


async def test_the_stored_output_is_the_answers_own_text_held_once(aiohttp_client, fake_stack):
    app = fake_stack()[0]
    client = await aiohttp_client(app)
    call = '<tool_call>\\n{"name": "run", "arguments": {"cmd": "ls"}}\\n</tool_call>'
    tools = [{"type": "function", "name": "run", "parameters": {"type": "object"}}]
    created = await (await client.post("/v1/responses", headers={FORCED: "an answer" + call},
                                       json={"model": "m", "input": "hi", "tools": tools,
                                             "reasoning": {"effort": "none"}})).json()
    stored = app[RESPONSES].get(created["id"])
    text_part, call_part = stored.messages[-1].parts
    message, function_call = stored.response["output"]
    assert text_part.text is message["content"][0]["text"]
    assert call_part.arguments is function_call["arguments"] == '{"cmd": "ls"}'
