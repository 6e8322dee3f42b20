"""prepare(): rendering runs off the event loop, and a prompt that cannot fit is refused cheaply."""
import asyncio
import io
import json
import threading

from proxy.app import create_app
from proxy.context import CTX
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
