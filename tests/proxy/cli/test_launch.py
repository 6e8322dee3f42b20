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
from proxy.cli.launch_profiles import PROFILES, Served, plan

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
    for f in plan(agent, Served("http://127.0.0.1:8421", "qwen-moe"), dict(os.environ), []).files:
        assert f.path.is_relative_to(home) and f"# file {f.path}" in out


@pytest.mark.parametrize("agent", list(PROFILES))
def test_child_environment_has_no_provider_keys(agent, home):
    launch = plan(agent, Served("http://127.0.0.1:9", "m"), dict(os.environ), [])
    child = child_environment(dict(os.environ), launch)
    for name in SECRETS:
        assert child.get(name) != SECRETS[name]
    assert "ANTHROPIC_API_KEY" not in child
    assert child.get("OPENAI_API_KEY", "sk-killick-local") == "sk-killick-local"  # mini-swe-agent's key: ours
    assert child["PATH"] == os.environ["PATH"]


def test_claude_and_codex_point_at_server():
    env = plan("claude", Served("http://127.0.0.1:9/", "m"), {}, []).set_env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_MODEL"] == "m"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    assert int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) > 300_000  # its floor: a longer prefill or queue is no abort
    argv = plan("codex", Served("http://127.0.0.1:9", "m"), {}, ["exec", "hi"]).argv
    assert 'model_providers.killick.base_url="http://127.0.0.1:9/v1"' in argv
    assert 'model_providers.killick.wire_api="responses"' in argv and argv[-2:] == ["exec", "hi"]
    assert "analytics.enabled=false" in argv and "features.plugins=false" in argv
    idle = next(a for a in argv if a.startswith("model_providers.killick.stream_idle_timeout_ms="))
    assert int(idle.split("=")[1]) > 300_000  # its default: a longer prefill or queue is no abort
    mini = plan("mini-swe-agent", Served("http://127.0.0.1:9", "m"), {}, []).argv
    assert mini[:3] == ["mini", "-m", "openai/m"] and "model.model_kwargs.api_base=http://127.0.0.1:9/v1" in mini


def test_merge_keeps_user_keys(home):
    cfg = home / ".config" / "opencode" / "opencode.json"
    cfg.parent.mkdir(parents=True)
    user = {"theme": "tokyonight", "model": "mine/x", "provider": {"mine": {"options": {"baseURL": "http://x"}}}}
    cfg.write_text(json.dumps(user))
    (f,) = plan("opencode", Served("http://127.0.0.1:9", "m"), {"HOME": str(home)}, []).files
    merged = json.loads(f.content)
    assert f.existed and merged["theme"] == "tokyonight" and merged["model"] == "mine/x"
    assert merged["provider"]["mine"] == user["provider"]["mine"]
    assert merged["provider"]["killick"]["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    claw = home / ".openclaw" / "openclaw.json"
    claw.parent.mkdir()
    claw.write_text(json.dumps({"gateway": {"port": 1}, "models": {"providers": {"other": {"baseUrl": "y"}}}}))
    (g,) = plan("openclaw", Served("http://127.0.0.1:9", "m"), {"HOME": str(home)}, []).files
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_agent(tmp_path, agent: str, monkeypatch=None) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / PROFILES[agent].binary
    script.write_text(FAKE_AGENT)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    if monkeypatch is not None:
        monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir


def test_server_down_says_how_to_start_it(home, tmp_path, monkeypatch, capsys):
    _fake_agent(tmp_path, "claude", monkeypatch)
    assert main(["launch", "claude", "--server", f"http://127.0.0.1:{_free_port()}"]) == 2
    assert "start it with `killick serve`" in capsys.readouterr().err


def test_dry_run_needs_no_server(home, capsys):
    assert main(["launch", "opencode", "--server", f"http://127.0.0.1:{_free_port()}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "no killick server answers" in out and "placeholders" in out
    assert '"context": 32768' in out and "killick/MODEL" in out
    assert list(home.iterdir()) == []


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


SERVER_KEY = "sk-server-secret"


@pytest.fixture
async def models_server(aiohttp_server):
    """A /v1/models like killick's: one model with its context window; the key "sk-server-secret" or none."""
    async def models(request):
        if request.headers.get("Authorization", "Bearer " + SERVER_KEY) != "Bearer " + SERVER_KEY:
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "served-moe", "object": "model",
                                                               "context_length": 262144}]})
    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app, host="127.0.0.1")
    return f"http://127.0.0.1:{server.port}"


async def _launch(agent: str, server: str, tmp_path, *flags: str, env: dict | None = None):
    """Run `killick launch` as a process with a fake agent; (exit code, the agent's env, its args, stderr)."""
    bindir, dump = _fake_agent(tmp_path, agent), tmp_path / "dump"
    dump.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "DUMP_DIR": str(dump),
           "PYTHONPATH": str(ROOT), **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "launch", agent, "--server", server, *flags, "--", "-p", "hello world",
        env=env, cwd=ROOT, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    if not (dump / "env").exists():
        return proc.returncode, {}, [], err.decode()
    child = dict(line.split("=", 1) for line in (dump / "env").read_text().splitlines() if "=" in line)
    return proc.returncode, child, (dump / "args").read_text().splitlines(), err.decode()


@pytest.mark.parametrize("agent", ["claude", "opencode", "codex"])
async def test_real_launch_runs_agent_with_scrubbed_env(agent, models_server, home, tmp_path):
    code, child, args, _ = await _launch(agent, models_server, tmp_path)
    assert code == 7                                            # the agent's exit code comes back
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


@pytest.mark.parametrize("agent", ["claude", "opencode", "codex", "mini-swe-agent"])
async def test_server_key_reaches_agent_by_flag_or_variable(agent, models_server, home, tmp_path):
    code, _, _, err = await _launch(agent, models_server, tmp_path)  # the fixture accepts no key or its own
    assert code == 7
    code, _, _, err = await _launch(agent, models_server, tmp_path, "--api-key", "wrong")
    assert code == 2 and "401 Unauthorized" in err and "--api-key KEY or $KILLICK_API_KEY" in err
    for flags, env in ((("--api-key", SERVER_KEY), {}), ((), {"KILLICK_API_KEY": SERVER_KEY})):
        code, child, args, err = await _launch(agent, models_server, tmp_path, *flags, env=env)
        assert code == 7, err
        given = {"claude": "ANTHROPIC_AUTH_TOKEN", "mini-swe-agent": "OPENAI_API_KEY"}.get(agent, "KILLICK_API_KEY")
        assert child[given] == SERVER_KEY and SERVER_KEY not in " ".join(args)  # never on the command line
    if agent == "opencode":  # the config names the variable, never the key
        text = (home / ".config" / "opencode" / "opencode.json").read_text()
        assert SERVER_KEY not in text and '"apiKey": "{env:KILLICK_API_KEY}"' in text


async def test_server_is_taken_as_ctl_and_the_harnesses_write_it(models_server, home, capsys):
    """--server without its scheme, or as the base URL a harness is given (…/v1), names the same server."""
    assert await asyncio.to_thread(main, ["launch", "codex", "--server", models_server, "--dry-run"]) == 0
    plain = capsys.readouterr().out
    assert "no killick server answers" not in plain and 'model="served-moe"' in plain
    for spelled in (models_server.removeprefix("http://"), models_server + "/v1", models_server + "/v1/"):
        assert await asyncio.to_thread(main, ["launch", "codex", "--server", spelled, "--dry-run"]) == 0
        assert capsys.readouterr().out == plain, spelled


async def test_dry_run_shows_variable_not_key(models_server, home, tmp_path, capsys):
    argv = ["launch", "openclaw", "--server", models_server, "--api-key", SERVER_KEY, "--dry-run"]
    assert await asyncio.to_thread(main, argv) == 0  # the fixture's server answers meanwhile
    out = capsys.readouterr().out
    assert "served-moe" in out and "no killick server answers" not in out
    assert SERVER_KEY not in out and '"apiKey": "$KILLICK_API_KEY"' in out


@pytest.mark.parametrize("agent", list(PROFILES))
async def test_each_agent_is_told_the_servers_window(agent, models_server, home, tmp_path):
    code, child, args, err = await _launch(agent, models_server, tmp_path)
    assert code == 7, err
    if agent == "claude":
        assert child["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "262144"
    elif agent == "codex":
        assert "model_context_window=262144" in args
    elif agent == "opencode":
        cfg = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
        assert cfg["provider"]["killick"]["models"]["served-moe"]["limit"] == {"context": 262144, "output": 16384}
    elif agent == "openclaw":
        cfg = json.loads((home / ".openclaw" / "openclaw.json").read_text())
        (model,) = cfg["models"]["providers"]["killick"]["models"]
        assert model["contextWindow"] == 262144 and model["maxTokens"] == 16384
    else:  # mini-swe-agent has no window setting; litellm sends what it is given
        assert "agent.step_limit=50" in args


def test_small_window_caps_output_and_codex_writes(home):
    served = Served("http://127.0.0.1:9", "m", context=8192)
    (f,) = plan("opencode", served, {"HOME": str(home)}, []).files
    assert json.loads(f.content)["provider"]["killick"]["models"]["m"]["limit"] == {"context": 8192, "output": 2048}
    argv = plan("codex", served, {}, []).argv
    assert 'sandbox_mode="workspace-write"' in argv          # read-only (its default) can write no file
    later = plan("codex", served, {}, ["-c", 'sandbox_mode="read-only"']).argv
    assert later[-1] == 'sandbox_mode="read-only"'           # the user's own -c comes last and wins


@pytest.mark.parametrize("agent", ["opencode", "openclaw"])
async def test_no_backup_of_a_file_killick_created(agent, models_server, home, tmp_path):
    for _ in range(2):
        code, *_ = await _launch(agent, models_server, tmp_path)
        assert code == 7
    folder = home / (".config/opencode" if agent == "opencode" else ".openclaw")
    assert not list(folder.glob("*.killick-bak"))
    path = next(folder.glob("*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "theme": "mine"}))  # now the user's too
    code, *_ = await _launch(agent, models_server, tmp_path)
    assert code == 7 and len(list(folder.glob("*.killick-bak"))) == 1


def test_files_keep_their_mode_and_links_and_new_ones_are_owner_only(home):
    """openclaw's config holds the key: an owner-only file stays owner-only, a new one is made so, and a config
    that is a link into the user's dotfiles is written through the link, which stays a link."""
    from proxy.cli.launch import write_files

    served = Served("http://127.0.0.1:9", "m", api_key="sk-secret")
    claw = home / ".openclaw" / "openclaw.json"
    write_files(plan("openclaw", served, {"HOME": str(home)}, []))
    assert stat.S_IMODE(claw.stat().st_mode) == 0o600 and "sk-secret" in claw.read_text()
    claw.chmod(0o640)
    write_files(plan("openclaw", served, {"HOME": str(home)}, []))
    assert stat.S_IMODE(claw.stat().st_mode) == 0o640
    dotfile = home / "dotfiles" / "opencode.json"
    dotfile.parent.mkdir()
    dotfile.write_text(json.dumps({"theme": "mine"}))
    link = home / ".config" / "opencode" / "opencode.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(dotfile)
    write_files(plan("opencode", served, {"HOME": str(home)}, []))
    assert link.is_symlink() and json.loads(dotfile.read_text())["theme"] == "mine"
    assert "killick" in json.loads(dotfile.read_text())["provider"]


def test_dry_run_shows_the_variable_only_where_a_value_is_the_key(home, capsys):
    """A short key that also appears inside other values (a port, an address) is not replaced there."""
    assert main(["launch", "openclaw", "--server", "http://127.0.0.1:1", "--api-key", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"apiKey": "$KILLICK_API_KEY"' in out and "127.0.0.1" in out and "$KILLICK_API_KEY7" not in out
