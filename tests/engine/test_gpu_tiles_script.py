"""engine/bench/gpu_tiles.sh end to end on this machine: the GPU box's python replaced by a stand-in that prints a
sweep's choice for `bench tiles` and answers each bench process with a recorded `bench model` JSON (a box's), so
the script's flow — the sweep's tiles handed to every other process, the own / swept alternation, the A/B tables —
is checked without a GPU. The real `bench ab` runs on the files the stand-in wrote."""
from __future__ import annotations

import pytest

from tests.engine.box_util import run_script, stand_in, stand_in_box

STAND_IN = stand_in("gpu_tiles.sh", "engine.bench.ab", """  *"-m engine.bench.tiles"*)
    echo "$args" >> "$CALLS.tiles"
    echo "HBM copy rate 2.98 TB/s (read + write)"
    [ -n "${NO_CHOICE:-}" ] && exit 0
    echo "best lm_head      b1: [32, 64, 4, 6] 340.00 us vs cublas 360.00"
    echo "best by width class b1 (us a 40-layer step: best / the engine's): head 340.0 / 380.0"
    echo "  --skinny-tiles head=32,64,4,6/wide=32,128,4,4" ;;""")


@pytest.fixture()
def box(tmp_path):
    return stand_in_box(tmp_path, STAND_IN)


def _run(box, **extra: str):
    return run_script(box, "gpu_tiles.sh", **extra)


def test_the_sweeps_tiles_go_to_every_other_process_and_each_arm_gets_its_ab(box):
    done = _run(box, ROUNDS="2", ARMS="res: --moe-backend fused | uoff: --moe-backend offload --moe-slots 37.5%")
    assert done.returncode == 0, done.stderr[-2000:]
    tmp = box[0]
    summary = (tmp / "out" / "summary.txt").read_text()
    assert "tiles rc=0" in summary and "--skinny-tiles head=32,64,4,6/wide=32,128,4,4" in summary
    assert "--only projections --batch 1" in (tmp / "calls.txt.tiles").read_text()
    calls = (tmp / "calls.txt").read_text().splitlines()
    names = [c.split("--json ")[1].rsplit("/", 1)[1] for c in calls]
    assert names == [f"{arm}_{kind}{r}.json" for r in (1, 2) for arm in ("res", "uoff") for kind in ("own", "swept")]
    for call, name in zip(calls, names):
        swept = "--skinny-tiles head=32,64,4,6/wide=32,128,4,4" in call
        assert swept == ("_swept" in name) and "--batches 1 --prefill 0" in call
        assert ("--moe-slots 37.5%" in call) == name.startswith("uoff")
    for arm in ("res", "uoff"):
        ab = (tmp / "out" / f"ab_{arm}.txt").read_text()
        assert "old: the engine's tiles, new: --skinny-tiles head=32,64,4,6/wide=32,128,4,4" in ab
        assert "decode_b1" in ab and (tmp / "out" / f"ab_{arm}.json").exists()
        assert ab in summary


def test_a_sweep_that_chooses_nothing_stops_before_the_benches(box):
    done = _run(box, NO_CHOICE="1")
    assert done.returncode == 2
    assert "gpu_tiles: the sweep chose no tiles" in (box[0] / "out" / "summary.txt").read_text()
    assert not (box[0] / "calls.txt").exists()
