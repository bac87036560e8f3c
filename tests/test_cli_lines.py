"""One line each (issue 45, items 5 and 10): capture's warnings, a curvature capture that cannot judge
stability, Ctrl-C while the report is written, and a reader of stdout that leaves early."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_capture_cli import base_args, files, llama_dir  # noqa: E402,F401

from gradforensics import cli  # noqa: E402
from gradforensics.errors import CaptureWarning, ReportInterrupted  # noqa: E402
from gradforensics.store.probes import NO_STABILITY_VERDICT  # noqa: E402
from gradforensics.testing.planted import nonfinite_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cli(*argv) -> tuple[int, str]:
    """``gradforensics ARGV`` in a fresh interpreter (Python's own warning display): exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "gradforensics", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=600)
    return proc.returncode, proc.stderr


@pytest.mark.slow                      # a fresh interpreter loading torch and transformers: ~35 s
def test_capture_warnings_are_one_line_each(llama_dir, files, tmp_path):   # noqa: F811
    """Rows that repeat (one line a source), and curvature under Adam without its state (no verdict possible)."""
    curv = ("--curvature", "--curvature-blocks", "layer", "--curvature-tensors", "*.layers.1.mlp.down_proj.*",
            "--curvature-k", "1", "--curvature-iters", "3", "--curvature-batches", "1")
    rc, err = _cli("capture", *base_args(llama_dir, files, tmp_path / "r.zarr", "--batches-per-source", "12",
                                         "--batch-size", "16", *curv, "--optimizer", "adam", "--lr", "1e-3"),
                   "--quiet")
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "rows repeat" in ln]
    assert len(lines) == 2, err                                   # en and zh: one line each
    assert all(ln.startswith("gradforensics capture: warning: ") for ln in lines), lines
    assert "Warning:" not in err and "warnings.warn" not in err and ".py:" not in err
    said = [ln for ln in err.splitlines() if NO_STABILITY_VERDICT in ln]
    assert len(said) == 1 and said[0].startswith("gradforensics capture: warning: --curvature under adam: "), err


def test_the_library_warning_stays_filterable(llama_dir, files, tmp_path):   # noqa: F811
    import gradforensics as gf

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gf.capture(llama_dir, {"en": files["en"]}, tmp_path / "w.zarr",
                   batches={"batches_per_source": 12, "batch_size": 16, "seq_len": 32})
    assert [w for w in caught if issubclass(w.category, CaptureWarning) and "rows repeat" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=CaptureWarning)
        gf.capture(llama_dir, {"en": files["en"]}, tmp_path / "w2.zarr",
                   batches={"batches_per_source": 12, "batch_size": 16, "seq_len": 32})


def test_the_refusal_follows_the_known_optimizer(llama_dir, files, tmp_path, capsys):  # noqa: F811
    curv = ("--curvature", "--curvature-k", "1", "--curvature-iters", "3", "--curvature-batches", "1")
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.main(["capture", *map(str, base_args(llama_dir, files, tmp_path / "b.zarr", *curv,
                                                      "--optimizer", "adam"))])
    err = capsys.readouterr().err
    assert rc == 2 and "--optimizer adam --lr 3e-4" in err and "sgd" not in err, err
    assert NO_STABILITY_VERDICT in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.main(["capture", *map(str, base_args(llama_dir, files, tmp_path / "c.zarr", *curv))])
    err = capsys.readouterr().err
    assert rc == 2 and "--optimizer adam --lr 3e-4 or --optimizer sgd --lr 0.1" in err, err


def test_no_verdict_line_under_sgd(llama_dir, files, tmp_path):  # noqa: F811
    """SGD's criterion is on the raw Hessian: the curvature capture can judge it, and says nothing."""
    import gradforensics as gf

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gf.capture(llama_dir, {"en": files["en"]}, tmp_path / "s.zarr",
                   batches={"batches_per_source": 2, "batch_size": 2, "seq_len": 32},
                   curvature={"optimizer": "sgd", "lr": 0.1, "k": 1, "max_iter": 3, "batches": 1,
                              "blocks": "layer", "tensors": ["*.layers.1.mlp.down_proj.*"]})
    assert not [w for w in caught if NO_STABILITY_VERDICT in str(w.message)]


def test_ctrl_c_while_the_report_is_written_says_what_is_left(tmp_path, capsys, monkeypatch):
    from gradforensics import reporting

    store = tmp_path / "dump.zarr"
    nonfinite_store(store, n_records=12, records=(4, 7))
    assert cli.main(["analyze", str(store), "--out", str(tmp_path / "r"), "--only", "nonfinite", "--quiet"]) in (0, 1)
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(reporting, "report", interrupted)     # Ctrl-C lands inside the report step
    assert cli.main(["report", str(store), "--out", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err == (f"gradforensics report: interrupted: while writing into {tmp_path / 'r'}; what it holds is "
                   f"incomplete; the analysis results are saved in {store}: `gradforensics report {store} --out "
                   f"{tmp_path / 'r'}` writes it without reading the gradients again.")
    assert issubclass(ReportInterrupted, KeyboardInterrupt)


def test_a_reader_that_leaves_early_ends_every_verb_quietly(tmp_path):
    store = tmp_path / "dump.zarr"
    nonfinite_store(store, n_records=12, records=(4, 7))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for argv in (["inspect", str(store)], ["--help"], ["inspect", "--help"]):
        proc = subprocess.Popen([sys.executable, "-m", "gradforensics", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=tmp_path)
        proc.stdout.close()                          # `| head -0`: the reader is gone before the first line
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=120)
        assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, (argv, err)
        assert rc in (0, cli.EXIT_PIPE_CLOSED), (argv, rc, err)


def test_the_xarray_page_says_to_install_it_with_the_dev_extras_bound():
    """docs/xarray.md: xarray is no dependency; the page says to install it, with the bound the dev extra has."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("xarray")]
    bound = next(d for d in project["optional-dependencies"]["dev"] if d.startswith("xarray"))
    page = (ROOT / "docs" / "xarray.md").read_text()
    head = page[:page.index("```python")]                       # before the first example
    assert re.search(rf'pip install "{re.escape(bound)}"', head), bound
    assert "not a dependency" in head
