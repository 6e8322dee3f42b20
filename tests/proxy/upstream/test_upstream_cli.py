"""`killick serve --upstream` as a process in front of the replicas: the bundled recordings of each API replayed
through it (`killick replay`), and `killick ctl stats` showing how much of each session's prompts was reused."""
import json
import subprocess
import sys

from proxy.upstream.bench import FIXTURES, REPO, Servers


def _killick(*args):
    return subprocess.Popen([sys.executable, "-m", "proxy.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_recordings_replay_through_killick_serve_upstream(replicas, tmp_path):
    ups = [a for url in replicas.urls for a in ("--upstream", url)]
    with Servers(1, (*ups, "--health-interval", "0.5", "--upstream-model", "claude-*=demo")) as proxy:
        url = proxy.urls[0]
        chat_responses = _killick("replay", str(FIXTURES / "mini-swe-agent.jsonl.gz"),
                                  str(FIXTURES / "codex-compact.jsonl.gz"), "--url", url, "--stream", "--concurrent",
                                  "--quiet", "--json", str(tmp_path / "a.json"))
        anthropic = _killick("replay", str(FIXTURES / "claude.jsonl.gz"), "--limit", "2", "--url", url, "--quiet",
                             "--json", str(tmp_path / "b.json"))
        for proc in (chat_responses, anthropic):
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, out[-2000:] + err[-2000:]
        results = [r for name in ("a", "b")
                   for r in json.loads((tmp_path / f"{name}.json").read_text())["results"]["url"]]
        assert {r["path"] for r in results} == {"/v1/chat/completions", "/v1/responses", "/v1/messages"}
        assert len(results) == 8 + 6 + 2 and all(r["status"] == 200 for r in results)
        later = [r for r in results if r["turn"] >= 2 and r["kind"] == "main"]
        assert all(r["cached_tokens"] > 0 for r in later)  # each session found its prefix on its replica

        ctl = [sys.executable, "-m", "proxy.cli", "ctl", "--server", url]
        stats = subprocess.run([*ctl, "stats"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert stats.returncode == 0 and "upstream replicas (routing session)" in stats.stdout, stats.stderr
        data = json.loads(subprocess.run([*ctl, "stats", "--json"], capture_output=True, text=True, timeout=60,
                                         cwd=REPO).stdout)["engine"]
        sessions = {s["session"]: s for s in data["recent_sessions"]}
        assert data["requests"] == 16 and data["replicas_up"] == 3 and all(s["moves"] == 0 for s in sessions.values())
        assert sessions["anon-1"]["turns"] == 8 and sessions["anon-1"]["cached_tokens"] > 0
        refused = subprocess.run([*ctl, "cache", "--kv", "4096"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert refused.returncode == 2 and "no engine" in refused.stderr
