"""python -m proxy.bench runs end to end on loopback and reports every stage for first and later turns."""
import json

from proxy import bench


def test_bench_reports_every_stage_of_first_and_later_turns(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--prompt-words", "300", "--sessions", "1", "--turns", "2", "--json", str(out)]) == 0
    med = json.loads(out.read_text())["median_ms"]
    for kind in ("first", "later"):
        assert set(med[kind]) == {*bench.STAGES, *bench.HTTP}
        assert all(v >= 0 for v in med[kind].values())
    assert "arrival to submit" in capsys.readouterr().out
