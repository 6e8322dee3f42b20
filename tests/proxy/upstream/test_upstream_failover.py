"""A replica killed mid-run (SIGKILL, requests in flight): its sessions continue on the others, every request
completes or ends with a clear error, the proxy stays healthy; one killed before its first output token is
answered by another replica; and replicas are used again once they are back."""
import asyncio
import json
import time

import aiohttp

from proxy.replay.scripted import FORCE_RESPONSE_HEADER, Reply, encode_header

SESSIONS, TURNS, KILL_AFTER = 6, 4, 2
ANSWER = encode_header(Reply(text=" ".join(f"step{i}" for i in range(30))))


async def _turn(s: aiohttp.ClientSession, base: str, key: str, history: list) -> str:
    """One streamed chat turn: 'ok', or the error message the stream ended with; anything else fails the test."""
    body = {"model": "m", "stream": True, "max_tokens": 200, "messages": history}
    async with s.post(base + "/v1/chat/completions", json=body,
                      headers={"x-session-id": key, FORCE_RESPONSE_HEADER: ANSWER}) as r:
        if r.status != 200:
            return f"HTTP {r.status}: {(await r.json())['error']['message']}"
        events = [json.loads(line[5:]) async for line in r.content
                  if line.startswith(b"data: {")]
    if "error" in events[-1]:
        return events[-1]["error"]["message"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop", events[-1]
    return "ok"


async def test_killing_one_of_three_replicas_mid_run(upstream_proxy, replicas):
    base, pool = await upstream_proxy(health_interval_s=0.2)
    progress = {f"f{i}": 0 for i in range(SESSIONS)}
    warm, killed = asyncio.Event(), asyncio.Event()
    after: dict[str, str] = {}  # each session's turn begun once the victim was dead

    async def agent(key: str) -> list[str]:
        history, outcomes = [{"role": "user", "content": f"Task {key}: fix the bug."}], []
        async with aiohttp.ClientSession() as s:
            for _ in range(TURNS):
                outcomes.append(await _turn(s, base, key, history))
                history += [{"role": "assistant", "content": f"Done {len(history)}."},
                            {"role": "user", "content": "Next step."}]
                progress[key] += 1
                if min(progress.values()) >= KILL_AFTER:
                    warm.set()
            # a fast session may be on its last turn when the victim dies: one more turn, begun after the kill
            await asyncio.wait_for(killed.wait(), 60)
            after[key] = await _turn(s, base, key, history)
        return outcomes

    async def killer():
        await asyncio.wait_for(warm.wait(), 60)
        homes = {s["session"]: s["replica"] for s in pool.stats()["recent_sessions"]}
        victim = max(replicas.urls, key=lambda u: sum(h == u for h in homes.values()))
        deadline = time.monotonic() + 10
        while next(r for r in pool.router.replicas if r.url == victim).in_flight == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # kill it while it answers
        in_flight = next(r for r in pool.router.replicas if r.url == victim).in_flight
        await asyncio.to_thread(replicas.kill, replicas.urls.index(victim))
        killed.set()
        return victim, [k for k, h in homes.items() if h == victim], in_flight

    *outcomes, (victim, moved, in_flight) = await asyncio.wait_for(
        asyncio.gather(*(agent(k) for k in progress), killer()), 120)
    try:
        flat = [o for session in outcomes for o in session]
        assert len(flat) == SESSIONS * TURNS and moved and in_flight > 0
        errors = [o for o in flat if o != "ok"]
        # only answers already streaming from the victim are lost, each with a message that says so
        assert all(victim in e and ("failed mid-answer" in e or "no upstream replica" in e) for e in errors), errors
        assert all(sum(o != "ok" for o in outcomes[list(progress).index(k)]) <= 1 for k in moved)
        assert after == {k: "ok" for k in progress}  # every session goes on, the moved ones elsewhere
        stats = pool.stats()
        routes = {s["session"]: s for s in stats["recent_sessions"]}
        assert all(routes[k]["replica"] != victim and routes[k]["moves"] == 1 for k in moved)
        assert stats["replicas_up"] == 2 and stats["failures"] >= 1
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/health") as r:
                assert r.status == 200
            async with s.get(base + "/metrics") as r:
                assert f'killick_engine_replicas_healthy{{url="{victim}"}} 0' in await r.text()
        # Killed before its first output (prefilling a long prompt): another replica answers instead.
        retries = stats["retries"]
        history = [{"role": "user", "content": " ".join(f"word{i}" for i in range(4000))}]
        async with aiohttp.ClientSession() as s:
            long_turn = asyncio.create_task(_turn(s, base, "long", history))
            deadline = time.monotonic() + 10
            while not any(r.in_flight for r in pool.router.replicas) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # prefilling ~10k tokens: no output yet
            second = next(r.url for r in pool.router.replicas if r.in_flight)
            await asyncio.to_thread(replicas.kill, replicas.urls.index(second))
            assert await asyncio.wait_for(long_turn, 60) == "ok"
        assert pool.stats()["retries"] == retries + 1
    finally:
        dead = [i for i, p in enumerate(replicas.procs) if p.poll() is not None]
        for i in dead:
            replicas.start(i)
        for i in dead:
            await asyncio.to_thread(replicas.wait_ready, i)
    deadline = time.monotonic() + 10
    while pool.stats()["replicas_up"] < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert pool.stats()["replicas_up"] == 3  # the health check brought it back
