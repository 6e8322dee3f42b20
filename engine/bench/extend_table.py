"""The extend line over several `bench model` processes: one table row a JSON file, then how many of them reach
it (a 256-token extend after a cached prompt at least LINE x faster than the pool streamed once at B_P, in that
process: the expert cache's target for an agent's turn).

    python -m engine.bench.extend_table out/default*.json [--line 3] [--json summary.json]

Each row: the extend's TTFT median and range over its runs (ms), x (the pool once at B_P over the median),
floor (the extend's misses read once at the process's host DRAM rate, ms), read (that rate, GB/s), CPU (the
median rate of the extends' CPU jobs, GB/s), the medians of the copies ahead (those the layers read), fills and
experts run on the CPU, and the lag hybrid's last routed layer counted at the process's end (hybrid.TailClock, ms,
with the lags it measured; "-" where the file has none). Torch-free: it reads the files the bench wrote, on any
machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

LINE = 3.0  # the extend >= 3x faster than streaming every expert once at B_P


class ExtendRow(NamedTuple):
    name: str
    device: str
    median_ms: float
    low_ms: float
    high_ms: float
    x: float
    floor_ms: float
    read_gbs: float
    cpu_gbs: float
    ahead: float
    ahead_read: float
    fills: float
    on_cpu: float
    tail_ms: float = float("nan")  # hybrid.TailClock's lag at the process's end
    tail_samples: int = 0


def read_row(path: Path) -> ExtendRow:
    """The extend row of one `bench model --json` file; ValueError naming the file when it has none."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a bench model JSON file ({exc})") from exc
    rows = [r for r in doc.get("rows", ()) if str(r.get("name", "")).startswith("extend_")] if isinstance(doc, dict) \
        else []
    if not rows or "of_stream_bound" not in rows[0]:
        raise ValueError(f"{path}: no extend row with its stream bound (run bench model with --extend-runs and a "
                         f"slot backend)")
    r = rows[0]
    runs = r.get("extend_runs") or []

    def median(key: str) -> float:
        values = [run[key] for run in runs if key in run]
        return float(statistics.median(values)) if values else float("nan")

    ms = r.get("runs_ms") or [r["ttft_ms"]]
    return ExtendRow(path.stem, str(doc.get("device", "")), float(r["ttft_ms"]), min(ms), max(ms),
                     float(r["of_stream_bound"]), float(r.get("dram_bound_s", float("nan"))) * 1e3,
                     float(r.get("host_read_gbs", float("nan"))), median("cpu_gbs"), median("ahead"),
                     median("ahead_used"), median("fills"), median("cpu_runs"), *_tail(doc))


def _tail(doc: dict) -> tuple[float, int]:
    tail = (doc.get("split") or {}).get("tail") or {}
    return float(tail.get("lag_ms", float("nan"))), int(tail.get("samples", 0))


def table(rows: list[ExtendRow], line: float = LINE) -> str:
    """Markdown rows as docs/PERF.md writes them, past-the-line figures in bold, and the count."""
    out = ["| process | median (range) | x | floor | read | CPU | copies ahead (read) / fills / on the CPU | tail |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        bold = (lambda s: f"**{s}**") if r.x >= line else (lambda s: s)
        out.append(f"| {r.name} | {bold(f'{r.median_ms:.1f}')} ms ({r.low_ms:.1f}-{r.high_ms:.1f}) | "
                   f"{bold(f'{r.x:.2f}')} | {r.floor_ms:.1f} | {r.read_gbs:.0f} | {r.cpu_gbs:.1f} | "
                   f"{r.ahead:.0f} ({r.ahead_read:.0f}) / {r.fills:.0f} / {r.on_cpu:.0f} | "
                   + (f"{r.tail_ms:+.1f} ({r.tail_samples}) |" if r.tail_samples else "- |"))
    past = sum(r.x >= line for r in rows)
    devices = ", ".join(sorted({r.device for r in rows if r.device})) or "unknown device"
    out.append(f"\n{past} of {len(rows)} processes at or past {line:g}x ({devices})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.extend_table", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="bench model --json files, one a process")
    p.add_argument("--line", type=float, default=LINE, help="the ratio to the pool once at B_P counted (default 3)")
    p.add_argument("--json", type=Path, help="also write the rows and the count here")
    args = p.parse_args(argv)
    try:
        rows = [read_row(f) for f in args.files]
    except ValueError as exc:
        p.exit(2, f"extend_table: {exc}\n")
    print(table(rows, args.line))
    if args.json:
        args.json.write_text(json.dumps({"line": args.line, "past": sum(r.x >= args.line for r in rows),
                                         "rows": [r._asdict() for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
