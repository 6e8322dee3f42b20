"""engine.bench.peers.compare on a llama-bench JSON captured from a real run (b11434, CPU build, demo checkpoint:
`-p 256 -n 16 -ncmoe 0,5,8 -r 2`)."""
import json
from pathlib import Path

import pytest

from engine.bench.peers import compare as cmp

SAMPLE = Path(__file__).parent / "data" / "llama_bench_b11434_cpu.json"


@pytest.fixture
def llama():
    return json.loads(SAMPLE.read_text())


def _tok_s(llama, n_prompt, n_gen, ncmoe):
    (t,) = [t for t in llama if (t["n_prompt"], t["n_gen"], t["n_cpu_moe"]) == (n_prompt, n_gen, ncmoe)]
    return t["avg_ts"]


def test_every_llama_test_becomes_a_named_row_with_its_placement(llama):
    rows, meta = cmp.compare(llama, None, layers=8)
    assert [(r.name, r.placement, r.experts_on_gpu) for r in rows] == [
        ("prefill_256", "resident", "all"), ("decode_b1", "resident", "all"),
        ("prefill_256", "ncmoe5", "37%"), ("decode_b1", "ncmoe5", "37%"),
        ("prefill_256", "cpu", "none"), ("decode_b1", "cpu", "none")]
    assert [r.llama_tok_s for r in rows] == [t["avg_ts"] for t in llama]
    assert all(r.killick_tok_s is None and r.ratio is None for r in rows)
    assert meta["llama_cpp"]["build_number"] == 11434 and meta["llama_cpp"]["flash_attn"] == 1


def test_rows_pair_on_name_and_placement_and_keep_every_killick_variant(llama):
    decode = _tok_s(llama, 0, 16, 0)
    killick = {"layers": 8, "rows": [
        {"name": "decode_b1", "placement": "resident", "tok_s": 2 * decode},
        {"name": "prefill_256", "placement": "ncmoe5", "tok_s": 10.0, "variant": "offload"},
        {"name": "prefill_256", "placement": "ncmoe5", "tok_s": 20.0, "variant": "hybrid"},
        {"name": "decode_b8", "placement": "resident", "tok_s": 99.0}]}
    rows, meta = cmp.compare(llama, killick)
    by = {(r.name, r.placement, r.variant): r for r in rows}
    assert meta["layers"] == 8  # taken from killick's file
    assert by["decode_b1", "resident", None].ratio == pytest.approx(2.0)
    pp5 = _tok_s(llama, 256, 0, 5)
    assert by["prefill_256", "ncmoe5", "hybrid"].ratio == pytest.approx(20.0 / pp5)
    assert by["prefill_256", "ncmoe5", "offload"].ratio == pytest.approx(10.0 / pp5)
    assert by["decode_b1", "cpu", None].ratio is None
    assert by["decode_b8", "resident", None].llama_tok_s is None  # killick-only rows are kept
    assert len(rows) == 8


def test_without_a_layer_count_n_cpu_moe_stays_a_count(llama):
    rows, _ = cmp.compare(llama, None)
    assert {r.placement for r in rows} == {"resident", "ncmoe5", "ncmoe8"}
    assert {r.experts_on_gpu for r in rows} == {"all", "?"}


@pytest.mark.parametrize("test, name", [
    ({"n_prompt": 8192, "n_gen": 0}, "prefill_8192"),
    ({"n_prompt": 0, "n_gen": 128}, "decode_b1"),
    ({"n_prompt": 512, "n_gen": 128}, "pp512+tg128"),
    ({"n_prompt": 0, "n_gen": 128, "n_depth": 4096}, "decode_b1_d4096"),
])
def test_test_names(test, name):
    assert cmp.test_name(test) == name


def test_main_prints_the_table_and_writes_json(llama, tmp_path, capsys):
    killick = tmp_path / "k.json"
    killick.write_text(json.dumps({"rows": [{"name": "decode_b1", "placement": "resident",
                                             "tok_s": _tok_s(llama, 0, 16, 0) / 4}]}))
    out = tmp_path / "compare.json"
    assert cmp.main(["--llama", str(SAMPLE), "--killick", str(killick), "--layers", "8", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "killick ÷ llama.cpp" in lines[0] and len(lines) == 7
    (decode,) = [ln for ln in lines if ln.startswith("decode_b1") and " resident " in ln]
    assert decode.split()[-1] == "0.250"
    assert all(ln.split()[-1] == cmp.MISSING for ln in lines[1:] if ln is not decode)
    saved = json.loads(out.read_text())
    assert [r["ratio"] for r in saved["rows"]].count(None) == 5 and saved["layers"] == 8


@pytest.mark.parametrize("content, message", [
    ({"rows": [{"name": "decode_b1", "tok_s": 1.0}]}, "needs 'name' and 'placement'"),
    ([{"name": "decode_b1"}], "an object with a 'rows' list"),
])
def test_bad_killick_json_is_refused_with_a_sentence(tmp_path, capsys, content, message):
    bad = tmp_path / "k.json"
    bad.write_text(json.dumps(content))
    assert cmp.main(["--llama", str(SAMPLE), "--killick", str(bad)]) == 2
    assert message in capsys.readouterr().err


def test_llama_json_must_be_llama_benchs_list(tmp_path, capsys):
    bad = tmp_path / "l.json"
    bad.write_text("{}")
    assert cmp.main(["--llama", str(bad)]) == 2
    assert "llama-bench -o json" in capsys.readouterr().err


def test_a_llama_json_cut_off_mid_run_gives_its_finished_tests(tmp_path, capsys):
    text = SAMPLE.read_text()
    whole = json.loads(text)
    second = text.index("{", text.index("}", text.index("{")))  # the second test's opening brace
    cut = tmp_path / "cut.json"
    cut.write_text(text[: second + 40])  # killed while writing the second test
    assert cmp.load_llama(str(cut)) == whole[:1]
    assert "1 finished tests" in capsys.readouterr().err
    cut.write_text('{"not": "a list"')
    with pytest.raises(json.JSONDecodeError):
        cmp.load_llama(str(cut))
