"""`killick replay` on recordings it cannot use: one line naming the file and what is wrong, never a
traceback; a request the server had refused (body not JSON) is skipped."""
import gzip
import json
import socket
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.replay import log as replay_log

FIXTURE = Path(__file__).parents[3] / "fixtures" / "sessions" / "mini-swe-agent.jsonl.gz"
LINE = {"method": "POST", "path": "/v1/chat/completions", "headers": {},
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _jsonl(path, *lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(tmp: Path):
    truncated = tmp / "cut.jsonl.gz"
    truncated.write_bytes(FIXTURE.read_bytes()[:2000])
    not_gzip = tmp / "plain.jsonl.gz"
    not_gzip.write_text(json.dumps(LINE) + "\n")
    return [
        ([str(truncated)], "cut.jsonl.gz"),
        ([str(not_gzip)], "plain.jsonl.gz"),
        ([str(_jsonl(tmp / "types.jsonl", {**LINE, "headers": "x"}))], "headers must be a dict"),
        ([str(_jsonl(tmp / "ts.jsonl", {**LINE, "ts": "yesterday"}))], "ts must be a number"),
        ([str(_jsonl(tmp / "resp.jsonl", {**LINE, "response": {"choices": ["x"]}}))], "not in the API's shape"),
        ([str(_jsonl(tmp / "ok.jsonl", LINE)), "--url", f"http://127.0.0.1:{_closed_port()}"], "cannot reach"),
    ]


def test_unusable_recordings_are_one_line(tmp_path, capsys):
    for argv, needle in _cases(tmp_path):
        code = main(["replay", *argv, "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and needle in err and len(err.splitlines()) == 1, (argv, err)


def test_plot_without_matplotlib_is_refused_before_the_replay(tmp_path, capsys, monkeypatch):
    """The server is never asked (its port is closed): without matplotlib --plot fails first, not after a replay
    whose results it would then lose."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    argv = [str(_jsonl(tmp_path / "ok.jsonl", LINE)), "--url", f"http://127.0.0.1:{_closed_port()}",
            "--plot", str(tmp_path / "t.png")]
    assert main(["replay", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--plot needs matplotlib" in err and "cannot reach" not in err


def test_requests_whose_body_was_not_json_are_skipped(tmp_path, caplog):
    path = _jsonl(tmp_path / "mixed.jsonl", {**LINE, "body": None}, {**LINE, "body": "{nope"}, LINE)
    entries = replay_log.load([path])
    assert [e.body for e in entries] == [LINE["body"]] and "not a JSON object" in caplog.text


def test_gzip_recordings_still_load():
    assert len(replay_log.load([FIXTURE])) > 1
    with gzip.open(FIXTURE, "rt") as fh:
        assert json.loads(fh.readline())["path"].startswith("/v1/")


@pytest.mark.parametrize("line", [{**LINE, "method": 5}, {**LINE, "metrics": []}])
def test_wrong_field_types_name_the_line(tmp_path, line):
    with pytest.raises(ValueError, match=r"bad.jsonl:2: (method|metrics) must be"):
        replay_log.load([_jsonl(tmp_path / "bad.jsonl", LINE, line)])


def test_a_line_cut_off_mid_write_is_left_out_and_the_next_record_stays_whole(tmp_path, caplog):
    """A crash leaves a recording's last line cut off: the recorder starts its next line on a line of its own,
    and loading leaves the cut line out with a warning (a line broken in its middle is still an error)."""
    from proxy.replay.record import Recorder

    rec = Recorder(tmp_path / "rec")
    path = rec.write({**LINE, "metrics": {"session": "s"}})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(LINE)[:40])  # the crash
    rec.write({**LINE, "metrics": {"session": "s"}})
    assert len(path.read_text().splitlines()) == 3
    entries = replay_log.load([path])
    assert len(entries) == 2 and "cut off mid-write" in caplog.text
    broken = _jsonl(tmp_path / "broken.jsonl", LINE)
    broken.write_text(broken.read_text().replace('"path"', '"path" @', 1) + json.dumps(LINE) + "\n")
    with pytest.raises(ValueError, match="broken.jsonl:1: not JSON"):
        replay_log.load([broken])


def test_sessions_of_different_recordings_stay_apart(tmp_path):
    """Two recordings that both hold session "anon-1" (as every mini-swe-agent recording does), and two files of
    one name in two folders, are four sessions: --turns keeps the first of each, replay numbers each its own."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    line = {**LINE, "metrics": {"session": "anon-1"}}
    paths = [_jsonl(a / "mini.jsonl", line, line), _jsonl(b / "mini.jsonl", line, line),
             _jsonl(tmp_path / "other.jsonl", line, line), _jsonl(tmp_path / "solo.jsonl", {**LINE, "ts": 1})]
    entries = replay_log.load(paths)
    sessions = {e.session for e in entries}
    assert len(sessions) == 4 and "solo" in sessions and f"{a / 'mini.jsonl'}:anon-1" in sessions
    assert "other:anon-1" in sessions
    assert len(replay_log.first_turns(entries, 1)) == 4
