"""GET and DELETE /v1/responses/{id}: the stored response object as its create call answered it, streaming or
not; 404 in OpenAI's shape for ids never stored, created with store:false, deleted or evicted."""
import json

import pytest

from conftest import FORCED
from proxy.apis.responses.store import RESPONSES, ResponseStore
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
    streamed = await client.get(f"/v1/responses/{unstored['id']}?stream=true")
    assert streamed.status == 400 and (await streamed.json())["error"]["param"] == "stream"


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
