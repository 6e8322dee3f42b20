"""engine.bench.ab: two trees' `bench model` JSON row by row (medians over runs, new / old, rows on one side)."""
import json

import pytest

from engine.bench import ab


def _doc(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"what": "bench model", "rows": rows}))
    return str(path)


def test_rows_pair_by_name_with_medians_and_ratios(tmp_path, capsys):
    old = [_doc(tmp_path, f"old{i}.json", [
        {"name": "decode_b1", "tok_s": v, "pool_passes": 0.01, "experts": {"hits": 88, "misses": 12}},
        {"name": "extend_256", "tok_s": 1000.0, "ttft_ms": 256.0},
        {"name": "gone", "tok_s": 5.0}]) for i, v in enumerate((550.0, 560.0, 600.0))]
    new = [_doc(tmp_path, f"new{i}.json", [
        {"name": "decode_b1", "tok_s": v, "pool_passes": 0.03, "experts": {"hits": 87, "misses": 13}},
        {"name": "extend_256", "tok_s": 1450.0},
        {"name": "added", "tok_s": 7.0},
        {"name": "no_figure", "note": "a row without tok/s is left out"}]) for i, v in enumerate((530.0, 540.0))]
    rows = {r["name"]: r for r in ab.compare(ab.load(old), ab.load(new))}
    assert list(rows) == ["decode_b1", "extend_256", "gone", "added"]
    d = rows["decode_b1"]
    assert d["old"]["tok_s"] == 560.0 and d["new"]["tok_s"] == 535.0
    assert d["ratio"] == pytest.approx(535.0 / 560.0)
    assert d["old"]["hit_rate"] == pytest.approx(0.88) and d["new"]["pools"] == pytest.approx(0.03)
    assert rows["extend_256"]["ratio"] == pytest.approx(1.45) and rows["extend_256"]["new"]["pools"] is None
    assert rows["gone"]["new"] is None and rows["gone"]["ratio"] is None and rows["added"]["old"] is None
    out = tmp_path / "ab.json"
    assert ab.main(["--old", *old, "--new", *new, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "560.0 (550.0-600.0) [0.01 pools, hit 0.88]" in text and "0.955" in text and "—" in text
    assert json.loads(out.read_text())["rows"][0]["name"] == "decode_b1"


def test_files_that_are_not_bench_model_output_name_the_file(tmp_path, capsys):
    good = _doc(tmp_path, "good.json", [{"name": "decode_b1", "tok_s": 1.0}])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": "no"}))
    assert ab.main(["--old", good, "--new", str(other)]) == 2
    assert "other.json: not `killick bench model --json` output" in capsys.readouterr().err
    assert ab.main(["--old", str(tmp_path / "missing.json"), "--new", good]) == 2
    assert "missing.json: not a readable JSON file" in capsys.readouterr().err
