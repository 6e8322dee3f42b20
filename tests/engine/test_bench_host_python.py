"""`python -m engine.bench.host_python` times the host's pieces idle, beside the workers' read pass, and pinned."""
import json

import pytest

from engine.bench import host_python
from engine.experts import cpu_kernels


def test_host_python_times_each_piece_idle_reading_and_pinned(tmp_path, capsys):
    if not cpu_kernels.native_available():
        pytest.skip("the read pass needs the native CPU kernels")
    out = tmp_path / "hp.json"
    res = host_python.main(["--threads", "1", "--seconds", "0.02", "--pool-mb", "64", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["threads"] == 1 and res["pool_bytes"] == 64 << 20 and res["read_gbps"] > 0
    for cond in ("idle", "reading"):
        assert set(res[cond]) >= {"python", "numpy"} and all(us > 0 for us in res[cond].values())
    if res["pinned_to"] is not None:  # a core no worker holds, another left for the reader (none on 2 cores)
        assert res["pinned_to"] not in res["worker_cpus"] and set(res["reading_pinned"]) == set(res["idle"])
    else:
        assert res["reading_pinned"] == {}
    printed = capsys.readouterr().out
    assert "host Python beside the CPU's read pass: 1 workers" in printed
    assert printed.count("\npython ") == 1 and printed.count("\nnumpy ") == 1


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--seconds", "0"], ["--pool-mb", "8"]])
def test_host_python_refuses_what_it_cannot_time(argv, capsys):
    with pytest.raises(SystemExit):
        host_python.main(argv)
    assert "host_python: error:" in capsys.readouterr().err
