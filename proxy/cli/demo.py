"""`killick demo` (`make demo`): replay a real recorded agent session on the demo model, cache off vs anchors.

    killick demo [--recording FILE] [--out DIR] [--modes off,anchors] [--model DIR]

Starts the engine in-process on the embedded demo model (no download), replays the bundled mini-swe-agent
session (8 turns of a real run, recorded against `killick serve --script`) once per mode on a fresh engine,
prints the TTFT-per-turn table and the summary, and writes DIR/demo-ttft.png and DIR/demo-replay.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from proxy.cli import check_output

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sessions"
DEFAULT_RECORDING = FIXTURES / "mini-swe-agent.jsonl.gz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recording", default=str(DEFAULT_RECORDING), metavar="FILE",
                        help="a recording to replay (default: the bundled mini-swe-agent session)")
    parser.add_argument("--out", default="out", metavar="DIR", help="where the PNG and JSON go (default ./out)")
    parser.add_argument("--modes", default="off,anchors",
                        help="comma-separated: off, prefix, anchors (default off,anchors)")
    parser.add_argument("--model", metavar="DIR", help="checkpoint (default: the demo model)")


def run(args: argparse.Namespace) -> int:
    from engine.build import EngineOptions
    from proxy.replay import log as replay_log
    from proxy.replay import report as replay_report
    from proxy.cli.replay import MODES, pick_modes, report, run_modes

    check_output(args.out, "--out", directory=True)
    modes = pick_modes(args.modes, MODES)
    entries = replay_log.load([args.recording])
    if not entries:
        raise replay_log.no_requests(f"--recording {args.recording}: holds")
    print(f"killick demo: replaying {len(entries)} requests of {Path(args.recording).name} on "
          f"{args.model or 'the demo model'}, modes {', '.join(modes)} (CPU)", flush=True)
    start = time.perf_counter()
    # mini-swe-agent does not stream: send as streams so TTFT is the first token, not the whole answer
    by_mode = run_modes(entries, args.model, modes, EngineOptions(max_step_tokens=2048), stream=True)
    report(by_mode, quiet=True)
    out = Path(args.out)
    replay_report.write_json(out / "demo-replay.json", by_mode, {"recording": args.recording, "modes": modes})
    replay_report.plot(out / "demo-ttft.png", by_mode, title=f"TTFT per turn: {Path(args.recording).name}")
    print(f"\nwrote {out / 'demo-ttft.png'} and {out / 'demo-replay.json'} in {time.perf_counter() - start:.0f} s")
    return 0
