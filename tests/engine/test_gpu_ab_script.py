"""engine/bench/gpu_ab.sh end to end on this machine: the GPU box's python replaced by a stand-in that answers each
bench process with a recorded `bench model` JSON (a box's) and logs the directory it ran in, so the script's flow —
the warm-up run, each arm alternated between the old tree and this one, the A/B table of each arm — is checked
without a GPU. The real `bench ab` runs on the files the stand-in wrote."""
from __future__ import annotations

import pytest

from tests.engine.box_util import run_script, stand_in, stand_in_box

STAND_IN = stand_in("gpu_ab.sh", "engine.bench.ab")


@pytest.fixture()
def box(tmp_path):
    return stand_in_box(tmp_path, STAND_IN)


def test_each_arm_alternates_the_old_tree_and_this_one_and_gets_its_table(box):
    tmp = box[0]
    (tmp / "old" / "engine").mkdir(parents=True)
    arms = "uoff: --moe-backend offload --moe-slots 37.5% | zoff: --moe-backend offload --router-zipf 1.0"
    done = run_script(box, "gpu_ab.sh", OLD_TREE=str(tmp / "old"), ROUNDS="2", ARMS=arms)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp / "out" / "summary.txt").read_text()
    calls = (tmp / "calls.txt").read_text().splitlines()
    names = [c.split("--json ")[1].rsplit("/", 1)[1] for c in calls]
    assert names == ["warm.json"] + [f"{arm}_{side}{r}.json" for r in (1, 2) for arm in ("uoff", "zoff")
                                     for side in ("old", "new")]
    cwd = (tmp / "calls.txt.cwd").read_text().split()
    assert all((d == str(tmp / "repo")) == (n == "warm.json" or "_new" in n) for d, n in zip(cwd, names))
    assert all(("--router-zipf 1.0" in c) == n.startswith("zoff") for c, n in zip(calls, names))
    for arm in ("uoff", "zoff"):
        ab = (tmp / "out" / f"ab_{arm}.txt").read_text()
        assert ab.startswith(f"== {arm}\n") and "decode_b1" in ab and "1.000" in ab and ab in summary


def test_without_an_old_tree_or_arms_the_call_stops_saying_which(box):
    done = run_script(box, "gpu_ab.sh", ARMS="a: --moe-backend offload")
    assert done.returncode == 2 and "set OLD=REV or OLD_TREE=DIR" in (box[0] / "out" / "summary.txt").read_text()
    (box[0] / "old" / "engine").mkdir(parents=True)
    done = run_script(box, "gpu_ab.sh", OLD_TREE=str(box[0] / "old"))
    assert done.returncode == 2 and "set ARMS=" in (box[0] / "out" / "summary.txt").read_text()
    assert not (box[0] / "calls.txt").exists()
