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
    assert 0 < res["copy_calls_per_extend"] <= res["copied_per_extend"]
    assert (res["tier"], res["noise_z"]) == (plan.aligned.TIER, plan.aligned.NOISE_Z)
    assert res["ahead_ms_median"] > 0
    printed = capsys.readouterr().out
    assert "routing -> CPU job start" in printed and "split made -> job start" in printed
    assert "copies per extend" in printed


def test_plan_bench_sets_the_tier_for_its_run_alone():
    """--tier 1 --noise-z 0 (rank alone) copies the same experts in more calls than the defaults; aligned.TIER and
    NOISE_Z are back to their values after either run."""
    kept = plan.aligned.TIER, plan.aligned.NOISE_Z
    ranked = plan.main(["--tokens", "256", "--extends", "2", "--tier", "1.0", "--noise-z", "0"])
    assert (plan.aligned.TIER, plan.aligned.NOISE_Z) == kept and (ranked["tier"], ranked["noise_z"]) == (1.0, 0.0)
    tiered = plan.main(["--tokens", "256", "--extends", "2"])
    assert (plan.aligned.TIER, plan.aligned.NOISE_Z) == kept
    assert tiered["copy_calls_per_extend"] * 1.5 <= ranked["copy_calls_per_extend"], (tiered, ranked)


def test_plan_bench_refuses_no_tokens_and_a_tier_under_one():
    with pytest.raises(SystemExit):
        plan.main(["--tokens", "0"])
    with pytest.raises(SystemExit):
        plan.main(["--tier", "0.5"])
    with pytest.raises(SystemExit):
        plan.main(["--noise-z", "-1"])
