"""Two trees of the engine, row by row: `bench model` JSON of the old tree against the new one's.

    python -m engine.bench.ab --old A1.json [A2.json ...] --new B1.json [B2.json ...] [--json OUT]

Each side may be several runs (alternated on one machine: engine/bench/gpu_ab.sh); a row's figure on a side
is the median of its runs' tok/s (every `bench model` row has one: decode, prefill and extend alike, higher
is faster), printed with the runs' range, beside the pools of experts it moved and its hit rate where the
row has them, and new / old. Rows are paired by name; a row on one side only prints "—" for the other.
Torch-free: it runs wherever the JSON is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

MISSING = "—"


def load(paths: list[str]) -> list[dict]:
    """The `bench model --json` documents at paths; ValueError naming the file that is not one."""
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ValueError(f"{path}: not `killick bench model --json` output (no 'rows' list)")
        docs.append(doc)
    return docs


def side(docs: list[dict]) -> dict[str, dict]:
    """name -> {"tok_s": [per run], "pools": [...], "hit": [...]} over the runs, in row order of the first run."""
    out: dict[str, dict] = {}
    for doc in docs:
        for row in doc["rows"]:
            if not isinstance(row, dict) or "name" not in row or not isinstance(row.get("tok_s"), (int, float)):
                continue
            r = out.setdefault(row["name"], {"tok_s": [], "pools": [], "hit": []})
            r["tok_s"].append(float(row["tok_s"]))
            if isinstance(row.get("pool_passes"), (int, float)):
                r["pools"].append(float(row["pool_passes"]))
            ex = row.get("experts")
            if isinstance(ex, dict) and ex.get("hits", 0) + ex.get("misses", 0) > 0:
                r["hit"].append(ex["hits"] / (ex["hits"] + ex["misses"]))
    return out


def compare(old: list[dict], new: list[dict]) -> list[dict]:
    """One entry per row name (old's order, then rows only new has): medians, ranges and new / old."""
    a, b = side(old), side(new)
    rows = []
    for name in list(a) + [n for n in b if n not in a]:
        entry = {"name": name}
        for key, s in (("old", a.get(name)), ("new", b.get(name))):
            if s is None:
                entry[key] = None
                continue
            entry[key] = {"tok_s": statistics.median(s["tok_s"]), "runs": s["tok_s"],
                          "pools": statistics.median(s["pools"]) if s["pools"] else None,
                          "hit_rate": statistics.median(s["hit"]) if s["hit"] else None}
        entry["ratio"] = entry["new"]["tok_s"] / entry["old"]["tok_s"] \
            if entry["old"] and entry["new"] and entry["old"]["tok_s"] > 0 else None
        rows.append(entry)
    return rows


def _cell(s: dict | None) -> str:
    if s is None:
        return MISSING
    runs = s["runs"]
    text = f"{s['tok_s']:.1f}" + (f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else "")
    extra = []
    if s["pools"] is not None:
        extra.append(f"{s['pools']:.2f} pools")
    if s["hit_rate"] is not None:
        extra.append(f"hit {s['hit_rate']:.2f}")
    return text + (f" [{', '.join(extra)}]" if extra else "")


def table(rows: list[dict]) -> str:
    lines = [f"{'row':<16} {'old tok/s':<44} {'new tok/s':<44} new/old"]
    for r in rows:
        ratio = MISSING if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['name']:<16} {_cell(r['old']):<44} {_cell(r['new']):<44} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", nargs="+", required=True, help="bench model JSON of the old tree (one per run)")
    ap.add_argument("--new", nargs="+", required=True, help="bench model JSON of the new tree (one per run)")
    ap.add_argument("--json", help="also write the comparison here")
    args = ap.parse_args(argv)
    try:
        rows = compare(load(args.old), load(args.new))
    except ValueError as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old": args.old, "new": args.new, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
