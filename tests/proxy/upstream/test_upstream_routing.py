"""Routing across replicas, torch- and network-free: stickiness, load for new sessions, failover order."""
import pytest

from proxy.upstream.routing import Router, rendezvous_score, routing_key

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def _serve(router, key):
    """Route one request and let the first choice take it; returns the replica."""
    replica = router.order(key)[0]
    router.started(replica)
    router.answered(key, replica)
    router.finished(key, replica, 100, 60)
    return replica


def test_a_session_sticks_to_its_replica_and_books_its_reuse():
    router = Router(URLS)
    first = _serve(router, "s1")
    assert all(_serve(router, "s1") is first for _ in range(5))
    s = router.stats()
    assert s["sessions"] == 1 and s["requests"] == 6 and s["cached_fraction"] == pytest.approx(0.6)
    [session] = s["recent_sessions"]
    assert (session["replica"], session["turns"], session["moves"], session["cached_tokens"]) == (first.url, 6, 0, 360)


def test_new_sessions_spread_by_load_then_sessions_held_and_ties_go_by_rendezvous():
    router = Router(URLS)
    busy = router.replicas[0]
    router.started(busy)  # a request in flight there
    assert router.order("new")[-1] is busy
    router.finished(None, busy, 0, 0, ok=False)
    homes = {_serve(router, f"s{i}").url for i in range(3)}
    assert homes == set(URLS)  # one session each: the sessions held break the tie
    fresh = Router(URLS)
    best = max(URLS, key=lambda u: rendezvous_score("k", u))
    assert fresh.order("k")[0].url == best  # idle, empty replicas: the hash decides, the same after a restart


def test_side_requests_and_threads_follow_their_main_session():
    assert routing_key("abc#compaction") == routing_key("abc~2") == routing_key("abc#title~3") == "abc"
    router = Router(URLS)
    main = _serve(router, "abc")
    for _ in range(4):
        _serve(router, f"x{_}")  # other sessions load the other replicas
    assert _serve(router, "abc#compaction") is main and _serve(router, "abc~2") is main
    assert router.stats()["sessions"] == 7


def test_a_down_replica_is_tried_last_and_its_sessions_move_once():
    router = Router(URLS)
    home = _serve(router, "s")
    router.failed(home, "refused")
    order = router.order("s")
    assert order[-1] is home and home not in order[:-1]
    moved = _serve(router, "s")
    assert moved is not home and router.stats()["session_moves"] == 1
    router.set_health(home, True)
    assert _serve(router, "s") is moved  # its cache is there now: it stays
    assert router.stats()["replicas_up"] == 3 and router.stats()["last_errors"] == {home.url: "refused"}


def test_round_robin_and_requests_without_a_session():
    rr = Router(URLS, policy="round-robin")
    assert [_serve(rr, "s").url for _ in range(6)] == URLS * 2
    router = Router(URLS)
    router.started(router.replicas[0])
    assert router.order(None)[0] is not router.replicas[0]  # least loaded


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError, match="twice"):
        Router(["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match="routing"):
        Router(URLS, policy="random")


def test_the_session_tables_stay_bounded():
    router = Router(URLS, max_sessions=4)
    for i in range(10):
        _serve(router, f"s{i}")
    assert len(router.sessions) == 4 and len(router.homes) == 4
    assert [s["session"] for s in router.stats()["recent_sessions"]] == ["s9", "s8", "s7", "s6"]


def test_a_side_request_sent_before_the_first_answer_follows_the_session():
    """Codex sends a compaction (KEY#compaction) while KEY's first prompt is still prefilling: both go to one
    replica, and the later answer of either does not move the session away from its prefix."""
    router = Router(URLS)
    first = router.order("k")[0]
    router.started(first, "k")  # not answered yet: its prefill runs
    side = router.order("k#compaction")[0]
    assert side is first
    router.started(side, "k#compaction")
    router.answered("k#compaction", side)
    router.answered("k", first)
    assert router.order("k")[0] is first
    for key in ("k", "k#compaction"):
        router.finished(key, first, 100, 0)
    assert first.in_flight == 0
