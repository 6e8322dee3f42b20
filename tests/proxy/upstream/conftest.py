"""Real servers, not mocks: three `killick serve` processes on loopback (tiny synthetic checkpoint, CPU, each its
own engine and prefix cache) shared by the upstream tests, and the proxy in front of them in-process."""
import pytest

from proxy.upstream.bench import Servers
from real_stack import synth_model_dir


@pytest.fixture(scope="package")
def replicas(tmp_path_factory):
    model = synth_model_dir(tmp_path_factory)
    with Servers(3, ("--model", str(model), "--keepalive", "1", "--cache-host-mb", "256")) as reps:
        yield reps


@pytest.fixture
def proxy(aiohttp_server, replicas):
    """start(urls=None, **kw) -> (base URL, the app's UpstreamPool); forced answers pass through to the replicas."""
    from proxy.context import CTX
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER
    from proxy.upstream.app import create_upstream_app
    from proxy.upstream.config import UpstreamConfig

    async def start(urls=None, keepalive_s=5.0, routing="session", health_interval_s=0.2):
        tok = load_tokenizer(None)
        config = UpstreamConfig(tuple(urls or replicas.urls), routing=routing, health_interval_s=health_interval_s,
                                forward_headers=(FORCE_RESPONSE_HEADER,), model_map=(("claude-*", "mapped"),))
        app = create_upstream_app(config, tok, ChatRenderer(tok), model_name="up", context_length=32768,
                                  keepalive_s=keepalive_s, planner=PolicyPlanner())
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/"), app[CTX].core

    return start
