"""killick against llama.cpp, row by row: tok/s of each and killick ÷ llama.cpp.

    python -m engine.bench.peers.compare --llama OUT/llama_bench.json [--killick bench_model.json]
                                         [--layers 8] [--json OUT/compare.json]

`--llama` is what `llama-bench -o json` printed: a list of tests, each with `n_prompt`, `n_gen`, `n_depth`,
`n_cpu_moe`, `avg_ts`, `stddev_ts`. A test becomes a row named as killick names it:

    tg N (n_prompt 0)          decode_b1             llama-bench decodes one sequence
    pp N (n_gen 0)             prefill_N             e.g. prefill_8192
    pg P,N                     pp{P}+tg{N}           (no killick counterpart)
    n_depth D > 0              the name + "_dD"

and gets a placement from `n_cpu_moe` (llama.cpp keeps the experts of the first N layers on the CPU):
`resident` for 0, `cpu` when N ≥ the model's layer count, else `ncmoeN`.

killick's file (`killick bench model --json`) is expected as:

    {"layers": 8,                            optional; the depth of the checkpoint both engines ran
     "rows": [{"name": "decode_b1",          decode_b1, decode_b4, prefill_8192, ... (names as above)
               "placement": "resident",      resident | ncmoeN | cpu, where ncmoeN means the same share
                                             of experts on the GPU as llama.cpp's -ncmoe N: (L-N)/L
               "tok_s": 54.4,
               "variant": "hybrid",          optional: several rows may share a name and placement
               "experts_on_gpu": "37%"},     optional, shown as given
              ...]}

Rows are paired on (name, placement). Every llama.cpp row is printed; a killick row without a peer is
printed too, and a missing figure on either side prints as "—". The depth used to tell `cpu` from `ncmoeN`
is `--layers`, else killick's `layers`. Torch-free: it runs wherever the JSON is.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple

MISSING = "—"


class Row(NamedTuple):
    name: str
    placement: str
    experts_on_gpu: str
    llama_tok_s: float | None
    llama_stddev: float | None
    killick_tok_s: float | None
    variant: str | None

    @property
    def ratio(self) -> float | None:
        if self.llama_tok_s and self.killick_tok_s is not None:
            return self.killick_tok_s / self.llama_tok_s
        return None


def test_name(test: dict) -> str:
    """killick's name for one llama-bench test."""
    p, n, depth = int(test.get("n_prompt", 0)), int(test.get("n_gen", 0)), int(test.get("n_depth", 0))
    if p and n:
        name = f"pp{p}+tg{n}"
    elif n:
        name = "decode_b1"
    elif p:
        name = f"prefill_{p}"
    else:
        raise ValueError(f"a llama-bench test with neither n_prompt nor n_gen: {test}")
    return f"{name}_d{depth}" if depth else name


def placement(n_cpu_moe: int, layers: int | None) -> str:
    if n_cpu_moe <= 0:
        return "resident"
    if layers is not None and n_cpu_moe >= layers:
        return "cpu"
    return f"ncmoe{n_cpu_moe}"


def experts_on_gpu(place: str, layers: int | None) -> str:
    if place == "resident":
        return "all"
    if place == "cpu":
        return "none"
    if layers is None:
        return "?"
    n = int(place.removeprefix("ncmoe"))
    return f"{100 * max(layers - n, 0) // layers}%"


def pair(llama: list[dict], killick: list[dict], layers: int | None) -> list[Row]:
    """One row per llama.cpp test and killick row with the same (name, placement); then killick's others."""
    by_key: dict[tuple[str, str], list[dict]] = {}
    for k in killick:
        by_key.setdefault((k["name"], k["placement"]), []).append(k)
    rows, used = [], set()
    for t in llama:
        key = (test_name(t), placement(int(t.get("n_cpu_moe", 0)), layers))
        used.add(key)
        on_gpu = experts_on_gpu(key[1], layers)
        for k in by_key.get(key) or [{}]:
            rows.append(Row(*key, on_gpu, float(t["avg_ts"]), _float(t.get("stddev_ts")),
                            _float(k.get("tok_s")), k.get("variant")))
    for key, ks in by_key.items():
        if key not in used:
            rows += [Row(*key, k.get("experts_on_gpu") or experts_on_gpu(key[1], layers), None, None,
                         _float(k.get("tok_s")), k.get("variant")) for k in ks]
    return rows


def _float(x) -> float | None:
    return None if x is None else float(x)


def _fmt(x: float | None, spec: str) -> str:
    return MISSING if x is None else format(x, spec)


def format_table(rows: list[Row]) -> str:
    head = f"{'row':24} {'placement':10} {'experts on GPU':>14} {'llama.cpp tok/s':>16} {'killick tok/s':>14} " \
           f"{'killick ÷ llama.cpp':>20}"
    lines = [head]
    for r in rows:
        name = f"{r.name} ({r.variant})" if r.variant else r.name
        lines.append(f"{name:24} {r.placement:10} {r.experts_on_gpu:>14} {_fmt(r.llama_tok_s, '.1f'):>16} "
                     f"{_fmt(r.killick_tok_s, '.1f'):>14} {_fmt(r.ratio, '.3f'):>20}")
    return "\n".join(lines)


def llama_meta(llama: list[dict]) -> dict:
    """What ran on the llama.cpp side, from its first test (the same for every test of one run)."""
    keys = ("build_number", "build_commit", "backends", "gpu_info", "cpu_info", "model_type", "model_size",
            "n_threads", "flash_attn", "n_gpu_layers", "n_batch", "n_ubatch")
    return {k: llama[0][k] for k in keys if llama and k in llama[0]}


def compare(llama: list[dict], killick: dict | None, layers: int | None = None) -> tuple[list[Row], dict]:
    """The paired rows and what ran (the layer count used, the llama.cpp build and machine)."""
    killick = killick or {}
    if layers is None and killick.get("layers") is not None:
        layers = int(killick["layers"])
    return pair(llama, killick.get("rows", []), layers), {"layers": layers, "llama_cpp": llama_meta(llama)}


def to_json(rows: list[Row], meta: dict) -> dict:
    return {**meta, "rows": [{**r._asdict(), "ratio": r.ratio} for r in rows]}


def load_llama(path: str) -> list[dict]:
    """llama-bench's tests; a file cut off mid-run (llama-bench writes one test at a time, then the closing
    bracket) gives the tests it finished, with a line on stderr saying so."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _finished_tests(text)
        if data is None:
            raise
        print(f"compare: {path} ends mid-run; {len(data)} finished tests read", file=sys.stderr)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected llama-bench's JSON (a list of tests, from `llama-bench -o json`)")
    return data


def _finished_tests(text: str) -> list[dict] | None:
    """The complete test objects at the head of a cut-off JSON list, or None when it is not one."""
    if not text.lstrip().startswith("["):
        return None
    tests, decoder, i = [], json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return tests
        if not isinstance(obj, dict):
            return None
        tests.append(obj)


def load_killick(path: str | None) -> dict | None:
    if path is None:
        return None
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: expected killick's bench JSON, an object with a 'rows' list")
    for r in data["rows"]:
        if not {"name", "placement"} <= r.keys():
            raise ValueError(f"{path}: every killick row needs 'name' and 'placement': {r}")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.peers.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--llama", required=True, help="llama-bench -o json output")
    ap.add_argument("--killick", help="killick bench model --json output (rows without it print as —)")
    ap.add_argument("--layers", type=int, help="the checkpoint's layer count (tells -ncmoe L apart as 'cpu')")
    ap.add_argument("--json", help="write the table here as JSON")
    args = ap.parse_args(argv)
    try:
        rows, meta = compare(load_llama(args.llama), load_killick(args.killick), args.layers)
    except (OSError, ValueError, KeyError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows, meta), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
