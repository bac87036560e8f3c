"""A missing optional dependency is one line naming its extra (exit 2), never a traceback.

The missing module is simulated by ``sys.modules[name] = None`` (what Python does for a
blocked import): the optional component is removed, nothing is mocked.
"""

from __future__ import annotations

import sys

import pytest

from gradforensics.cli import main
from gradforensics.errors import GradforensicsError, MissingExtraError
from gradforensics.testing.planted import healthy_store


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("module, extra", [("transformers", "hf"), ("torch", "torch")])
def test_demo_without_an_extra_is_one_line(monkeypatch, capsys, tmp_path, module, extra) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    line = _one_line(capsys)
    assert line == (f"gradforensics demo: error: the demo needs the '{extra}' extra ({module} is not installed): "
                    f"pip install 'gradforensics[{extra}]'")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("module, extra", [("torch", "torch"), ("transformers", "hf")])
def test_capture_without_an_extra_is_one_line(monkeypatch, capsys, tmp_path, module, extra) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    (tmp_path / "a.txt").write_text("hello world\n")
    rc = main(["capture", str(tmp_path / "ckpt"), "--data", f"a={tmp_path / 'a.txt'}", "--out", str(tmp_path / "o.zarr")])
    assert rc == 2
    line = _one_line(capsys)
    assert f"needs the '{extra}' extra" in line and f"gradforensics[{extra}]" in line, line


def test_analyze_workers_without_distributed_is_one_line(monkeypatch, capsys, tmp_path) -> None:
    store = healthy_store(tmp_path / "h.zarr", 0)
    monkeypatch.setitem(sys.modules, "distributed", None)
    assert main(["analyze", store.path, "--out", str(tmp_path / "r"), "--workers", "2", "--only", "noise",
                 "--quiet"]) == 2
    line = _one_line(capsys)
    assert line.endswith("--workers needs the 'distributed' extra (distributed is not installed): "
                         "pip install 'gradforensics[distributed]'"), line


def test_missing_extra_error_is_a_gradforensics_and_import_error() -> None:
    assert issubclass(MissingExtraError, GradforensicsError) and issubclass(MissingExtraError, ImportError)
