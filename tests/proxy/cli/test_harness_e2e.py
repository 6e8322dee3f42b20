"""A real agent harness (mini-swe-agent) end to end against the proxy in scripted mode, tools run for real.

Skipped, with the reason, where mini-swe-agent is not installed (`pip install mini-swe-agent` in its own venv
and put its bin on PATH, or set KILLICK_MINI=/path/to/mini).
"""
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from real_stack import synth_model_dir

from proxy.replay.scripted import Script

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "fixtures" / "sessions" / "script.json"


def _mini() -> str | None:
    found = os.environ.get("KILLICK_MINI") or shutil.which("mini")
    return found or next((p for p in ("/opt/mswea/bin/mini",) if Path(p).is_file()), None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth_model_dir(tmp_path_factory)


def _sandbox(path: Path) -> Path:
    path.mkdir()
    (path / "README.md").write_text("# calc\nA tiny calculator.\n")
    (path / "calc.py").write_text('def add(a, b):\n    return a - b\n\n\nif __name__ == "__main__":\n'
                                  "    print(add(2, 3))\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=path, check=True)
    return path


@pytest.mark.harness
@pytest.mark.skipif(_mini() is None, reason="mini-swe-agent is not installed (pip install mini-swe-agent; "
                                            "put `mini` on PATH or set KILLICK_MINI)")
@pytest.mark.skipif(shutil.which("git") is None, reason="the sandbox repo needs git")
async def test_mini_swe_agent_scripted_session(aiohttp_server, model_dir, tmp_path):
    from engine.build import EngineOptions, build_core
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.app import create_app
    from proxy.policy.cache_policy import PolicyPlanner
    from proxy.prompt.render import ChatRenderer
    from proxy.replay.record import Recorder
    from proxy.replay.sources import Scripted

    sandbox = _sandbox(tmp_path / "sandbox")
    tok = load_tokenizer(model_dir)
    core = build_core(model_dir, EngineOptions(context_length=8192, cache_device_mb=64, cache_host_mb=64))
    app = create_app(core, tok, ChatRenderer(tok), model_name="tiny", planner=PolicyPlanner(),
                     replies=Scripted(Script.load(SCRIPT, workdir=str(sandbox))), observer=Recorder(tmp_path / "rec"))
    server = await aiohttp_server(app, host="127.0.0.1")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(_mini()).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "launch", "mini-swe-agent", "--server", str(server.make_url("")), "--",
        "-y", "--exit-immediately", "-c", "agent.step_limit=12", "-t", "Please solve this issue: add() is wrong",
        cwd=sandbox, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    except asyncio.TimeoutError:
        proc.kill()
        raise
    lines = [json.loads(x) for f in (tmp_path / "rec").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert (sandbox / "calc.py").read_text().count("return a + b") == 1, out.decode()[-2000:]
    assert len(lines) == 8 and all(x["status"] == 200 for x in lines)
    assert {x["metrics"]["harness"] for x in lines} == {"swe_agent"}
    assert [x["metrics"]["edit_class"] for x in lines] == ["first"] + ["append"] * 7
    calls = [x["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] for x in lines]
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in calls[-1]
