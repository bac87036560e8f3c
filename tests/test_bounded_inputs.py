"""Inputs are read with bounded memory and refused in one line when they cannot be (issue 25)."""

from __future__ import annotations

import resource
import time

import pytest

from gradforensics.errors import DataError, SpecError
from gradforensics.replay import data


def _docs(path):
    return list(data.documents(data.parse_sources([f"src={path}"])[0]))


def test_a_line_beyond_the_cap_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1 << 20)       # 1 MiB cap for the test; the default is 16 MiB
    p = tmp_path / "big.txt"
    with p.open("wb") as f:
        f.write(b"a short document\n")
        f.write(b"x" * (40 << 20) + b"\n")                      # a 40 MiB line
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DataError, match=r"line 2 is longer than 1 MiB; one line is one document"):
        _docs(p)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown_kib < 16 << 10, f"peak RSS grew {grown_kib} KiB reading a refused 40 MiB line"


def test_a_line_of_exactly_the_cap_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1000)
    p = tmp_path / "edge.txt"
    p.write_bytes(b"y" * 999 + b"\n" + b"z" * 1000)               # 1000 bytes with its newline; 1000 without one
    assert [len(d) for d in _docs(p)] == [999, 1000]


def test_jsonl_nested_too_deep_is_one_line(tmp_path):
    p = tmp_path / "deep.jsonl"
    p.write_text('{"text": "fine"}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(DataError, match="line 2 nests JSON too deep"):
        _docs(p)


def test_absurd_batch_counts_are_refused_before_anything_is_allocated(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("some text\n")
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="beyond 100,000,000 rows"):
        data.load_batches(data.parse_sources([f"a={p}"]), None, seq_len=8, batch_size=8, n_batches=10**12)
    assert time.perf_counter() - t0 < 5


def test_arm_names_too_long_for_a_file_name_are_refused_at_parse():
    from gradforensics.runs.arms import MAX_NAME, parse_arm

    assert parse_arm("a" * MAX_NAME + "=adamw:lr=1e-3").name == "a" * MAX_NAME
    with pytest.raises(SpecError, match=f"arm name of 300 characters; at most {MAX_NAME}"):
        parse_arm("a" * 300 + "=adamw:lr=1e-3")


def test_whatif_steps_beyond_the_cap_are_refused_at_once(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gradforensics.cli import main

    p = tmp_path / "a.txt"
    p.write_text("some text\n")
    t0 = time.perf_counter()
    rc = main(["whatif", str(tmp_path / "ckpt"), "--data", f"a={p}", "--arm", "x=adamw:lr=1e-3",
               "--steps", "1000000000000", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--steps 1,000,000,000,000 is beyond 1,000,000" in err, err
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "out").exists()
