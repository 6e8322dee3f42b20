"""`killick serve`: options, and a real process that prints one startup line and answers on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import NamedTuple
import urllib.error
import urllib.request

import pytest

from proxy.cli import build_parser
from proxy.cli.demo import DEFAULT_RECORDING
from real_stack import synth_model_dir


def test_serve_defaults_are_loopback():
    args = build_parser(only="serve").parse_args(["serve"])
    assert (args.host, args.port, args.max_running, args.api_key, args.model) == ("127.0.0.1", 8421, 4, None, None)
    assert args.responses_store_mb == 512


def test_api_key_from_the_environment_and_site_flags(monkeypatch):
    from proxy.cli.serve import api_key

    parse = build_parser(only="serve").parse_args
    monkeypatch.setenv("KILLICK_API_KEY", "from-env")
    assert api_key(parse(["serve"])) == "from-env"  # not on the command line, where ps shows it
    assert api_key(parse(["serve", "--api-key", "flag"])) == "flag"
    monkeypatch.setenv("KILLICK_API_KEY", "")
    assert api_key(parse(["serve"])) is None
    args = parse(["serve", "--allow-origin", "https://a.example", "--allow-origin", "https://b.example",
                  "--allow-host", "box.lan"])
    assert (args.allow_origin, args.allow_host) == (["https://a.example", "https://b.example"], ["box.lan"])
    help_text = build_parser(only="serve")._subparsers._group_actions[0].choices["serve"].format_help()
    assert all(flag in help_text for flag in ("KILLICK_API_KEY", "--allow-origin", "--allow-host"))


def test_the_startup_line_names_a_url_an_ipv6_bind_can_be_reached_at():
    from proxy.cli.serve import serving_url

    assert serving_url("127.0.0.1", 8421) == "http://127.0.0.1:8421"
    assert serving_url("::1", 8421) == "http://[::1]:8421"  # http://::1:8421 is no URL: launch, ctl, curl refuse it


def test_a_flag_that_cannot_work_fails_before_the_model_loads(tmp_path):
    """Each is one line on stderr and exit 2, with nothing else printed: no model loaded first (its log lines
    would come before the error)."""
    from test_cli import assert_user_error, killick

    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for argv, needle in ((["--keepalive", "0"], "--keepalive"), (["--record", str(blocker)], "--record"),
                         (["--script", str(tmp_path / "none.json")], "--script"),
                         (["--script-var", "novalue", "--script", str(blocker)], "--script-var"),
                         (["--harness-rules", str(blocker)], "afile"), (["--host", "nosuch.invalid"], "--host"),
                         (["--responses-store-mb", "0"], "--responses-store-mb 512")):
        assert_user_error(killick("serve", "--port", str(_free_port()), *argv), needle)
    result = killick("serve", "--port", "99999")
    assert result.returncode == 2 and "expected a TCP port from 1 to 65535" in result.stderr


def test_steady_malloc_leaves_a_users_setting_alone(monkeypatch):
    import ctypes

    from proxy.cli import serve

    calls = []
    libc = type("Libc", (), {"mallopt": staticmethod(lambda *a: calls.append(a) or 1)})()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    env = {}
    monkeypatch.setattr(serve.os, "environ", env)
    assert serve.steady_malloc() and calls == [(serve.M_ARENA_MAX, 4), (serve.M_MMAP_THRESHOLD, 131072)]
    assert env == {"RAYON_NUM_THREADS": "4"}  # an arena for each of the tokenizer's encode threads
    env.update(RAYON_NUM_THREADS="16", MALLOC_ARENA_MAX="8")
    assert not serve.steady_malloc() and len(calls) == 2 and env["RAYON_NUM_THREADS"] == "16"
    del env["MALLOC_ARENA_MAX"]
    assert serve.steady_malloc() and env["RAYON_NUM_THREADS"] == "16"  # the user's setting stays


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_starts_answers_and_stops(tmp_path_factory):
    model = synth_model_dir(tmp_path_factory)
    port = _free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--model", str(model), "--port", str(port),
           "--max-running", "2", "--moe-backend", "offload", "--moe-slots", "50%"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd(), "KILLICK_API_KEY": "k"})
    try:
        deadline = time.monotonic() + 120
        line, head = "", ""
        while time.monotonic() < deadline and "serving on" not in line:
            line = proc.stdout.readline()
            head += line
            if not line and proc.poll() is not None:
                pytest.fail(f"killick serve exited with {proc.returncode}")
        assert f"http://127.0.0.1:{port}" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert json.load(r)["status"] == "ok"
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"x-api-key": "k"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["data"][0]["context_length"] > 0
        with pytest.raises(urllib.error.HTTPError) as refused:  # the key came from KILLICK_API_KEY
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        refused.value.close()
        assert refused.value.code == 401
        ctl = [sys.executable, "-m", "proxy.cli", "ctl", "--server", f"http://127.0.0.1:{port}", "--api-key", "k"]
        out = subprocess.run([*ctl, "cache", "--moe", "5", "--kv", "2048"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "(5 slots)" in out.stdout and "context_length" in out.stdout, out.stderr
        out = subprocess.run([*ctl, "stats", "--json"], capture_output=True, text=True, timeout=60)
        assert json.loads(out.stdout)["context_length"] == 2048
        # the key from $KILLICK_API_KEY, the server after the action, without its scheme and as a harness's base URL
        keyed = {**os.environ, "PYTHONPATH": os.getcwd(), "KILLICK_API_KEY": "k"}
        out = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "stats", "--json", "--server",
                              f"127.0.0.1:{port}/v1"], capture_output=True, text=True, timeout=60, env=keyed)
        assert out.returncode == 0 and json.loads(out.stdout)["context_length"] == 2048, out.stderr
        out = subprocess.run([sys.executable, "-m", "proxy.cli", "replay", str(DEFAULT_RECORDING), "--url",
                              f"http://127.0.0.1:{port}", "--limit", "1", "--unforced", "--unforced-max-tokens", "2",
                              "--quiet"], capture_output=True, text=True, timeout=120, env=keyed)
        assert out.returncode == 0 and "401" not in out.stdout, out.stdout + out.stderr
        bad = subprocess.run([*ctl, "cache", "--moe", "100000"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "slots" in bad.stderr and "Traceback" not in bad.stderr
        for path, headers, status in (("/nope", {"x-api-key": "k"}, 404), ("/v1/models", {}, 401)):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers),
                                       timeout=10)
            err.value.close()  # it holds the connection open
            assert err.value.code == status
        metrics = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"x-api-key": "k"})
        with urllib.request.urlopen(metrics, timeout=10) as r:
            text = r.read().decode()
        assert 'killick_requests_total{api="unmatched",status="404"} 1' in text       # every path counts
        assert 'killick_requests_total{api="/v1/models",status="401"} 2' in text  # this one and the first
        taken = subprocess.run(cmd, capture_output=True, text=True, timeout=60,  # the same port again
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert taken.returncode == 2 and "Traceback" not in taken.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr and "context length" not in taken.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log = head + proc.stdout.read()
        proc.stdout.close()
    assert "context length 262144 tokens: the model's max_position_embeddings" in log   # why, in the log
    assert "killick.access: GET /health 200" in log and "GET /nope 404" in log and "GET /v1/models 401" in log


class Served(NamedTuple):
    proc: subprocess.Popen
    port: int


def _serving(tmp_path_factory) -> Served:
    """`killick serve` on the tiny model in a process of its own, once it says it serves; forced answers allowed."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--model", str(synth_model_dir(
        tmp_path_factory)), "--port", str(port), "--allow-forced-responses"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "serving on" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, "killick serve exited"
    return Served(proc, port)


def _stream_forced(port: int, words: int) -> tuple[socket.socket, bytes]:
    """A streamed Chat request whose answer is forced to `words` words (the tiny model may end its own after a
    token or two) -> the agent's socket and what it read, up to the first event."""
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER, Reply, encode_header

    body = json.dumps({"model": "m", "max_tokens": 100000, "stream": True, "messages": [
        {"role": "user", "content": "hi"}]}).encode()
    agent = socket.create_connection(("127.0.0.1", port), timeout=60)
    agent.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"{FORCE_RESPONSE_HEADER}: {encode_header(Reply(text='word ' * words))}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while b"data: " not in seen and len(seen) < 1 << 20:
        seen += agent.recv(65536)
    return agent, seen


def _ended(proc: subprocess.Popen) -> str:
    """What the server printed that was not read yet, once it has ended (killed if it still runs)."""
    if proc.poll() is None:
        proc.kill()
    log = proc.stdout.read()
    proc.stdout.close()
    return log


def test_ctrl_c_twice_while_an_answer_streams_stops_the_engine_then_exits(tmp_path_factory):
    """The first Ctrl-C says what it waits for; the second, pressed after that line, leaves at once, without the
    abort of a Python exit while the engine thread is inside a step ('terminate called without an active
    exception', exit 134)."""
    (proc, port), lines = _serving(tmp_path_factory), []
    try:
        agent, _ = _stream_forced(port, 20000)
        with agent:
            proc.send_signal(signal.SIGINT)
            while "Ctrl-C again" not in (line := proc.stdout.readline()):
                assert line, "killick serve exited after one Ctrl-C"
                lines.append(line)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
    finally:
        log = "".join(lines) + _ended(proc)
    assert code == 130 and "terminate called" not in log and "Traceback" not in log, log[-2000:]


def test_sigterm_lets_the_answer_in_flight_finish_then_exits(tmp_path_factory):
    """kill / systemd / docker stop send SIGTERM: the server stops as after one Ctrl-C, not at once, so the answer
    streaming then ends whole."""
    proc, port = _serving(tmp_path_factory)
    try:
        agent, seen = _stream_forced(port, 1500)
        with agent:
            proc.send_signal(signal.SIGTERM)
            while b"data: [DONE]" not in seen and (chunk := agent.recv(65536)):
                seen += chunk
        code = proc.wait(timeout=60)
    finally:
        log = _ended(proc)
    assert b"data: [DONE]" in seen and code == 0, (code, seen[-500:], log[-2000:])
    assert seen.count(b"word") >= 1500 and "stopping; answers still streaming" in log, log[-2000:]


def test_one_ctrl_c_on_an_idle_server_stops_it(tmp_path_factory):
    proc, _ = _serving(tmp_path_factory)
    try:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        log = _ended(proc)
    assert code == 130 and "stopping;" in log and "stopped at once" not in log and "Traceback" not in log, log
