"""``gradforensics compare BEFORE AFTER --out DIR`` (design, "Comparing runs").

Each test builds its stores from scratch: a planted zh/en conflict in heads 1 and 2
of ``q_name(1)`` (``planted_conflict``) and a healthy control of the same model
(``healthy_directions``: same tensors, heads and shapes, no conflict).
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.cli import main
from gradforensics.errors import ModelMismatchError
from gradforensics.reporting.comparison import COLUMNS, status_of
from gradforensics.store.reader import Store
from gradforensics.store.results import has_result
from gradforensics.testing import planted_directions as P

N, LAYERS = 48, 2
WHERE = {P.q_name(1): (1, 2)}
PAIR = ("zh", "en")


def conflict(path, sources=("zh", "en", "code"), pair=PAIR):
    return P.planted_conflict(seed=1, n=N, n_layers=LAYERS, where=WHERE, sources=sources, pair=pair).write(path).path


def healthy(path, sources=("zh", "en", "code"), n_layers=LAYERS):
    return P.healthy_directions(seed=1, n=N, n_layers=n_layers, mode="replay", sources=sources).write(path).path


def conflict_rows(rows):
    return {(r["tensor"], r["head"]): r for r in rows if r["kind"] == "conflict"}


@pytest.mark.parametrize(("before", "after", "status"), [
    (None, None, None), (0.3, 0.45, None), (None, 0.49, None),
    (0.9, None, "resolved"), (0.6, 0.3, "resolved"),
    (None, 0.5, "new"), (0.4, 0.95, "new"),
    (0.5, 0.7, "worse"), (0.6, 0.79, "persisting"), (0.9, 0.6, "persisting"), (0.7, 0.7, "persisting"),
])
def test_status_rule(before, after, status):
    assert status_of(before, after) == status


def test_conflict_before_none_after_is_resolved(tmp_path, monkeypatch):
    before, after = conflict(tmp_path / "before.zarr"), healthy(tmp_path / "after.h5")
    c = gf.compare(before, after, tmp_path / "out", progress=False)
    rows = conflict_rows([r.to_dict() for r in c.rows])
    assert set(rows) == {(P.q_name(1), 1), (P.q_name(1), 2)}
    for r in rows.values():
        assert r["status"] == "resolved" and set(r["sources"]) == set(PAIR)
        assert r["severity_before"] >= 0.5 and r["severity_after"] is None
    assert c.counts()["new"] == 0 and not c.reaching(0.0)
    for path in (before, after):                         # analysed on the fly, saved as analyze does
        assert has_result(Store(path, check_chunks=False), "findings")

    def no_pass(*args, **kwargs):
        raise AssertionError("a store holding results was analysed again")

    monkeypatch.setattr("gradforensics.analysis.engine.run.analyze", no_pass)
    again = gf.compare(before, after, tmp_path / "again", progress=False)
    assert [r.to_dict() for r in again.rows] == [r.to_dict() for r in c.rows]


@pytest.mark.slow
def test_conflict_appearing_after_is_new_and_fails_on(tmp_path, capsys):
    before, after = healthy(tmp_path / "before.zarr"), conflict(tmp_path / "after.zarr")
    out = tmp_path / "out"
    assert main(["compare", before, after, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "new" in printed and "resolved" in printed.splitlines()[0]
    with open(out / "tables" / "compare.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert tuple(table[0]) == COLUMNS
    rows = conflict_rows(table)
    assert {k: r["status"] for k, r in rows.items()} == {(P.q_name(1), "1"): "new", (P.q_name(1), "2"): "new"}
    assert all(r["severity_before"] == "" and float(r["severity_after"]) >= 0.5 for r in rows.values())
    assert main(["compare", before, after, "--out", str(out), "--fail-on", "high"]) == 1    # results reused


def test_different_models_are_refused_in_one_line(tmp_path, capsys):
    small, deep = healthy(tmp_path / "small.zarr"), healthy(tmp_path / "deep.zarr", n_layers=LAYERS + 1)
    assert main(["compare", small, deep, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different models" in err
    assert repr(P.mlp_name(LAYERS)) in err                  # the first tensor (sorted) that differs
    assert not (tmp_path / "out").exists()
    assert not has_result(Store(small, check_chunks=False), "findings")       # refused before any pass

    with gf.Recorder(tmp_path / "wide.zarr", sources=("zh",), background=False) as rec:
        rec.record(step=0, loss=1.0, source="zh", grads={"w": np.ones((4, 3), np.float32)})
    with gf.Recorder(tmp_path / "tall.zarr", sources=("zh",), background=False) as rec:
        rec.record(step=0, loss=1.0, source="zh", grads={"w": np.ones((3, 4), np.float32)})
    with pytest.raises(ModelMismatchError, match=r"tensor 'w' has shape \(4, 3\) in .* but \(3, 4\)"):
        gf.compare(tmp_path / "wide.zarr", tmp_path / "tall.zarr", tmp_path / "out2")


@pytest.mark.slow
def test_outputs_and_hostile_source_names(tmp_path):
    evil = "=x<b>[a](javascript:1)|"
    sources = ("zh", evil, "code")
    before = conflict(tmp_path / "before.zarr", sources=sources, pair=("zh", evil))
    after = healthy(tmp_path / "after.zarr", sources=sources)
    out = tmp_path / "out"
    c = gf.compare(before, after, out, progress=False)
    for name in ("report.html", "report.md", "compare.json", "tables/compare.csv"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "compare.json").read_text())
    assert doc["schema"] == 1 and set(doc["counts"]) == {"new", "worse", "persisting", "resolved"}
    assert doc["rule"] == {"act": 0.5, "worse": 0.2}
    assert len(doc["rows"]) == len(c.rows) >= 2
    for r in doc["rows"]:
        assert set(r) >= set(COLUMNS) and r["status"] in doc["counts"]
    assert {r["status"] for r in doc["rows"] if r["kind"] == "conflict"} == {"resolved"}
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert figures and all(f.startswith("compare-") and f.endswith(".png") for f in figures)
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "<b>" not in md and "[a](javascript" not in md and r"\<b\>" in md
    assert "<b>[a]" not in html and "&lt;b&gt;" in html
    with open(out / "tables" / "compare.csv", newline="") as fh:
        cells = [r["sources"] for r in csv.DictReader(fh) if evil in r["sources"]]
    assert cells and all(not cell.startswith("=") for cell in cells)


@pytest.mark.slow
def test_unlike_runs_get_one_note_line_each(tmp_path, capsys):
    """Findings from another gradforensics version, or runs over other data sources: one note line each."""
    from gradforensics.store.results import read_document, write_results

    before = healthy(tmp_path / "before.zarr")
    after = healthy(tmp_path / "after.zarr", sources=("zh", "en", "web"))
    gf.analyze(before, progress=False)
    doc = read_document(Store(before, check_chunks=False), "findings")
    doc["header"]["versions"]["gradforensics"] = "0.0.1"          # saved by an older version
    write_results(before, documents={"findings": doc})
    capsys.readouterr()
    assert main(["compare", before, after, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gradforensics compare: note: ")]
    assert len(notes) == 2, notes
    assert "gradforensics 0.0.1" in notes[0] and "re-analyse both with one version" in notes[0]
    assert "code, en, zh before, en, web, zh after" in notes[1]
    from gradforensics.errors import CompareWarning

    with pytest.warns(CompareWarning, match="data sources differ"):
        gf.compare(before, after, tmp_path / "api")


@pytest.mark.slow
def test_like_runs_get_no_note(tmp_path, capsys):
    before, after = healthy(tmp_path / "before.zarr"), conflict(tmp_path / "after.zarr")
    capsys.readouterr()
    assert main(["compare", before, after, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err
