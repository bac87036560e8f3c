"""One rule per shared option, on every verb (issue 27): ``--out`` never replaces what gradforensics did
not write and replaces recorded data only with ``--overwrite``; ``--quiet``, ``--storage-option``,
``--workers`` where they apply, from one helper each; help in workflow order with defaults shown; the
size estimate printed once."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from gradforensics import cli
from gradforensics.commands import output

#: Verbs whose --out is a store (the rest write a directory).
STORE_VERBS = ("capture", "import")
VERBS_WITH_OUT = ("demo", "capture", "import", "analyze", "report", "compare", "whatif", "loss")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "verb")
    return dict(sub.choices)


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return parser._option_string_actions.get(flag)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real store, analysed once, so that every verb has a valid input."""
    from gradforensics.recording import Recorder

    d = tmp_path_factory.mktemp("opts")
    rng = np.random.default_rng(0)
    with Recorder(d / "s.zarr", sources=["a", "b"], background=False) as rec:
        for i in range(8):
            rec.record(step=i, source="ab"[i % 2], loss=2.0 - 0.01 * i,
                       grads={"w": rng.standard_normal((4, 3)).astype(np.float32)})
    assert cli.main(["analyze", str(d / "s.zarr"), "--out", str(d / "first"), "--quiet"]) == 0
    return d / "s.zarr"


def _argv(verb: str, store, out) -> list[str]:
    s, o = str(store), str(out)
    return {"demo": ["demo", "--out", o],
            "capture": ["capture", "no-checkpoint", "--data", "a=no.txt", "--out", o],
            "analyze": ["analyze", s, "--out", o],
            "report": ["report", s, "--out", o],
            "compare": ["compare", s, s, "--out", o],
            "whatif": ["whatif", "no-checkpoint", "--data", "a=no.txt", "--arm", "a=sgd:lr=0.1", "--steps", "1",
                       "--out", o],
            "loss": ["loss", s, "--out", o],
            "import": ["import", str(store.parent), "--out", o]}[verb]


def test_every_verb_with_out_takes_it_from_the_one_helper():
    """Any verb with --out - these and any added later - states the one rule in its help."""
    has_out = {v: _option(p, "--out") for v, p in _parsers().items() if _option(p, "--out") is not None}
    assert set(VERBS_WITH_OUT) <= set(has_out)
    for verb, action in has_out.items():
        rule = output.STORE_RULE if action.metavar == "STORE" else output.DIR_RULE
        assert rule in action.help, verb


@pytest.mark.parametrize("verb", VERBS_WITH_OUT)
def test_out_never_replaces_what_gradforensics_did_not_write(verb, store, tmp_path, capsys):
    mine = tmp_path / ("mine.zarr" if verb in STORE_VERBS else "mine")
    mine.mkdir()
    (mine / "report.md").write_text("my own notes\n")
    extra = ["--overwrite"] if _option(_parsers()[verb], "--overwrite") else []
    for flags in ([], extra):                              # --overwrite does not change it
        assert cli.main([*_argv(verb, store, mine), "--quiet", *flags]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"gradforensics {verb}: error: --out {mine} ")
        if verb in STORE_VERBS:
            assert "gradforensics does not replace it, even with --overwrite" in err[0]
        else:
            assert "holds files gradforensics did not write (report.md)" in err[0]
            assert "even with --overwrite" in err[0]
    assert (mine / "report.md").read_text() == "my own notes\n"
    assert sorted(p.name for p in mine.iterdir()) == ["report.md"]


@pytest.mark.slow
def test_out_rerenders_its_own_files(store, tmp_path, capsys):
    out = tmp_path / "r"
    for verb in ("analyze", "analyze", "report", "compare", "loss"):    # each replaces the one before's files
        assert cli.main([*_argv(verb, store, out), "--quiet"]) == 0, verb
        assert (out / "report.md").is_file()
    marker = json.loads((out / output.MARKER).read_text())
    assert marker["verb"] == "analyze" and marker["written_by"].startswith("gradforensics ")
    capsys.readouterr()


@pytest.mark.slow
def test_an_empty_directory_is_new(store, tmp_path, capsys):
    (tmp_path / "e").mkdir()
    assert cli.main(["analyze", str(store), "--out", str(tmp_path / "e"), "--quiet"]) == 0
    assert (tmp_path / "e" / "report.html").is_file() and (tmp_path / "e" / output.MARKER).is_file()


def test_a_file_as_out_is_refused(store, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    assert cli.main(["analyze", str(store), "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--out {f} is a file, not a directory" in err and f.read_text() == "x"


def test_recorded_data_is_replaced_only_with_overwrite(tmp_path):
    """The demo's checkpoint and store, what an earlier run recorded in a directory gradforensics wrote."""
    from gradforensics.commands.demo import DEMO_RECORDED
    from gradforensics.errors import OutExistsError

    out = tmp_path / "demo"
    out.mkdir()
    output.mark(out, "demo")
    assert output.check_dir(out, stores=DEMO_RECORDED) == out            # nothing recorded yet
    (out / "dump.zarr").mkdir()
    with pytest.raises(OutExistsError, match=r"already holds dump\.zarr recorded by an earlier run; pass "
                                             r"--overwrite to replace it"):
        output.check_dir(out, stores=DEMO_RECORDED)
    assert output.check_dir(out, stores=DEMO_RECORDED, overwrite=True) == out


def test_capture_over_an_existing_store_needs_overwrite(store, tmp_path, capsys):
    from gradforensics.errors import OutExistsError

    output.check_store(str(store), overwrite=True)       # a gradforensics store: the library replaces it
    (tmp_path / "x.h5").write_bytes(b"not hdf5")
    with pytest.raises(OutExistsError, match=r"is not an HDF5 file; gradforensics does not replace it"):
        output.check_store(str(tmp_path / "x.h5"), overwrite=True)


# ------------------------------------------------------------------ the other shared options


@pytest.mark.parametrize(("flag", "verbs"), [
    ("--quiet", set(VERBS_WITH_OUT)),
    ("--storage-option", {"capture", "inspect", "analyze", "report", "compare", "loss"}),
    ("--workers", {"analyze", "compare", "whatif"}),
    ("--scheduler", {"analyze", "compare", "whatif"}),
    ("--overwrite", {"demo", "capture", "import", "whatif"}),
])
def test_shared_options_are_on_every_verb_they_apply_to_with_one_meaning(flag, verbs):
    parsers = _parsers()
    assert {v for v, p in parsers.items() if _option(p, flag) is not None} >= verbs
    helps = {_option(p, flag).help for p in parsers.values() if _option(p, flag) and flag != "--overwrite"}
    assert len(helps) <= 1, helps                         # one help text: one meaning
    if flag == "--overwrite":
        assert all("never anything else" in _option(parsers[v], flag).help for v in verbs)


def test_out_metavar_is_dir_everywhere_and_store_for_capture():
    metavars = {v: _option(p, "--out").metavar for v, p in _parsers().items() if _option(p, "--out")}
    assert {v: metavars[v] for v in VERBS_WITH_OUT} == {v: "STORE" if v in STORE_VERBS else "DIR"
                                                        for v in VERBS_WITH_OUT}
    assert set(metavars.values()) <= {"DIR", "STORE"}


def test_help_lists_verbs_in_workflow_order_with_defaults_shown():
    order = list(cli.VERBS)
    assert order[:9] == ["demo", "capture", "import", "inspect", "analyze", "report", "compare", "whatif", "loss"]
    text = cli.build_parser().format_help()
    assert [text.index(f"    {v} ") for v in order] == sorted(text.index(f"    {v} ") for v in order)
    capture = " ".join(_parsers()["capture"].format_help().split())
    for shown in ("sequences per batch (default: 8)", "(packed; default 512, or the model's own limit when lower)",
                  "batches replayed per source (default: 64)",
                  "(default: 0)", "(default: float32)"):
        assert shown in capture, shown
    assert "(default: None)" not in capture and "(default: False)" not in capture


@pytest.mark.slow
def test_analyze_says_what_it_does_after_the_bar(store, tmp_path, capsys):
    assert cli.main(["analyze", str(store), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    after = err[err.rindex("100%"):] if "100%" in err else err
    assert "gradient pass done; computing the findings" in after
    assert f"writing the report into {tmp_path / 'r'}" in after and "report written in" in after
    assert cli.main(["analyze", str(store), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    assert len(capsys.readouterr().err.splitlines()) == 1    # --quiet: the result line only
