"""prepare(): rendering and planning run off the event loop, and a prompt that cannot fit is refused cheaply."""
import asyncio
import io
import json
import threading

import pytest

from conftest import FORCED
from proxy.app import create_app
from proxy.context import CTX
from proxy.policy.planner import NoAnchors
from proxy.prompt.render import ChatRenderer
from proxy.prompt.tokenizer import load_tokenizer
from proxy_fakes import CharTokenizer, ChatMLRenderer, SlowCore

MSG = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_rendering_leaves_the_event_loop_free(aiohttp_client, fake_stack):
    entered, gate = threading.Event(), threading.Event()

    class Slow(ChatMLRenderer):
        def render(self, conv, add_generation_prompt=True):
            entered.set()
            assert gate.wait(10), "the event loop was blocked while rendering"
            return super().render(conv, add_generation_prompt)

    app, core = fake_stack()
    app[CTX].renderer = Slow(core.tok)
    client = await aiohttp_client(app)
    post = asyncio.ensure_future(client.post("/v1/messages", json=MSG))
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
    assert (await client.get("/health")).status == 200  # answered while the render is still running
    gate.set()
    assert (await post).status == 200


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_all_tokenized(aiohttp_client):
    tok = load_tokenizer(None)
    encoded = []
    lib = tok._plain
    tok._plain = type("Spy", (), {"encode": lambda self, text, **kw: (encoded.append(len(text)),
                                                                      lib.encode(text, **kw))[1],
                                  "__getattr__": lambda self, name: getattr(lib, name)})()
    app = create_app(SlowCore(CharTokenizer()), tok, ChatRenderer(tok), context_length=4096)
    client = await aiohttp_client(app)
    for n in range(2):  # distinct 2 MB messages
        body = {**MSG, "messages": [{"role": "user", "content": f"{n} words of an agent's long paste. " * 60_000}]}
        resp = await client.post("/v1/messages", data=io.BytesIO(json.dumps(body).encode()),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400 and "prompt is too long" in (await resp.json())["error"]["message"]
    assert sum(encoded) <= 4 * 65536  # two bounded prefixes, not 4 MB
    assert tok._pieces.bytes < 1 << 20  # and nothing of them kept
    assert (await client.post("/v1/messages", json=MSG)).status == 200


class BlockingPlanner(NoAnchors):
    """Plans a request whose last message says "big" only once `gate` opens (at most 5 s), as the cache policy
    takes its time over a huge conversation; notes whether the gate opened in time."""

    def __init__(self):
        super().__init__()
        self.entered, self.gate, self.opened = threading.Event(), threading.Event(), []

    def __call__(self, conv, rendered, headers, request=None):
        if "big" in conv.messages[-1].text:
            self.entered.set()
            self.opened.append(self.gate.wait(5))
        return super().__call__(conv, rendered, headers, request)


async def test_planning_leaves_the_event_loop_free(aiohttp_client, fake_stack):
    planner = BlockingPlanner()
    app, _ = fake_stack(planner=planner)
    client = await aiohttp_client(app)
    big = asyncio.ensure_future(client.post("/v1/messages", json={**MSG, "messages": [
        {"role": "user", "content": "a big one"}]}))
    assert await asyncio.get_running_loop().run_in_executor(None, planner.entered.wait, 10)
    assert (await client.get("/health")).status == 200  # answered while the plan is still being made
    planner.gate.set()
    assert (await big).status == 200 and planner.opened == [True]


async def test_another_requests_stream_goes_on_while_a_large_request_is_planned(aiohttp_client, fake_stack):
    """A request streaming its answer keeps sending events while another request's plan is being made; the
    plan waits for them (the gate opens only once they came)."""
    planner = BlockingPlanner()
    app, core = fake_stack(step_s=0.02, planner=planner)
    client = await aiohttp_client(app)
    streaming = await client.post("/v1/messages", json={**MSG, "max_tokens": 60, "stream": True},
                                  headers={FORCED: "word " * 20})
    await streaming.content.readline()  # under way
    big = asyncio.ensure_future(client.post("/v1/messages", json={**MSG, "messages": [
        {"role": "user", "content": "a big one"}]}))
    assert await asyncio.get_running_loop().run_in_executor(None, planner.entered.wait, 10)
    deltas = 0
    while deltas < 10:  # the stream's deltas that came while the plan was in the making
        line = await asyncio.wait_for(streaming.content.readline(), 10)
        assert line, "the stream ended early"
        deltas += line.startswith(b"data: ") and b'"content_block_delta"' in line
    planner.gate.set()
    assert (await big).status == 200 and planner.opened == [True]
    await streaming.read()
    assert core.active == 0


async def test_two_requests_of_one_session_sent_at_once_get_their_own_turns(aiohttp_client, fake_stack):
    """Planned in the planning threads at the same time, they take the cache policy's lock in turn: one session,
    turns 1 and 2 in `killick ctl stats`."""
    from proxy.policy.cache_policy import PolicyPlanner

    app, _ = fake_stack(planner=PolicyPlanner())
    client = await aiohttp_client(app)
    posts = [client.post("/v1/messages", json=MSG, headers={"x-session-id": "twin"}) for _ in range(2)]
    assert [r.status for r in await asyncio.gather(*posts)] == [200, 200]
    rows = (await (await client.get("/v1/killick/stats")).json())["policy"]["recent_turns"]
    assert sorted((r["session"], r["turn"]) for r in rows) == [("twin", 1), ("twin", 2)]


@pytest.mark.parametrize("refusal, status", [("a bad forced reply", 400), ("a full queue", 429)])
async def test_a_request_refused_after_planning_takes_no_turn_number(aiohttp_client, fake_stack, tmp_path, refusal,
                                                                     status):
    """Planned, then refused before the engine took it (a forced reply that does not decode, a full queue): the
    session's next request is its second turn, in `killick ctl stats` and in the recording."""
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.replay.record import Recorder
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER
    from proxy.replay.sources import FirstReply, ForcedResponses, OutputHeader

    app, core = fake_stack(planner=PolicyPlanner(), replies=FirstReply(ForcedResponses(), OutputHeader()),
                           observer=Recorder(tmp_path))
    client = await aiohttp_client(app)
    session = {"x-session-id": "s"}
    statuses = [(await client.post("/v1/messages", json=MSG, headers=session)).status]
    if refusal == "a full queue":
        core.max_running = core.max_waiting = 0
        statuses.append((await client.post("/v1/messages", json=MSG, headers=session)).status)
        core.max_running, core.max_waiting = SlowCore.max_running, SlowCore.max_waiting
    else:
        statuses.append((await client.post("/v1/messages", json=MSG,
                                           headers={**session, FORCE_RESPONSE_HEADER: "not base64 json"})).status)
    statuses.append((await client.post("/v1/messages", json=MSG, headers=session)).status)
    assert statuses == [200, status, 200]
    rows = (await (await client.get("/v1/killick/stats")).json())["policy"]["recent_turns"]
    assert [(r["session"], r["turn"]) for r in rows] == [("s", 1), ("s", 2)]
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(x["status"], x["metrics"]["turn_index"]) for x in lines if x["status"] == 200] == [(200, 0), (200, 1)]
    assert all(x["metrics"]["turn_index"] is None for x in lines if x["status"] != 200)


@pytest.mark.parametrize("refusal, status", [("a bad forced reply", 400), ("a full queue", 429)])
async def test_requests_refused_after_planning_evict_no_agent_session(aiohttp_client, fake_stack, refusal, status):
    """40 requests that name no session (each a new one) refused after planning, more than the store's 32
    sessions: the agent's session keeps its place and its next turn is diffed against its last one (the fake
    engine keeps no checkpoints: test_sessions checks the resume); the refused requests leave no session in
    `killick ctl stats`."""
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER
    from proxy.replay.sources import FirstReply, ForcedResponses, OutputHeader

    app, core = fake_stack(planner=PolicyPlanner(), replies=FirstReply(ForcedResponses(), OutputHeader()))
    client = await aiohttp_client(app)
    agent = {"x-session-id": "agent"}
    first = await (await client.post("/v1/messages", json=MSG, headers=agent)).json()
    bad = {FORCE_RESPONSE_HEADER: "not base64 json"} if refusal == "a bad forced reply" else {}
    if refusal == "a full queue":
        core.max_running = core.max_waiting = 0
    for k in range(40):
        stranger = {**MSG, "messages": [{"role": "user", "content": f"stranger {k}"}]}
        assert (await client.post("/v1/messages", json=stranger, headers=bad)).status == status
    core.max_running, core.max_waiting = SlowCore.max_running, SlowCore.max_waiting
    more = [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "more"}]
    second = await client.post("/v1/messages", json={**MSG, "messages": MSG["messages"] + more}, headers=agent)
    assert second.status == 200 and second.headers["x-killick-edit-class"] != "first"  # diffed against turn 1
    assert int(second.headers["x-killick-edit-point"]) >= first["usage"]["input_tokens"]
    policy = (await (await client.get("/v1/killick/stats")).json())["policy"]
    assert policy["sessions"] == 1
    assert [(r["session"], r["turn"]) for r in policy["recent_turns"]] == [("agent", 1), ("agent", 2)]
