"""Cross-site requests and DNS rebinding: a page in the user's browser must not reach a loopback server."""
import pytest

from proxy.sites import Sites, is_loopback
from test_errors import anthropic_error, openai_error

EVIL = {"Origin": "http://evil.example", "Host": "evil.example"}


@pytest.mark.parametrize("origin,host,refused", [
    (None, "127.0.0.1:8421", False), (None, "localhost:8421", False), (None, "[::1]:8421", False),
    (None, "127.3.2.1", False), ("http://localhost:3000", "127.0.0.1:8421", False),
    ("http://127.0.0.1:8421", "127.0.0.1:8421", False), (None, None, False),
    ("http://evil.example", "127.0.0.1:8421", True), ("null", "127.0.0.1:8421", True),
    (None, "evil.example", True), (None, "evil.example:8421", True), (None, "127.0.0.1.evil.example", True),
    (None, "[::1", True), ("http://127.0.0.1.evil.example", "127.0.0.1:8421", True),
])
def test_loopback_bind(origin, host, refused):
    assert (Sites.for_bind("127.0.0.1").refusal(origin, host) is not None) == refused


def test_allow_lists_and_other_binds():
    sites = Sites.for_bind("127.0.0.1", origins=["https://App.example/"], hosts=["box.lan"])
    assert sites.refusal("https://app.example", "box.lan:8421") is None
    assert sites.refusal("https://other.example", "box.lan") is not None
    assert Sites.for_bind("0.0.0.0").refusal(None, "box.lan:8421") is None  # names are the user's business
    assert Sites.for_bind("0.0.0.0").refusal("http://evil.example", "box.lan") is not None
    assert Sites.for_bind("::1", origins=["*"], hosts=["*"]).refusal("http://evil.example", "evil.example") is None
    assert [is_loopback(h) for h in ("localhost", "::1", "127.0.0.2", "0.0.0.0", "example.com")] == \
        [True, True, True, False, False]


@pytest.mark.parametrize("method,path", [("POST", "/v1/killick/cache"), ("POST", "/v1/messages"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                         ("GET", "/v1/killick/stats"), ("GET", "/metrics")])
@pytest.mark.parametrize("headers", [EVIL, {"Origin": "http://evil.example"}, {"Host": "evil.example"}])
async def test_foreign_sites_are_403_in_the_routes_shape(aiohttp_client, fake_stack, method, path, headers):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    resp = await client.request(method, path, json={"kv_tokens": 16} if method == "POST" else None, headers=headers)
    assert resp.status == 403
    shape = anthropic_error if path.startswith("/v1/messages") else openai_error
    assert "allow" in shape(await resp.json())["message"]
    assert core.requests == []


PAGE = "http://localhost:3000"  # a loopback page: allowed by default, and another origin than the server's


async def test_an_allowed_page_gets_its_preflight_before_authentication(aiohttp_client, fake_stack):
    """A browser asks (OPTIONS, no key) before a JSON POST with a key; the answer allows the method and exactly
    the headers it asked for. A page that may not call the server is refused at the preflight."""
    app, core = fake_stack(api_key="k")
    client = await aiohttp_client(app)
    asked = "authorization, content-type, anthropic-dangerous-direct-browser-access"
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses", "/v1/models"):
        resp = await client.options(path, headers={"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": asked})
        assert resp.status == 204, path
        assert resp.headers["Access-Control-Allow-Origin"] == PAGE and "Origin" in resp.headers["Vary"]
        assert resp.headers["Access-Control-Allow-Headers"] == asked
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    resp = await client.options("/v1/messages", headers={"Origin": "http://evil.example",
                                                         "Access-Control-Request-Method": "POST"})
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    assert core.requests == []


async def test_every_answer_to_an_allowed_page_names_its_origin(aiohttp_client, fake_stack):
    """The page reads answers, streamed ones and errors too; without an Origin (an agent) no CORS header goes."""
    sites = Sites.for_bind("127.0.0.1", origins=["https://app.example"])
    client = await aiohttp_client(fake_stack(sites=sites)[0])
    page = {"Origin": "https://app.example"}
    chat = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    whole = await client.post("/v1/chat/completions", json=chat, headers=page)
    streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=page)
    bad = await client.post("/v1/chat/completions", json={"model": "m"}, headers=page)
    assert [r.status for r in (whole, streamed, bad)] == [200, 200, 400]
    for resp in (whole, streamed, bad):
        await resp.read()
        assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert resp.headers["Access-Control-Expose-Headers"] == "*" and "Origin" in resp.headers["Vary"]
    agent = await client.post("/v1/chat/completions", json=chat)
    assert agent.status == 200 and "Access-Control-Allow-Origin" not in agent.headers
