"""`/v1/killick/*` and `killick ctl`: stats, and resizing caches on a live server without a reload."""
import pytest

from tests.proxy.real_stack import real_app, synth_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth_model_dir(tmp_path_factory)


async def test_resize_expert_and_kv_budgets_at_runtime(aiohttp_client, model_dir):
    app, core, _ = real_app(model_dir, moe_backend="hybrid", moe_slots="50%")
    client = await aiohttp_client(app)
    before = await (await client.get("/v1/killick/stats")).json()
    assert before["tokenizer"]["piece_cache_bytes"] <= before["tokenizer"]["piece_cache_budget"]
    cfg = core.runner.model.config
    assert before["engine"]["experts"]["slots"] == len(cfg.moe_layers) * cfg.num_experts // 2
    r = await client.post("/v1/killick/cache", json={"moe_slots": 3, "kv_tokens": 1024, "prefix_host_mb": 8})
    assert r.status == 200, await r.text()
    after = (await r.json())["engine"]
    assert after["experts"]["slots"] == 3 and after["context_length"] == 1024
    assert after["cache_host_budget"] == 8 << 20
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["context_length"] == 1024
    # the server keeps serving after the resize
    chat = await client.post("/v1/chat/completions", json={"model": "x", "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 200


@pytest.mark.parametrize("body, needle", [
    ({"moe_slots": 10**6}, "slots"), ({"moe_slots": -1}, "from 1 to"), ({"bogus": 1}, "moe_slots"),
    ([], "JSON object"), ({"kv_tokens": 10**15}, "from 1 to"), ({"prefix_host_mb": 10**400}, "from 1 to"),
    ({"kv_tokens": 2**30}, "more than"), ({"prefix_host_mb": 2**29}, "more than"),
    ({"prefix_device_mb": 2**29}, "more than")])
async def test_impossible_sizes_are_refused_before_anything_changes(aiohttp_client, model_dir, body, needle):
    app, core, _ = real_app(model_dir, moe_backend="offload", moe_slots="50%")
    client = await aiohttp_client(app)
    before = (await (await client.get("/v1/killick/stats")).json())["engine"]
    r = await client.post("/v1/killick/cache", json=body)
    assert r.status == 400 and needle in (await r.json())["error"]["message"]
    after = (await (await client.get("/v1/killick/stats")).json())["engine"]
    assert {k: after[k] for k in ("experts", "context_length", "cache_host_budget", "cache_device_budget")} == \
        {k: before[k] for k in ("experts", "context_length", "cache_host_budget", "cache_device_budget")}
    assert (await client.get("/metrics")).status == 200


@pytest.mark.parametrize("raw, content_type, status", [
    (b'{"kv_tokens": 16}', "text/plain", 415), (b"kv_tokens=16", "application/x-www-form-urlencoded", 415),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400), (b'{"kv_tokens": ' + b"9" * 5000 + b"}",
                                                                 "application/json", 400)])
async def test_cache_endpoint_takes_only_sane_json(aiohttp_client, model_dir, raw, content_type, status):
    """A page's text/plain or form POST (no CORS preflight) must not resize the cache; nor must a body that
    nests 100k deep or carries a 5,000-digit number crash the endpoint."""
    app, core, _ = real_app(model_dir)
    client = await aiohttp_client(app)
    r = await client.post("/v1/killick/cache", data=raw, headers={"Content-Type": content_type})
    assert r.status == status and (await r.json())["error"]["message"]
    assert core.runner.context_length == 4096


async def test_fused_engine_explains_there_is_no_expert_cache(aiohttp_client, model_dir):
    app, core, _ = real_app(model_dir, moe_backend="fused")
    client = await aiohttp_client(app)
    r = await client.post("/v1/killick/cache", json={"moe_slots": 2})
    assert r.status == 400 and "fused" in (await r.json())["error"]["message"]


async def test_ctl_stats_shows_the_last_turns_of_each_session(aiohttp_client, model_dir):
    from proxy.cli.ctl import _render_stats
    from proxy.policy.cache_policy import PolicyPlanner

    app, core, _ = real_app(model_dir, planner=PolicyPlanner())
    client = await aiohttp_client(app)
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
    for k in range(2):
        r = await client.post("/v1/chat/completions", headers={"x-session-id": "s1"},
                              json={"model": "x", "max_tokens": 3, "temperature": 0, "messages": messages})
        answer = (await r.json())["choices"][0]["message"]
        messages += [{"role": "assistant", "content": answer["content"] or "",
                      "reasoning_content": answer.get("reasoning_content") or ""},
                     {"role": "user", "content": f"and {k}?"}]
    stats = await (await client.get("/v1/killick/stats")).json()
    first, second = stats["policy"]["recent_turns"]
    assert (first["turn"], first["edit_class"], second["turn"]) == (1, "first", 2)
    assert second["cached"] > 0 and second["prefilled"] == second["prompt"] - second["cached"]
    text = _render_stats(stats)
    assert "last turns of each session" in text and "None" not in text
    assert f"policy expected_reprefill_tokens  {stats['policy']['expected_reprefill_tokens']}" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == [second["session"], "2"])
    assert row.split()[-3:-1] == [str(second["cached"]), str(second["prefilled"])]
