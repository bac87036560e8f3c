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
