"""engine.bench.extend_table: the extend line over bench model's JSON files (torch-free)."""
import json
import statistics
from pathlib import Path

import pytest

from engine.bench import extend_table

PERF = Path(__file__).resolve().parents[2] / "docs" / "perf"
RUNS = sorted(PERF.glob("2026-12-06-h100-s61-call4-*.json"))


def test_each_row_is_the_files_extend_and_the_count_is_of_the_processes_at_the_line(tmp_path, capsys):
    assert len(RUNS) >= 9 and all(p.exists() for p in RUNS)
    rows = [extend_table.read_row(p) for p in RUNS]
    for path, row in zip(RUNS, rows):
        ext = next(r for r in json.loads(path.read_text())["rows"] if r["name"] == "extend_256")
        assert row.median_ms == ext["ttft_ms"] and row.x == ext["of_stream_bound"]
        assert (row.low_ms, row.high_ms) == (min(ext["runs_ms"]), max(ext["runs_ms"]))
        assert row.floor_ms == pytest.approx(ext["dram_bound_s"] * 1e3)
        assert row.on_cpu == statistics.median(r["cpu_runs"] for r in ext["extend_runs"])
    line = statistics.median(r.x for r in rows)  # half of them past it, whatever the files hold
    past = sum(r.x >= line for r in rows)
    assert 0 < past < len(rows) or len({r.x for r in rows}) == 1
    out = tmp_path / "t.json"
    assert extend_table.main([str(p) for p in RUNS] + ["--line", str(line), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{past} of {len(rows)} processes at or past {line:g}x" in text
    assert text.count("\n| ") == len(rows) + 1 and text.count("**") == 4 * past
    saved = json.loads(out.read_text())
    assert saved["past"] == past and [r["name"] for r in saved["rows"]] == [p.stem for p in RUNS]


def test_a_file_without_an_extend_row_is_one_usage_line(tmp_path, capsys):
    no_extend = tmp_path / "decode.json"
    no_extend.write_text(json.dumps({"rows": [{"name": "decode_b1", "tok_s": 100.0}]}))
    not_json = tmp_path / "notes.json"
    not_json.write_text("not json")
    for bad, says in ((no_extend, "no extend row"), (not_json, "not a bench model JSON file")):
        with pytest.raises(SystemExit) as exc:
            extend_table.main([str(RUNS[0]), str(bad)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err and says in err


def test_a_hybrid_process_gives_its_tail_clocks_lag():
    """A hybrid process's JSON carries hybrid.TailClock's stats (split.tail): the row shows the lag counted and
    the lags measured; older files, without them, show '-'."""
    hybrid = PERF / "2026-12-07-h100-s68-call9-bench_hybrid.json"
    tail = json.loads(hybrid.read_text())["split"]["tail"]
    row = extend_table.read_row(hybrid)
    assert (row.tail_ms, row.tail_samples) == (tail["lag_ms"], tail["samples"]) and row.tail_samples > 0
    old = extend_table.read_row(RUNS[0])
    assert old.tail_samples == 0
    lines = extend_table.table([row, old]).splitlines()
    assert lines[2].endswith(f"| {tail['lag_ms']:+.1f} ({tail['samples']}) |") and lines[3].endswith("| - |")
