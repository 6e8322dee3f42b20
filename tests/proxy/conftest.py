import pytest

from proxy.app import create_app
from proxy.replay.sources import OutputHeader
from proxy_fakes import CharTokenizer, ChatMLRenderer, SlowCore

FORCED = "x-killick-forced-output"


@pytest.fixture
def fake_stack():
    """Protocol-only stand-ins (see fakes.py): returns a factory (app, core) with knobs for slow prefill."""

    def make(prefill_s=0.0, step_s=0.0, keepalive_s=5.0, api_key=None, context_length=4096, planner=None,
             replies=None, **kw):
        tok = CharTokenizer()
        core = SlowCore(tok, prefill_s=prefill_s, step_s=step_s)
        app = create_app(core, tok, ChatMLRenderer(tok), model_name="tiny", context_length=context_length,
                         api_key=api_key, keepalive_s=keepalive_s, planner=planner,
                         replies=replies or OutputHeader(), **kw)
        return app, core

    return make


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A seeded synthetic checkpoint (real_stack.py), made once per test module."""
    from real_stack import synth_model_dir

    return synth_model_dir(tmp_path_factory)


@pytest.fixture
def serve(aiohttp_server, model_dir):
    """start(**real_app options) -> (base URL, EngineCore, tokenizer): the real stack on loopback."""
    from real_stack import real_app

    async def start(**kw):
        app, core, tok = real_app(model_dir, **kw)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/"), core, tok

    return start


class _Clients:
    """Official SDK clients against a test server; all closed at teardown (unclosed sockets are errors)."""

    def __init__(self):
        self.made = []

    def anthropic(self, base, **kw):
        import anthropic

        kw.setdefault("api_key", "sk-ant-dummy")
        self.made.append(anthropic.AsyncAnthropic(base_url=base, **kw))
        return self.made[-1]

    def openai(self, base, **kw):
        import openai

        kw.setdefault("api_key", "sk-dummy")
        self.made.append(openai.AsyncOpenAI(base_url=base + "/v1", **kw))
        return self.made[-1]


@pytest.fixture
async def sdk():
    clients = _Clients()
    yield clients
    for client in clients.made:
        await client.close()


# --- upstream mode (tests/proxy/upstream): real servers, not mocks --------------------------------------------
# Three `killick serve` processes on loopback (tiny synthetic checkpoint, CPU, each its own engine and prefix
# cache), started once when an upstream test first asks, and the proxy in front of them in-process.

@pytest.fixture(scope="package")
def replicas(tmp_path_factory):
    from proxy.upstream.bench import Servers
    from real_stack import synth_model_dir

    model = synth_model_dir(tmp_path_factory)
    with Servers(3, ("--model", str(model), "--keepalive", "1", "--cache-host-mb", "256")) as reps:
        yield reps


@pytest.fixture
def upstream_proxy(upstream_front, replicas):
    """start(urls=None, **kw) -> (base URL, the app's UpstreamPool) in front of the three replicas (or `urls`)."""

    async def start(urls=None, **kw):
        return await upstream_front(urls or replicas.urls, **kw)

    return start


@pytest.fixture
def upstream_front(aiohttp_server):
    """start(urls, **kw) -> (base URL, the app's UpstreamPool) in front of `urls`; forced answers pass through."""
    from proxy.context import CTX
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER
    from proxy.upstream.app import create_upstream_app
    from proxy.upstream.config import UpstreamConfig

    async def start(urls, keepalive_s=5.0, routing="session", health_interval_s=0.2, reasoning="parsed", **options):
        tok = load_tokenizer(None)
        config = UpstreamConfig(tuple(urls), routing=routing, health_interval_s=health_interval_s,
                                forward_headers=(FORCE_RESPONSE_HEADER,), model_map=(("claude-*", "mapped"),),
                                reasoning=reasoning)
        app = create_upstream_app(config, tok, ChatRenderer(tok), model_name="up", context_length=32768,
                                  keepalive_s=keepalive_s, planner=PolicyPlanner(), **options)
        server = await aiohttp_server(app)  # (aiohttp's test server cancels a handler whose client left, as serve)
        return str(server.make_url("")).rstrip("/"), app[CTX].core

    return start
