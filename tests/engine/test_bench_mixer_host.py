"""`python -m engine.bench.mixer_host` end to end on the tiny shape under Triton's interpreter: both arms run every
timed call, their logits equal bit for bit, the counts of what each queued are taken; and without CUDA its command
line says what it needs."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the tiny shape runs under Triton's interpreter (on CUDA: the GPU box's run)", allow_module_level=True)

from engine.bench import mixer_host  # noqa: E402


def test_both_arms_run_and_agree():
    res = mixer_host.run(tokens=20, runs=1, layers=2)
    assert res["logits_equal"] is True
    assert res["calls_timed"] == 1 and res["modes"]["mixer"] == {64: "direct"}  # (tiny: layer 1 is attention)
    for arm in mixer_host.ARMS:
        r = res[arm]
        assert r["median_us"] > 0 and r["torch_ops"] > 0
    # direct launches (no capture on a CPU): the mixer's gates, conv and norm are still launched, the rule's own
    # launches too (the reference rule is torch), so both arms launch the same three kernels a call
    assert res["mixer"]["triton_launches"] == res["as they come"]["triton_launches"] == 3


def test_without_cuda_the_command_line_says_what_it_needs(capsys):
    with pytest.raises(SystemExit) as done:
        mixer_host.main(["--runs", "1"])
    assert done.value.code == 2 and "needs CUDA" in capsys.readouterr().err
