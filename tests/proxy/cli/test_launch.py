"""`killick launch`: dry runs per agent, the real launch path against a fake /v1/models, config merging."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from aiohttp import web

from proxy.cli import main
from proxy.cli.launch import child_environment
from proxy.cli.launch_profiles import PROFILES, plan

ROOT = Path(__file__).resolve().parents[3]
SECRETS = {"ANTHROPIC_API_KEY": "sk-ant-REAL", "OPENAI_API_KEY": "sk-REAL", "OPENAI_BASE_URL": "https://paid",
           "ANTHROPIC_AUTH_TOKEN": "REAL-TOKEN", "GEMINI_API_KEY": "REAL-G"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for name in ("XDG_CONFIG_HOME", "OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return h


@pytest.mark.parametrize("agent", list(PROFILES))
def test_dry_run_prints_plan_writes_nothing(agent, home, capsys):
    assert main(["launch", agent, "--model", "qwen-moe", "--dry-run", "--", "--extra", "arg"]) == 0
    out = capsys.readouterr().out
    assert list(home.iterdir()) == []                       # nothing written
    for name, value in SECRETS.items():
        assert f"unset {name}" in out or f"export {name}=sk-killick-local" in out  # removed or replaced
        assert value not in out                                 # and the user's secrets never printed
    assert "export DO_NOT_TRACK=1" in out
    command = out.split("# command\n")[1].strip()
    assert command.startswith(PROFILES[agent].binary) and command.endswith("--extra arg")
    assert "qwen-moe" in out and "127.0.0.1:8421" in out
    for f in plan(agent, "http://127.0.0.1:8421", "qwen-moe", dict(os.environ), []).files:
        assert f.path.is_relative_to(home) and f"# file {f.path}" in out


@pytest.mark.parametrize("agent", list(PROFILES))
def test_child_environment_has_no_provider_keys(agent, home):
    launch = plan(agent, "http://127.0.0.1:9", "m", dict(os.environ), [])
    child = child_environment(dict(os.environ), launch)
    for name in SECRETS:
        assert child.get(name) != SECRETS[name]
    assert "ANTHROPIC_API_KEY" not in child and "OPENAI_API_KEY" not in child
    assert child["PATH"] == os.environ["PATH"]


def test_claude_and_codex_point_at_server():
    env = plan("claude", "http://127.0.0.1:9/", "m", {}, []).set_env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_MODEL"] == "m"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    argv = plan("codex", "http://127.0.0.1:9", "m", {}, ["exec", "hi"]).argv
    assert 'model_providers.killick.base_url="http://127.0.0.1:9/v1"' in argv
    assert 'model_providers.killick.wire_api="responses"' in argv and argv[-2:] == ["exec", "hi"]
    assert "analytics.enabled=false" in argv and "features.plugins=false" in argv
    mini = plan("mini-swe-agent", "http://127.0.0.1:9", "m", {}, []).argv
    assert mini[:3] == ["mini", "-m", "openai/m"] and "model.model_kwargs.api_base=http://127.0.0.1:9/v1" in mini


def test_merge_keeps_user_keys(home):
    cfg = home / ".config" / "opencode" / "opencode.json"
    cfg.parent.mkdir(parents=True)
    user = {"theme": "tokyonight", "model": "mine/x", "provider": {"mine": {"options": {"baseURL": "http://x"}}}}
    cfg.write_text(json.dumps(user))
    (f,) = plan("opencode", "http://127.0.0.1:9", "m", {"HOME": str(home)}, []).files
    merged = json.loads(f.content)
    assert f.existed and merged["theme"] == "tokyonight" and merged["model"] == "mine/x"
    assert merged["provider"]["mine"] == user["provider"]["mine"]
    assert merged["provider"]["killick"]["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    claw = home / ".openclaw" / "openclaw.json"
    claw.parent.mkdir()
    claw.write_text(json.dumps({"gateway": {"port": 1}, "models": {"providers": {"other": {"baseUrl": "y"}}}}))
    (g,) = plan("openclaw", "http://127.0.0.1:9", "m", {"HOME": str(home)}, []).files
    merged = json.loads(g.content)
    assert merged["gateway"] == {"port": 1} and "other" in merged["models"]["providers"]
    assert merged["models"]["providers"]["killick"]["baseUrl"] == "http://127.0.0.1:9/v1"


def test_commented_config_is_refused_not_clobbered(home, capsys):
    cfg = home / ".config" / "opencode" / "opencode.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('{ // my settings\n "theme": "x" }')
    assert main(["launch", "opencode", "--model", "m", "--dry-run"]) == 2
    assert "not plain JSON" in capsys.readouterr().err
    assert cfg.read_text() == '{ // my settings\n "theme": "x" }'


def test_server_down_says_how_to_start_it(home, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["launch", "claude", "--server", f"http://127.0.0.1:{port}", "--dry-run"]) == 2
    assert "start it with `killick serve`" in capsys.readouterr().err


def test_not_installed_prints_install_command(home, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["launch", "codex", "--model", "m"]) == 2
    assert "npm install -g @openai/codex" in capsys.readouterr().err
    assert not (Path(os.environ["HOME"]) / ".codex").exists()


FAKE_AGENT = """#!/bin/sh
env > "$DUMP_DIR/env"
for a in "$@"; do printf '%s\\n' "$a"; done > "$DUMP_DIR/args"
exit 7
"""


@pytest.fixture
async def models_server(aiohttp_server):
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "served-moe", "object": "model"}]})
    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app, host="127.0.0.1")
    return f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize("agent", ["claude", "opencode", "codex"])
async def test_real_launch_runs_agent_with_scrubbed_env(agent, models_server, home, tmp_path):
    bindir, dump = tmp_path / "bin", tmp_path / "dump"
    bindir.mkdir()
    dump.mkdir()
    script = bindir / PROFILES[agent].binary
    script.write_text(FAKE_AGENT)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "DUMP_DIR": str(dump),
           "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "launch", agent, "--server", models_server, "--", "-p", "hello world",
        env=env, cwd=ROOT)
    assert await asyncio.wait_for(proc.wait(), 60) == 7        # the agent's exit code comes back
    child = dict(line.split("=", 1) for line in (dump / "env").read_text().splitlines() if "=" in line)
    args = (dump / "args").read_text().splitlines()
    assert "ANTHROPIC_API_KEY" not in child and "OPENAI_API_KEY" not in child and "GEMINI_API_KEY" not in child
    assert child["DO_NOT_TRACK"] == "1" and args[-2:] == ["-p", "hello world"]
    if agent == "claude":
        assert child["ANTHROPIC_BASE_URL"] == models_server and child["ANTHROPIC_MODEL"] == "served-moe"
        assert child["ANTHROPIC_AUTH_TOKEN"] != SECRETS["ANTHROPIC_AUTH_TOKEN"]
    if agent == "codex":
        assert f'model_providers.killick.base_url="{models_server}/v1"' in args and 'model="served-moe"' in args
    if agent == "opencode":
        cfg = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
        assert cfg["provider"]["killick"]["options"]["baseURL"] == f"{models_server}/v1"
        assert args[:2] == ["--model", "killick/served-moe"] and child["OPENCODE_DISABLE_AUTOUPDATE"] == "1"
