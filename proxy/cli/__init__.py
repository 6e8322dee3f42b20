"""`killick` command line: one small module per subcommand, registered here by name.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only when that
subcommand runs (so `killick --help` and the proxy never import torch needlessly). A user mistake
(ValueError, a path that is missing, in the way or not writable) prints one line naming what is wrong and exits
2 - no traceback. Where results are written only after minutes of work, check_output() refuses a path they
cannot go to before the work starts.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

KEY_ENV = "KILLICK_API_KEY"  # the server's --api-key: serve takes it from here, and so do its clients
URL_FORMS = "http:// may be left out, a trailing /v1 given"  # what server_url() takes, for the flags' help


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $KILLICK_API_KEY; an empty value means no key."""
    import os

    return args.api_key or os.environ.get(KEY_ENV) or None


def server_url(url: str, flag: str) -> str:
    """A killick server's URL as users write it: without a scheme (http), or as the base URL a harness is given
    (a trailing /v1). The API routes are appended to what comes back."""
    from proxy.upstream.config import base_url

    text = url.strip()
    return base_url(text if "://" in text else "http://" + text, what=flag)


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("proxy.cli.generate", "complete a prompt with a model (no server)"),
    "serve": ("proxy.cli.serve", "serve the agent APIs (Anthropic, OpenAI chat, OpenAI Responses) on loopback"),
    "demo": ("proxy.cli.demo", "run the main job on the embedded demo model"),
    "model": ("proxy.cli.model", "model utilities: synth (write a seeded random checkpoint)"),
    "ctl": ("proxy.cli.ctl", "control a running server: stats, cache sizes (no restart)"),
    "bench": ("proxy.cli.bench", "benchmarks: bw (bandwidths), decode (expert backends), model (the whole "
                                 "engine), routing (hit rates), upstream (replicas)"),
    "launch": ("proxy.cli.launch", "run a coding agent (claude, opencode, codex, ...) against the server"),
    "replay": ("proxy.cli.replay", "replay recorded agent requests; TTFT and cache reuse per turn and mode"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="killick", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            mod = _load(module)
            if mod is not None:
                mod.add_arguments(p)
    return parser


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):  # the subcommand is left out of this installation
            return None
        raise


def _split_rest(command: str | None, argv: list[str]) -> tuple[list[str], list[str]]:
    """Everything after the first `--` goes untouched to a subcommand that declares TAKES_REST (launch)."""
    mod = _load(COMMANDS[command][0]) if command else None
    if mod is None or not getattr(mod, "TAKES_REST", False) or "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    argv, rest = _split_rest(command, argv)
    args = build_parser(only=command).parse_args(argv)
    args.rest = rest
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mod = _load(COMMANDS[args.command][0])
    if mod is None:
        print(f"killick: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(mod.run(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError, IsADirectoryError,
            PermissionError) as exc:
        print(f"killick {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def check_output(path, flag: str, directory: bool = False) -> None:
    """ValueError naming `flag` unless results can be written to `path` (a file, or a directory when
    `directory`): it is not the other kind, and its nearest existing ancestor is a directory this user may
    write into (the rest is created then)."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.exists():
        if target.is_dir() != directory:
            raise ValueError(f"{flag} {path}: is a {'file' if directory else 'directory'}; give "
                             f"{'a directory' if directory else 'a file name'}")
        if not os.access(target, os.W_OK):
            raise ValueError(f"{flag} {path}: this user may not write to it")
        return
    above = target.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir() or not os.access(above, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write there ({above} is not a directory this user may write to)")
