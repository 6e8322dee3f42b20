"""`killick serve`: options, and a real process that prints one startup line and answers on loopback."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from proxy.cli import build_parser
from real_stack import synth_model_dir


def test_serve_defaults_are_loopback():
    args = build_parser(only="serve").parse_args(["serve"])
    assert (args.host, args.port, args.max_running, args.api_key, args.model) == ("127.0.0.1", 8421, 4, None, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_starts_answers_and_stops(tmp_path_factory):
    model = synth_model_dir(tmp_path_factory)
    port = _free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--model", str(model), "--port", str(port),
           "--api-key", "k", "--max-running", "2", "--moe-backend", "offload", "--moe-slots", "50%"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "serving on" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"killick serve exited with {proc.returncode}")
        assert f"http://127.0.0.1:{port}" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert json.load(r)["status"] == "ok"
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"x-api-key": "k"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["data"][0]["context_length"] > 0
        ctl = [sys.executable, "-m", "proxy.cli", "ctl", "--server", f"http://127.0.0.1:{port}", "--api-key", "k"]
        out = subprocess.run([*ctl, "cache", "--moe", "5", "--kv", "2048"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "(5 slots)" in out.stdout and "context_length" in out.stdout, out.stderr
        out = subprocess.run([*ctl, "stats", "--json"], capture_output=True, text=True, timeout=60)
        assert json.loads(out.stdout)["context_length"] == 2048
        bad = subprocess.run([*ctl, "cache", "--moe", "100000"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "slots" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
