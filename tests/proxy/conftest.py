import pytest

from proxy.app import create_app
from proxy.replay.sources import OutputHeader
from proxy_fakes import CharTokenizer, ChatMLRenderer, SlowCore

FORCED = "x-killick-forced-output"


@pytest.fixture
def fake_stack():
    """Protocol-only stand-ins (see fakes.py): returns a factory (app, core) with knobs for slow prefill."""

    def make(prefill_s=0.0, step_s=0.0, keepalive_s=5.0, api_key=None, context_length=4096, planner=None, **kw):
        tok = CharTokenizer()
        core = SlowCore(tok, prefill_s=prefill_s, step_s=step_s)
        app = create_app(core, tok, ChatMLRenderer(tok), model_name="tiny", context_length=context_length,
                         api_key=api_key, keepalive_s=keepalive_s, planner=planner, replies=OutputHeader(), **kw)
        return app, core

    return make


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
