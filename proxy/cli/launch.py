"""`killick launch AGENT`: point a coding agent at the local server and run it.

ask the server (GET /v1/models: model id, context window) -> plan (proxy/cli/launch_profiles.py) -> write merged
configs -> run the agent with provider keys scrubbed, telemetry and self-update off, the server's key
(--api-key or KILLICK_API_KEY) as its key, and the user's extra arguments after `--`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Mapping

from proxy.cli import URL_FORMS, server_url
from proxy.cli.launch_profiles import DUMMY_KEY, KEY_ENV, PROFILES, LaunchPlan, Served, plan

DEFAULT_SERVER = "http://127.0.0.1:8421"
TAKES_REST = True  # proxy/cli/__init__.py hands everything after `--` to us as args.rest (the agent's own arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=list(PROFILES), help="the agent harness to start")
    p.add_argument("--server", default=DEFAULT_SERVER,
                   help=f"killick server URL (default {DEFAULT_SERVER}; {URL_FORMS})")
    p.add_argument("--model", metavar="NAME", help="model id to use (default: the first one /v1/models lists)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"the server's --api-key, handed to the agent as its key (default: ${KEY_ENV})")
    p.usage = "killick launch AGENT [--server URL] [--model NAME] [--api-key KEY] [--dry-run] [-- AGENT ARGS]"
    p.add_argument("--dry-run", action="store_true",
                   help="print the files, environment and command it would use; write and run nothing "
                        "(works without a server: then the model and window are placeholders)")


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    key = args.api_key or env.get(KEY_ENV) or None
    profile = PROFILES[args.agent]
    binary = shutil.which(profile.binary, path=env.get("PATH"))  # the child keeps the user's PATH
    if binary is None and not args.dry_run:
        print(f"killick launch: '{profile.binary}' is not installed; install it with:\n  {profile.install}",
              file=sys.stderr)
        return 2
    launch = plan(args.agent, served_or_placeholder(args, key), env, list(getattr(args, "rest", [])))
    if args.dry_run:
        print_plan(launch, secret=key)
        return 0
    write_files(launch)
    return run_child([binary] + launch.argv[1:], child_environment(env, launch))


def served_or_placeholder(args: argparse.Namespace, key: str | None) -> Served:
    """What the server says; for a dry run without a server, placeholders (and a line saying so)."""
    server = server_url(args.server, "--server")
    try:
        return ask_server(server, key, args.model)
    except ServerUnreachable as exc:
        if not args.dry_run:
            raise
        served = Served(server, args.model or "MODEL", api_key=key or DUMMY_KEY)
        print(f"# {exc}\n# so the model name and the context window ({served.context}) below are placeholders")
        return served


class ServerUnreachable(ValueError):
    """Nothing answers at the URL (a dry run goes on with placeholders)."""


def ask_server(server: str, key: str | None, model: str | None = None, timeout: float = 3.0) -> Served:
    """What the server serves: its first model (or `model`) and that model's context window. ValueError with
    one actionable line when it refuses the key or does not answer like a killick server."""
    url = f"{server}/v1/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 401:
            hint = "the key it was given is not the server's" if key else "it was started with --api-key"
            raise ValueError(f"the server at {server} answered 401 Unauthorized: {hint}; pass the server's key "
                             f"with --api-key KEY or ${KEY_ENV}") from None
        raise ValueError(f"{url} answered HTTP {exc.code} {exc.reason}; is {server} a killick server?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerUnreachable(f"no killick server answers at {server} ({reason}); start it with `killick serve` "
                                f"or pass --server URL") from None
    except json.JSONDecodeError:
        raise ValueError(f"{url} did not answer JSON; is {server} a killick server?") from None
    entries = [m for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]
    if not entries:
        raise ValueError(f"{url} lists no model; pass --model NAME")
    context = entries[0].get("context_length")
    window = {"context": int(context)} if isinstance(context, int) and context > 0 else {}
    return Served(server, model or str(entries[0]["id"]), api_key=key or DUMMY_KEY, **window)


def child_environment(env: Mapping[str, str], launch: LaunchPlan) -> dict[str, str]:
    child = {k: v for k, v in env.items() if k not in launch.unset_env}
    child.update(launch.set_env)
    return child


def write_files(launch: LaunchPlan) -> None:
    """Each file atomically, through a symlink to the file it names (a dotfiles link stays a link), with the
    mode the file had (a new one owner-only: it may hold the key)."""
    for f in launch.files:
        target = f.path.resolve() if f.path.is_symlink() else f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        backup = target.with_name(target.name + ".killick-bak")
        if f.existed and not backup.exists():
            shutil.copy2(target, backup)
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o600
        tmp = target.with_name(target.name + ".killick-tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as out:
            out.write(f.content)
        os.chmod(tmp, mode)
        os.replace(tmp, target)  # atomic: a crash never leaves the user's config half written


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


def print_plan(launch: LaunchPlan, secret: str | None = None) -> None:
    """The plan as shell lines; the server's real key (`secret`) is shown as a reference to its variable where a
    value is the key (a quoted string in a file, an argument, a variable), never inside other text."""
    def shown(text: str) -> str:
        return text.replace(json.dumps(secret), f'"${KEY_ENV}"') if secret else text

    for f in launch.files:
        note = " (merged into the existing file; a .killick-bak copy is kept)" if f.existed else ""
        print(f"# file {f.path}{note}\n{shown(f.content)}", end="" if f.content.endswith("\n") else "\n")
    print("# environment")
    for name, value in launch.set_env.items():
        print(f"export {name}=" + (f'"${KEY_ENV}"' if secret and value == secret else _quote(value)))
    for name in launch.unset_env:
        print(f"unset {name}")
    print("# command")
    print(" ".join(f'"${KEY_ENV}"' if secret and a == secret else _quote(a) for a in launch.argv))


def _quote(s: str) -> str:
    return shlex.quote(s)
