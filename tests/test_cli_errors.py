"""The command line's refusals: one line on stderr, exit 2, no traceback (issue 27)."""

from __future__ import annotations

import pytest

from gradforensics import cli


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_parsers_take_no_abbreviation():
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    sub = next(a for a in parser._actions if a.dest == "verb")
    assert all(p.allow_abbrev is False for p in sub.choices.values())


@pytest.mark.parametrize(("argv", "line"), [
    (["capture", "ckpt", "--ouy", "X"],
     "gradforensics capture: error: unknown option --ouy (did you mean --out?); see `gradforensics capture --help`"),
    (["capture", "ckpt", "--data", "a=f", "--out", "o", "--batch-sise", "4"],
     "gradforensics capture: error: unknown option --batch-sise (did you mean --batch-size?); "
     "see `gradforensics capture --help`"),
    (["analyze", "s", "--out", "o", "--ou", "p"],        # an abbreviation is not an option
     "gradforensics analyze: error: unknown option --ou (did you mean --out?); see `gradforensics analyze --help`"),
    (["analyze", "s", "--out", "o", "--fail-onn=high"],
     "gradforensics analyze: error: unknown option --fail-onn (did you mean --fail-on?); "
     "see `gradforensics analyze --help`"),
    (["--versoin"], "gradforensics: error: unknown option --versoin (did you mean --version?); "
                    "see `gradforensics --help`"),
])
def test_misspelt_option_is_named_with_suggestion(argv, line, capsys):
    assert _refused(argv, capsys) == line


def test_leftover_arguments_are_the_verbs_error(capsys):
    line = _refused(["analyze", "a", "b", "--out", "o"], capsys)
    assert line == "gradforensics analyze: error: unrecognized arguments: b; see `gradforensics analyze --help`"


def test_missing_required_is_one_line_in_the_verbs_words(capsys):
    line = _refused(["loss"], capsys)
    assert line.startswith("gradforensics loss: error: the following arguments are required:")


def test_option_value_that_looks_negative_is_not_an_option(capsys):
    line = _refused(["analyze", "s", "--out", "o", "--slab-mb", "-1", "--nope"], capsys)
    assert "unknown option --nope" in line and "-1" not in line.split("option")[1]


# ------------------------------------------------------------------ --only, --fail-on, counts


def test_only_from_the_command_line_speaks_of_the_flag(tmp_path, capsys):
    rc = cli.main(["analyze", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "o"), "--only", "conflcit"])
    assert rc == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gradforensics analyze: error: --only must name analyses among [")
    assert "only=" not in lines[0] and "got ['conflcit'] (did you mean conflict?)." in lines[0]


def test_only_from_python_keeps_the_keyword():
    from gradforensics.analysis.engine.options import select_analyses
    from gradforensics.errors import SpecError

    with pytest.raises(SpecError, match=r"^only= must name analyses among .*; got \['nose'\] \(did you mean noise\?\)"):
        select_analyses("nose")


def _Flag(kind, tensor, severity, sources=()):
    from gradforensics.analysis.contract.model import Flag

    return Flag(kind=kind, tensor=tensor, head=None, sources=tuple(sources), severity=severity, records=(0, 1),
                evidence={}, summary="")


def test_counts_phrase_counts_findings_as_the_report_groups_them():
    from gradforensics.reporting.severity import counts_phrase

    flags = [_Flag("noise", f"w{i}", 0.3) for i in range(5)] + [_Flag("conflict", "q", 0.9, ("a", "b")),
                                                                 _Flag("conflict", "k", 0.8, ("a", "b"))]
    assert counts_phrase(flags) == "2 findings, 1 at or above 0.5 (7 flags)"
    assert counts_phrase([]) == "0 findings, 0 at or above 0.5 (0 flags)"


def test_fail_on_line_names_count_threshold_and_highest():
    from gradforensics.reporting.severity import fail_on_line

    hits = [_Flag("conflict", "q", 0.91, ("a", "b")), _Flag("conflict", "k", 0.8, ("a", "b")),
            _Flag("noise", "w", 0.6)]
    assert fail_on_line(hits, 0.5, "analyze") == (
        "gradforensics analyze: 2 findings (3 flags) at or above --fail-on 0.5 (highest 0.91 conflict on q); exit 1")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from gradforensics.testing.planted_directions import planted_conflict

    d = tmp_path_factory.mktemp("planted")
    planted_conflict(seed=0, n=96).write(d / "dump.zarr")
    return d


def test_fail_on_says_why_it_exits_1(planted, capsys):
    store, out = str(planted / "dump.zarr"), str(planted / "out")
    assert cli.main(["analyze", store, "--out", out, "--only", "conflict", "--quiet", "--fail-on", "high"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "Traceback" not in "\n".join(err)
    assert err[0] == f"{store}: 1 finding, 1 at or above 0.5 (3 flags); report in {out}"    # as the report lists it
    assert err[1].startswith("gradforensics analyze: 1 finding (3 flags) at or above --fail-on 0.75 (highest ")
    assert err[1].endswith(" conflict on model.layers.1.self_attn.q_proj.weight); exit 1")
    assert cli.main(["report", store, "--out", str(planted / "again"), "--fail-on", "0.5"]) == 1
    cap = capsys.readouterr()
    assert cap.err.startswith("gradforensics report: ") and len(cap.err.splitlines()) == 1
    assert cli.main(["report", store, "--out", str(planted / "again")]) == 0            # no threshold: no word
    assert capsys.readouterr().err == ""


def test_fail_on_line_for_compare_counts_new_or_worse_rows():
    from gradforensics.reporting.severity import fail_on_line

    class Row:
        kind, tensor, severity_after = "conflict", "q", 0.88

    assert fail_on_line([Row(), Row()], 0.75, "compare", rows=True) == (
        "gradforensics compare: 2 new or worse findings at or above --fail-on 0.75 (highest 0.88 conflict on q); "
        "exit 1")


# ------------------------------------------------------------------ paths


def _tiny_h5(path):
    import numpy as np

    from gradforensics.recording import Recorder

    with Recorder(path, sources=["a"], background=False) as rec:
        rec.record(step=0, source="a", grads={"w": np.ones((2, 2), np.float32)})
    return path


def test_a_directory_named_h5_is_said_to_be_a_directory(tmp_path, capsys):
    (tmp_path / "x.h5").mkdir()
    assert cli.main(["analyze", str(tmp_path / "x.h5"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{tmp_path / 'x.h5'}: is a directory, not an HDF5 file" in lines[0]
    assert "no such" not in lines[0]


def test_a_file_given_with_a_trailing_slash_is_the_file(tmp_path, capsys):
    store = _tiny_h5(tmp_path / "f.h5")
    assert cli.main(["analyze", f"{store}/", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines() == [f"{store}: 0 findings, 0 at or above 0.5 (0 flags); report in "
                                                    f"{tmp_path / 'o'}"]
