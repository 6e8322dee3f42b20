"""`killick launch AGENT`: point a coding agent at the local server and run it.

find the served model (GET /v1/models) -> plan (proxy/cli/launch_profiles.py) -> write merged configs -> run the
agent with provider keys scrubbed, telemetry and self-update off, and the user's extra arguments after `--`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Mapping

from proxy.cli.launch_profiles import PROFILES, LaunchPlan, plan

DEFAULT_SERVER = "http://127.0.0.1:8421"
TAKES_REST = True  # proxy/cli/__init__.py hands everything after `--` to us as args.rest (the agent's own arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=list(PROFILES), help="the agent harness to start")
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"killick server URL (default {DEFAULT_SERVER})")
    p.add_argument("--model", metavar="NAME", help="model id to use (default: the first one /v1/models lists)")
    p.usage = "killick launch AGENT [--server URL] [--model NAME] [--dry-run] [-- AGENT ARGS]"
    p.add_argument("--dry-run", action="store_true",
                   help="print the files, environment and command it would use; write and run nothing")


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    server = args.server.rstrip("/")
    model = args.model or served_model(server)
    launch = plan(args.agent, server, model, env, list(getattr(args, "rest", [])))
    if args.dry_run:
        print_plan(launch)
        return 0
    profile = PROFILES[args.agent]
    child_env = child_environment(env, launch)
    binary = shutil.which(profile.binary, path=child_env.get("PATH"))
    if binary is None:
        print(f"killick launch: '{profile.binary}' is not installed; install it with:\n  {profile.install}",
              file=sys.stderr)
        return 2
    write_files(launch)
    return run_child([binary] + launch.argv[1:], child_env)


def served_model(server: str, timeout: float = 3.0) -> str:
    """The first model id the server lists; ValueError (one actionable line) when it is not reachable."""
    url = f"{server}/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"no killick server answers at {server} ({reason}); start it with `killick serve` "
                         f"or pass --server URL") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url} did not answer JSON; is {server} a killick server?") from None
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]
    if not models:
        raise ValueError(f"{url} lists no model; pass --model NAME")
    return str(models[0])


def child_environment(env: Mapping[str, str], launch: LaunchPlan) -> dict[str, str]:
    child = {k: v for k, v in env.items() if k not in launch.unset_env}
    child.update(launch.set_env)
    return child


def write_files(launch: LaunchPlan) -> None:
    for f in launch.files:
        f.path.parent.mkdir(parents=True, exist_ok=True)
        backup = f.path.with_name(f.path.name + ".killick-bak")
        if f.existed and not backup.exists():
            shutil.copy2(f.path, backup)
        tmp = f.path.with_name(f.path.name + ".killick-tmp")
        tmp.write_text(f.content, encoding="utf-8")
        os.replace(tmp, f.path)  # atomic: a crash never leaves the user's config half written


def run_child(argv: list[str], env: dict[str, str]) -> int:
    """Run the agent in the foreground; Ctrl-C goes to it (same process group), we wait for its exit."""
    in_main = threading.current_thread() is threading.main_thread()  # only it may install handlers
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        proc = subprocess.Popen(argv, env=env)
        code = proc.wait()
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, like a shell


def print_plan(launch: LaunchPlan) -> None:
    for f in launch.files:
        note = " (merged into the existing file; a .killick-bak copy is kept)" if f.existed else ""
        print(f"# file {f.path}{note}\n{f.content}", end="" if f.content.endswith("\n") else "\n")
    print("# environment")
    for name, value in launch.set_env.items():
        print(f"export {name}={_quote(value)}")
    for name in launch.unset_env:
        print(f"unset {name}")
    print("# command")
    print(" ".join(_quote(a) for a in launch.argv))


def _quote(s: str) -> str:
    return shlex.quote(s)
