"""The cheaper report writes what the plain paths write, byte for byte.

Each shortcut of ``gradforensics report`` (issue 28) is held against the path it
replaces, computed here by code that the shortcut did not change:

* figures: printed by their own Agg canvas, the evidence figure reused for every
  finding -> the same PNG bytes as a fresh figure through matplotlib's ``savefig``
  (what ``to_png`` did before), for every picture of a planted store's report;
* ``flags.json``: the direct check of each flag agrees with the schema's keyword walk
  (never more lenient), and the file is ``json.dumps`` of ``Findings.flags_json()``;
* tables: the CSVs and HTML tables from the once-ordered tables equal those ordered
  per use;
* series: the plain central-directory reader gives what ``numpy.load`` reads, falls
  back to :mod:`zipfile` for any other layout and refuses what it refused;
* store open: arrays differing only in dimension names are parsed by zarr once, and a
  bad dimension name is still refused in one line.
"""

from __future__ import annotations

import copy
import io
import json
import zipfile

import numpy as np
import pytest

from gradforensics.analysis.engine.seriesimage import pack_series, parse_series
from gradforensics.errors import CorruptStoreError
from gradforensics.reporting import flagsjson, tables


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """A planted conflict + oscillation store (heads, a non-finite record), analysed and reported."""
    import gradforensics as gf
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.reporting import report
    from gradforensics.store.reader import Store
    from gradforensics.testing.planted_directions import planted_oscillation, with_nonfinite

    d = tmp_path_factory.mktemp("cost")
    p = planted_oscillation(seed=3, n=64)
    with_nonfinite(p, sorted(p.grads)[0], [5]).write(d / "dump.zarr")
    gf.analyze(d / "dump.zarr", progress=False, only="oscillation,conflict,noise,drift,nonfinite,loss_spectrum")
    store = Store(d / "dump.zarr", check_chunks=False)
    findings = read_findings(store)
    report(findings, d / "out", store=store)
    return findings, store, d / "out"


def _savefig_png(fig) -> bytes:
    """What ``figures.to_png`` did before: matplotlib's own ``savefig``."""
    from gradforensics.reporting.figures import DPI, plain_log_ticks

    plain_log_ticks(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


@pytest.mark.slow
def test_every_figure_is_the_savefig_png_of_a_fresh_figure(reported):
    import matplotlib as mpl

    from gradforensics.reporting import figures, recordsmap, summary
    from gradforensics.reporting.document import MAX_FIGURES

    findings, store, out = reported
    groups = summary.group(findings.flags)
    with mpl.rc_context({"text.parse_math": False}):
        want = {"overview": _savefig_png(figures.overview(findings))}
        for g in groups[:MAX_FIGURES]:
            want[f"finding-{g.index + 1:02d}-{g.kind}"] = _savefig_png(figures.evidence(findings, g)[0])
        fig, why, _ = recordsmap.build(findings, store)
    assert why is None and fig is not None
    got = {p.stem: p.read_bytes() for p in (out / "figures").glob("*.png")}
    maps = [s for s in got if s.startswith("records-map-")]
    assert len(maps) == 1
    with mpl.rc_context({"text.parse_math": False}):
        want[maps[0]] = _savefig_png(fig)
    assert len(groups) >= 4 and {g.kind for g in groups} >= {"oscillation", "nonfinite"}
    assert sorted(got) == sorted(want)                 # the same set of figures: none dropped, none added
    assert [s for s in want if got[s] != want[s]] == []


def test_to_png_falls_back_to_savefig_where_its_settings_matter():
    import matplotlib as mpl

    from gradforensics.reporting.figures import new_figure, to_png

    def drawn():
        fig = new_figure(3.0, 2.0)
        fig.add_subplot().plot([1, 3, 2])
        return fig

    assert to_png(drawn()) == _savefig_png(drawn())
    with mpl.rc_context({"savefig.facecolor": "#123456"}):
        tinted = to_png(drawn())
        assert tinted == _savefig_png(drawn())
    assert tinted != to_png(drawn())


def test_flags_json_is_the_findings_document(reported):
    findings, _, out = reported
    doc = findings.flags_json()
    assert (out / "flags.json").read_text() == json.dumps(doc, indent=2, allow_nan=False) + "\n"
    assert len(doc["flags"]) == len(findings.flags) > 0


FLAG_MUTATIONS = [("kind", "bogus"), ("kind", 3), ("tensor", ""), ("tensor", None), ("head", -1), ("head", 1.5),
                  ("head", 2.0), ("head", True), ("sources", "zh"), ("sources", ["a", "a"]), ("sources", [1]),
                  ("severity", 1.2), ("severity", -0.1), ("severity", "x"), ("severity", True),
                  ("severity", float("nan")), ("severity", 1), ("records", [0]), ("records", [0, 1.0]),
                  ("records", [-1, 2]), ("records", (0, 1)), ("evidence", []), ("summary", 3), ("extra", 1)]


@pytest.mark.parametrize(("key", "value"), FLAG_MUTATIONS, ids=[f"{k}={v!r}" for k, v in FLAG_MUTATIONS])
def test_flag_check_refuses_what_jsonschema_refuses(reported, key, value):
    """The oracle is the ``jsonschema`` package's draft 2020-12 validator of the same schema."""
    jsonschema = pytest.importorskip("jsonschema")
    findings, _, _ = reported
    oracle = jsonschema.Draft202012Validator(flagsjson.flags_schema())
    doc = json.loads(json.dumps(findings.flags_json()))
    assert flagsjson.errors(doc) == [] and oracle.is_valid(doc)
    bad = copy.deepcopy(doc)
    bad["flags"][-1][key] = value
    got = flagsjson.errors(bad)
    if oracle.is_valid(bad):          # then only what the schema cannot say: order by severity, record ranges
        assert all("not sorted by severity" in e or "is not a range" in e for e in got), got
    else:
        assert got and got[0].startswith(f"flags.json.flags[{len(bad['flags']) - 1}]"), got     # names the flag


def test_tables_ordered_once_equal_tables_ordered_per_use(reported, tmp_path):
    findings, _, out = reported
    for name, res in findings.results.items():
        tables.write_csv(res.table, tmp_path / f"{name}.csv")              # ordered inside, as before
        assert (out / "tables" / f"{name}.csv").read_bytes() == (tmp_path / f"{name}.csv").read_bytes(), name


SERIES = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.asfortranarray(np.ones((3, 2))),
          "scalar": np.float64(2.5), "empty": np.zeros((0, 4)), "ints": np.arange(5, dtype=np.int64),
          "nan": np.array([np.nan, 1.0]), "names": np.frombuffer(b'["x", "y"]', dtype=np.uint8)}


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and
                                      np.asarray(a[k]).shape == np.asarray(b[k]).shape and
                                      np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def test_plain_series_reader_reads_what_numpy_reads():
    raw = pack_series(SERIES)
    with np.load(io.BytesIO(raw.tobytes()), allow_pickle=False) as z:
        ref = {str(k): z[f"s{i}"] for i, k in enumerate(z["__keys__"])}
    assert _equal(parse_series(raw), ref)
    assert _equal(parse_series(raw), SERIES)


def _savez(compressed: bool, comment: bytes = b"") -> np.ndarray:
    buf = io.BytesIO()
    arrays = {f"s{i}": np.asarray(v) for i, v in enumerate(SERIES.values())}
    (np.savez_compressed if compressed else np.savez)(buf, __keys__=np.asarray(list(SERIES)), **arrays)
    if comment:
        with zipfile.ZipFile(buf, "a") as zf:
            zf.comment = comment
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def test_other_layouts_go_through_zipfile_and_read_the_same_or_are_refused():
    with_comment = _savez(False, b"a comment")
    assert _equal(parse_series(with_comment), SERIES)                           # not the plain layout: zipfile's
    with pytest.raises(CorruptStoreError, match="compressed"):
        parse_series(_savez(True))
    raw = bytearray(pack_series(SERIES).tobytes())
    end = len(raw) - 22
    cd = int.from_bytes(raw[end + 16:end + 20], "little")
    for damage in (lambda b: b.__setitem__(slice(cd, cd + 4), b"PK\x09\x09"),       # central header signature
                   lambda b: b.__setitem__(slice(end + 16, end + 20), (len(b) + 9).to_bytes(4, "little")),  # directory
                   lambda b: b.__setitem__(slice(cd + 16, cd + 20), b"\0\0\0\0")):  # a member's CRC-32
        bad = bytearray(raw)
        damage(bad)
        with pytest.raises(CorruptStoreError, match="is not a series image"):
            parse_series(np.frombuffer(bytes(bad), dtype=np.uint8))


def test_dimension_names_parse_once_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    import gradforensics as gf
    from gradforensics.store import inventory
    from gradforensics.store.reader import Store

    path = tmp_path / "dims.zarr"
    with gf.Recorder(path, sources=["a"], mode="training") as rec:
        for i in range(3):
            rec.record(step=i, loss=1.0, source="a", grads={f"t{j}": np.ones(4, np.float32) for j in range(5)})
    import zarr

    parses: list[dict] = []
    real = zarr.AsyncArray

    def counting(metadata, *args, **kwargs):
        if isinstance(metadata, dict):
            parses.append(metadata)
        return real(metadata, *args, **kwargs)

    monkeypatch.setattr(zarr, "AsyncArray", counting)
    inventory.clear_parsed()
    Store(path, check_chunks=False)
    grads = [m for m in parses if m.get("data_type") == "float32" and m.get("shape") == [3, 4]]
    assert len(grads) == 1                                   # five gradient arrays, one parse
    meta_file = path / "grads" / "t3" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    assert len(set(meta["dimension_names"])) == 2
    meta["dimension_names"] = [7, "x"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptStoreError, match=r"grads/t3/zarr\.json: dimension_names \[7, 'x'\] is not a list of strings"):
        Store(path, check_chunks=False)


@pytest.mark.slow
def test_report_writes_the_same_outputs_twice(reported, tmp_path):
    """The reused figure leaves nothing behind: a second report into another directory is the same bytes."""
    from gradforensics.reporting import report

    findings, store, out = reported
    report(findings, tmp_path / "again", store=store)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "again").as_posix() for p in (tmp_path / "again").rglob("*")
                           if p.is_file())
    assert [f for f in files if (out / f).read_bytes() != (tmp_path / "again" / f).read_bytes()] == []
