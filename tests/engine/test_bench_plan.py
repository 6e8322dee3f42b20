"""`python -m engine.bench.plan` runs on the CPU and times every layer call that gave the CPU a share."""
import json

import pytest

from engine.bench import plan


def test_plan_bench_times_the_calls_with_a_cpu_share(tmp_path, capsys):
    out = tmp_path / "plan.json"
    res = plan.main(["--tokens", "64", "--extends", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["layer_calls"] == 2 * plan.LAYERS and 0 < res["timed_calls"] <= res["layer_calls"]
    assert 0 < res["plan_ms_median"] <= res["plan_ms_max"]
    assert 0 < res["split_ms_median"] < res["plan_ms_max"] and 0 < res["start_ms_median"] < res["plan_ms_max"]
    printed = capsys.readouterr().out
    assert "routing -> CPU job start" in printed and "split made -> job start" in printed


def test_plan_bench_refuses_no_tokens():
    with pytest.raises(SystemExit):
        plan.main(["--tokens", "0"])
