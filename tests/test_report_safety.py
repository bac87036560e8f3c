"""Issue 10, the output side: names from a store are data, never paths, markup, formulas or terminal codes.

Rendering tests build hostile :class:`Findings` in memory (the store layer refuses
such names at ``record()``); the path-escape and strict-parsing tests use a real
store whose stored ``analysis/`` documents were rewritten after ``analyze``.
"""

from __future__ import annotations

import csv
import html.parser
import io
import json
import re
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gradforensics._text import csv_cell, md_code, md_text, terminal
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Findings, Flag
from gradforensics.analysis.engine.results import parse_flag, read_findings
from gradforensics.cli import main
from gradforensics.errors import CorruptStoreError, UnsafeNameError
from gradforensics.reporting import report
from gradforensics.reporting.paths import under
from gradforensics.reporting.summary import group
from gradforensics.store.results import read_document, write_results

LINK = "a`[x](javascript:alert(1))`b"
NEWLINE = "line1\nline2"
FORMULA = '=HYPERLINK("http://x")'
AT = "@SUM(1)"
ESC = "\x1b[31mred\x1b[0m"
SCRIPT = "<script>alert(1)</script>"
QUOTE = 'q" onmouseover="alert(1)'
MATH = "w$\\foo{$"                      # malformed mathtext: must not sink the figures
HOSTILE = (QUOTE, LINK, NEWLINE, FORMULA, AT, ESC, SCRIPT, MATH)    # QUOTE first: its figure has it as alt text


# ------------------------------------------------------------------ hostile findings, in memory
def _plain_plot(result: AnalysisResult, flag: Flag, ax) -> None:
    ax.plot([0, 1], [0, 1])                 # no title: the report titles it with the tensor name


def _noop(*args, **kwargs):
    raise AssertionError("the report must not compute")


def _install(monkeypatch) -> None:
    import gradforensics.analysis as analysis

    monkeypatch.setattr(analysis, "REGISTRY", {"tconflict": Analysis("tconflict", ("gram",), _noop, _noop,
                                                                     _plain_plot)})


def hostile_findings() -> Findings:
    """One conflict flag per hostile tensor name; hostile sources, summaries, header values and store name."""
    rows, flags = [], []
    for i, name in enumerate(HOSTILE):
        rows.append({"tensor": name, "head": None, "source_a": AT, "source_b": SCRIPT, "cosine": -0.62,
                     "=cmd|' /C calc'!A0": "-oops"})
        flags.append(Flag("conflict", name, None, (AT, SCRIPT), 0.9 - 0.05 * i, (0, 7),
                          {"analysis": "tconflict", "cosine": -0.62}, f"{name} pulls opposite ways"))
    header = {"model": {"class": ESC, "config": {"note": LINK}}, "sources": {AT: 0.5, SCRIPT: 0.5},
              "versions": {"gradforensics": "test"}, "comment": NEWLINE}
    return Findings(f"dump{NEWLINE}# owned.zarr", 8, "replay", (AT, SCRIPT), header,
                    {"tconflict": AnalysisResult(pd.DataFrame(rows))}, flags)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "out"
    with pytest.MonkeyPatch.context() as mp:
        _install(mp)
        paths = report(hostile_findings(), out)
    return paths, out


# ------------------------------------------------------------------ 1. names never become paths
def _analysed_store(root: Path) -> Path:
    """A tiny real store that `gradforensics analyze` has run on."""
    from gradforensics import Recorder

    path = root / "dump.zarr"
    rng = np.random.default_rng(0)
    with Recorder(path, sources=["a", "b"], background=False) as rec:
        for i in range(8):
            rec.record(step=i, loss=1.0, source="ab"[i % 2],
                       grads={"model.layers.0.w": rng.standard_normal((4, 4)).astype(np.float32)})
    assert main(["analyze", str(path), "--out", str(root / "first"), "--only", "nonfinite", "--quiet"]) == 0
    return path


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_stored_analysis_name_cannot_write_outside_out(tmp_path, capsys):
    from gradforensics.store.reader import Store

    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    store = _analysed_store(work)
    st = Store(store, check_chunks=False)
    doc = read_document(st, "findings")
    doc["analyses"] = ["nonfinite", "../../../escape/x"]
    write_results(st.path, documents={"findings": doc})
    before = _files(tmp_path)
    capsys.readouterr()
    assert main(["report", str(store), "--out", str(work / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'../../../escape/x' is not a lower-case identifier" in err and str(store) in err
    assert _files(tmp_path) == before                        # nothing written anywhere, in OUT or outside
    assert not list(tmp_path.rglob("escape")) and not list(tmp_path.rglob("x.csv"))


def test_report_refuses_unsafe_result_names_before_writing(tmp_path):
    f = Findings("s.zarr", 8, "training", (), {}, {"../../escape/x": AnalysisResult(pd.DataFrame({"tensor": ["w"]}))}, [])
    out = tmp_path / "deep" / "out"
    with pytest.raises(UnsafeNameError, match="not a lower-case identifier"):
        report(f, out)
    assert not _files(tmp_path) and not (tmp_path / "escape").exists()


def test_under_keeps_every_path_inside_out_even_through_links(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    assert under(out, "tables", "noise.csv") == out / "tables" / "noise.csv"
    for bad in ("..", ".", "", "a/b", "a\\b", "x\n.csv"):
        with pytest.raises(UnsafeNameError):
            under(out, bad)
    (out / "tables").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeNameError, match="outside"):
        under(out, "tables", "noise.csv")
    f = Findings("s.zarr", 8, "training", (), {}, {"noise": AnalysisResult(pd.DataFrame({"tensor": ["w"]}))}, [])
    with pytest.raises(UnsafeNameError, match="outside"):
        report(f, out)
    assert not _files(elsewhere)


# ------------------------------------------------------------------ 2. report.md
def test_markdown_shows_names_as_text_never_as_markup(rendered):
    paths, _ = rendered
    md = paths["markdown"].read_text(encoding="utf-8")
    for raw in (NEWLINE, ESC, "\x1b"):
        assert raw not in md                                  # no raw newline or escape inside a name
    assert "line1\\nline2" in md and "\\x1b[31mred" in md     # shown, not hidden
    for line in md.splitlines():
        if line.startswith("| "):
            assert line.endswith(" |"), line                  # no table row broken by a name
    assert md_code(LINK, table=True) == "``a`[x](javascript:alert(1))`b``"
    assert md_text(LINK) == "a\\`\\[x\\](javascript:alert(1))\\`b"
    assert md_text("- x") == "\\- x" and md_text("1. x") == "1\\. x" and md_text("q_proj") == "q_proj"

    markdown_it = pytest.importorskip("markdown_it")
    parser = markdown_it.MarkdownIt("commonmark").enable("table")
    tokens = [t for tok in parser.parse(md) for t in [tok, *(tok.children or [])]]
    assert not [t for t in tokens if t.type == "link_open"]
    assert not [t for t in tokens if t.type in ("html_inline", "html_block")]
    assert all(t.attrGet("src").startswith("figures/") for t in tokens if t.type == "image")
    rendered_html = parser.render(md)
    assert "<a " not in rendered_html and "<script>" not in rendered_html
    assert rendered_html.count("<h1>") == 1                   # the store name's "\n# owned" made no heading
    summary = rendered_html[rendered_html.index("<ol>"):rendered_html.index("</ol>")]
    assert summary.count("<li>") == len(group(hostile_findings().flags))


# ------------------------------------------------------------------ 3. CSV cells
def test_csv_cells_that_a_spreadsheet_would_evaluate_are_neutralised(rendered):
    _, out = rendered
    with open(out / "tables" / "tconflict.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    assert header[:2] == ["tensor", "head"] and "'=cmd|' /C calc'!A0" in header
    tensors = [r[0] for r in body]
    assert "'" + FORMULA in tensors and "'" + AT in tensors and LINK in tensors
    for r in body:
        for cell in r:
            assert not cell.startswith(("=", "+", "@", "\t", "\r")), cell
            if cell.startswith("-"):
                float(cell)                                   # only numbers may start with '-'
    cos = pd.read_csv(out / "tables" / "tconflict.csv")["cosine"]
    assert cos.dtype == float and (cos == -0.62).all()        # numeric cells stay numbers
    assert [csv_cell(v) for v in (-0.5, 3, None, "-x", "\tx", "ok")] == [-0.5, 3, None, "'-x", "'\tx", "ok"]


# ------------------------------------------------------------------ 4. terminal output
def test_print_top_escapes_control_characters():
    from gradforensics.commands.report import print_top

    buf = io.StringIO()
    f = hostile_findings()
    print_top(f, {"html": Path("r.html"), "markdown": Path("r.md"), "flags": Path("f.json")}, file=buf)
    text = buf.getvalue()
    assert "\x1b" not in text and "\\x1b[31mred\\x1b[0m" in text and "line1\\nline2" in text
    assert len(text.splitlines()) == 2 + len(group(f.flags))  # one line per finding, none split


def test_inspect_escapes_names_from_the_store(tmp_path, capsys):
    from gradforensics import Recorder

    path = tmp_path / "s.zarr"
    with Recorder(path, sources=["a"], background=False, model_info={"class": ESC, "note": NEWLINE}) as rec:
        rec.record(step=0, source="a", grads={"w": np.ones((2, 2), np.float32)})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "class=\\x1b[31mred\\x1b[0m" in out
    assert "note=line1\\nline2" in out


def test_analyze_summary_and_error_lines_are_escaped(tmp_path, monkeypatch, capsys):
    import gradforensics.analysis.engine.run as engine
    import gradforensics.commands.analyze as analyze_cmd
    import gradforensics.commands.loss as loss_cmd

    assert not hasattr(analyze_cmd, "_fallback_report") and not hasattr(loss_cmd, "_fallback_report")
    from gradforensics import Recorder

    store = tmp_path / "s.zarr"
    with Recorder(store, sources=["a"], background=False) as rec:
        rec.record(step=0, source="a", grads={"w": np.ones((2, 2), np.float32)})
    _install(monkeypatch)
    f = hostile_findings()
    f.store = ESC + ".zarr"
    monkeypatch.setattr(engine, "analyze", lambda *a, **k: f)
    assert main(["analyze", str(store), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31mred\\x1b[0m.zarr: 2 findings, 2 at or above 0.5 (8 flags)" in err
    assert (tmp_path / "out" / "report.html").is_file()        # the report package writes the full report

    def boom(*a, **k):
        raise CorruptStoreError(f"s.zarr: {ESC}\nsecond line")

    monkeypatch.setattr(engine, "analyze", boom)
    assert main(["analyze", str(store), "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\\x1b[31mred" in err
    assert terminal("a\x1b]0;title\x07b\u202ec") == "a\\x1b]0;title\\x07b\\u202ec"


# ------------------------------------------------------------------ 5. strict parsing of stored documents
GOOD_FLAG = {"kind": "nonfinite", "tensor": "model.layers.0.w", "head": None, "sources": ["a"], "severity": 0.6,
             "records": [0, 0], "evidence": {"nonfinite": 1}, "summary": "one NaN"}


def _set_flag(key, value):
    def mutate(doc):
        doc["flags"][0][key] = value
    return mutate


def _drop(key, flag=False):
    def mutate(doc):
        del (doc["flags"][0] if flag else doc)[key]
    return mutate


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _inflated_npz() -> bytes:
    """An uncompressed npz whose only series declares 10**10 float64 values and holds 8 bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        keys = io.BytesIO()
        np.save(keys, np.asarray(["k"]))
        zf.writestr("__keys__.npy", keys.getvalue())
        member = io.BytesIO()
        np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (10**10,)})
        zf.writestr("s0.npy", member.getvalue() + b"\0" * 8)
    return buf.getvalue()


#: case -> (how to damage the stored documents, what the one-line error must say)
DAMAGE = {
    "findings not json": ({"findings": b"{not json"}, "is not a JSON document"),
    "findings a list": (lambda d: [d], "must be an object"),
    "analysis name path": (lambda d: d.update(analyses=["../x"]), "'../x' is not a lower-case identifier"),
    "analysis name int": (lambda d: d.update(analyses=[5]), "analysis name 5"),
    "missing n_records": (_drop("n_records"), "missing field(s) ['n_records']"),
    "mode": (lambda d: d.update(mode="live"), "mode must be one of training, replay"),
    "flag not object": (lambda d: d.update(flags=["x"]), "a flag must be an object"),
    "flag kind": (_set_flag("kind", "bogus"), "kind must be one of"),
    "flag tensor": (_set_flag("tensor", 5), "tensor must be a non-empty string"),
    "flag head negative": (_set_flag("head", -1), "head must be null or a non-negative integer"),
    "flag head float": (_set_flag("head", 1.5), "head must be null or a non-negative integer"),
    "flag head bool": (_set_flag("head", True), "head must be null or a non-negative integer"),
    "flag severity text": (_set_flag("severity", "high"), "severity must be a finite number in [0, 1]"),
    "flag severity nan": (_set_flag("severity", float("nan")), "severity must be a finite number in [0, 1]"),
    "flag severity big": (_set_flag("severity", 1.5), "severity must be a finite number in [0, 1]"),
    "flag records short": (_set_flag("records", [0]), "records must be two integers"),
    "flag records text": (_set_flag("records", ["a", "b"]), "records must be two integers"),
    "flag records reversed": (_set_flag("records", [3, 1]), "records must be two integers"),
    "flag records outside": (_set_flag("records", [0, 99]), "not inside the store's 8 records"),
    "flag sources": (_set_flag("sources", "a"), "sources must be a list of strings"),
    "flag evidence": (_set_flag("evidence", []), "evidence must be an object"),
    "flag summary": (_set_flag("summary", None), "summary must be a string"),
    "flag missing key": (_drop("severity", flag=True), "missing field(s) ['severity']"),
    "flag unknown key": (_set_flag("extra", 1), "unknown field(s) ['extra']"),
    "table not object": ({"tables/nonfinite": []}, "must be an object with 'columns' and 'data'"),
    "table columns": ({"tables/nonfinite": {"columns": [1], "data": []}}, "columns must be a list of strings"),
    "table ragged": ({"tables/nonfinite": {"columns": ["tensor", "head"], "data": [["w"]]}},
                     "row 0 must be a list of 2 cells"),
    "table cell": ({"tables/nonfinite": {"columns": ["tensor"], "data": [[{"a": 1}]]}},
                   "not a string, number or null"),
    "table head": ({"tables/nonfinite": {"columns": ["tensor", "head"], "data": [["w", -1]]}},
                   "head must be null or a non-negative integer"),
    "series garbage": ({"series/nonfinite": b"garbage"}, "is not a series image"),
    "series compressed": ({"series/nonfinite": _npz(__keys__=np.asarray(["k"]), s0=np.zeros(3))}, "is compressed"),
    "series inflated": ({"series/nonfinite": _inflated_npz()}, "more than its"),
}


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    from gradforensics.store.reader import Store

    store = _analysed_store(tmp_path_factory.mktemp("analysed"))
    st = Store(store, check_chunks=False)
    doc = read_document(st, "findings")
    doc["flags"] = [GOOD_FLAG]
    write_results(st.path, documents={"findings": doc})
    return store


def test_well_formed_stored_findings_still_render(analysed, tmp_path):
    from gradforensics.store.reader import Store

    f = read_findings(Store(analysed, check_chunks=False))
    assert [fl.to_dict() for fl in f.flags] == [GOOD_FLAG] and list(f.results) == ["nonfinite"]
    assert main(["report", str(analysed), "--out", str(tmp_path / "r")]) == 0


#: One case of each part of the stored findings runs in the quick lane (``-m "not slow"``), the rest with the full suite.
DAMAGE_QUICK = {"findings not json", "findings a list", "analysis name path", "missing n_records", "flag kind",
                "flag severity nan", "flag records outside", "table ragged", "series garbage", "series inflated"}


@pytest.mark.parametrize("case", [c if c in DAMAGE_QUICK else pytest.param(c, marks=pytest.mark.slow) for c in DAMAGE])
def test_malformed_stored_documents_are_one_line_errors(analysed, tmp_path, capsys, case):
    from gradforensics.store.reader import Store

    store = tmp_path / "dump.zarr"
    shutil.copytree(analysed, store)
    st = Store(store, check_chunks=False)
    damage, message = DAMAGE[case]
    if callable(damage):
        doc = read_document(st, "findings")
        doc = damage(doc) or doc
        write_results(st.path, documents={"findings": doc})
    else:
        raw = {k: np.frombuffer(v, np.uint8) for k, v in damage.items() if isinstance(v, bytes)}
        write_results(st.path, arrays=raw, documents={k: v for k, v in damage.items() if not isinstance(v, bytes)})
    with pytest.raises(CorruptStoreError, match=re.escape(message)):
        read_findings(Store(store, check_chunks=False))
    capsys.readouterr()
    assert main(["report", str(store), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"gradforensics report: error: {store}: analysis/") and message in err


def test_flag_from_dict_round_trips_and_refuses_bad_fields():
    flag = parse_flag(GOOD_FLAG)
    assert flag.to_dict() == GOOD_FLAG
    with pytest.raises(CorruptStoreError, match=r"^here: severity must be"):
        parse_flag({**GOOD_FLAG, "severity": float("inf")}, "here")


# ------------------------------------------------------------------ 6. report.html stays inert
class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.starts.append((tag, attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_html_keeps_hostile_names_inert(rendered):
    paths, _ = rendered
    page = paths["html"].read_text(encoding="utf-8")
    tags = _Tags()
    tags.feed(page)
    assert [t for t, _ in tags.starts].count("script") == 2    # the report's own two scripts only
    attrs = [(k, v or "") for _, a in tags.starts for k, v in a]
    assert not [k for k, _ in attrs if k.startswith("on")]    # the quote in QUOTE closed no attribute
    assert not [v for _, v in attrs if v.strip().lower().startswith("javascript:")]
    assert any(QUOTE in v for k, v in attrs if k == "alt")    # the name is there, as attribute text
    text = "".join(tags.text)
    assert SCRIPT in text and LINK in text                    # shown as text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


# ------------------------------------------------------------------ figures: absurd numbers, mathtext
def test_figures_survive_absurd_layer_head_numbers_and_mathtext_names(tmp_path, monkeypatch):
    _install(monkeypatch)
    huge = "model.layers." + "9" * 5000 + ".w"
    flags = [Flag("conflict", MATH, None, ("a",), 0.95, (0, 0), {"analysis": "tconflict"}, "s"),   # titles its figure
             Flag("conflict", huge, 10**9, (), 0.9, (0, 0), {"analysis": "tconflict"}, "s"),
             Flag("conflict", "model.layers.0.w", None, (), 0.8, (0, 0), {"analysis": "tconflict"}, "s"),
             Flag("conflict", "model.layers.999999.w", None, (), 0.7, (0, 0), {"analysis": "tconflict"}, "s")]
    table = pd.DataFrame({"tensor": [huge], "head": [10**9]})
    f = Findings("s.zarr", 1, "training", (), {}, {"tconflict": AnalysisResult(table)}, flags)
    t0 = time.perf_counter()
    paths = report(f, tmp_path / "out")
    assert time.perf_counter() - t0 < 30
    assert json.loads(paths["flags"].read_text())["flags"][1]["head"] == 10**9
    assert "figures/finding-01-conflict" in paths and "w$\\foo{$" in paths["html"].read_text()
