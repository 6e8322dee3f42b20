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
