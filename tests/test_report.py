"""The report: summary sentences, figures, tables, flags.json schema, --fail-on, re-rendering from a store."""

from __future__ import annotations

import base64
import copy
import io
import json
import re
import shutil
from pathlib import Path

import _report_data as data
import numpy as np
import pandas as pd
import pytest

from gradforensics.cli import main
from gradforensics.errors import FlagsSchemaError, PlotBugWarning, SpecError
from gradforensics.reporting import flagsjson, names, report, severity, summary
from gradforensics.reporting.bands import band
from gradforensics.reporting.figures import overview_data

# ------------------------------------------------------------------ names


def test_location_merges_adjacent_layers_modules_and_heads():
    units = [(data.tensor(layer, m), h) for layer in (5, 6) for m in ("k_proj", "q_proj") for h in (5, 2)]
    assert names.location(units) == "model.layers.5–6 q_proj/k_proj, heads 2 and 5"


def test_location_keeps_different_patterns_apart():
    units = [("model.layers.1.self_attn.q_proj.weight", 1), ("model.layers.1.self_attn.q_proj.weight", 2),
             ("model.layers.2.mlp.up_proj.weight", None), ("batches/loss", None)]
    assert names.location(units) == "model.layers.1 q_proj, heads 1–2; model.layers.2 up_proj; batches/loss"


@pytest.mark.parametrize(("values", "expected"), [
    ([5, 6], ["5–6"]), ([1, 3, 4, 5], ["1", "3–5"]), ([7], ["7"]), ([], []), ([2, 0, 1, 9], ["0–2", "9"]),
])
def test_int_ranges(values, expected):
    assert names.int_ranges(values) == expected


@pytest.mark.parametrize(("name", "prefix", "layer", "module"), [
    ("model.layers.5.self_attn.q_proj.weight", "model.layers", 5, "q_proj"),
    ("transformer.h.3.attn.c_attn.weight", "transformer.h", 3, "c_attn"),
    ("model.layers.2.mlp.act_fn", "model.layers", 2, "mlp.act_fn"),
    ("gpt_neox.layers.10.attention.query_key_value.weight", "gpt_neox.layers", 10, "query_key_value"),
    ("batches/loss", None, None, "batches/loss"),
    ("model.embed_tokens.weight", None, None, "embed_tokens"),
])
def test_parse_names(name, prefix, layer, module):
    loc = names.parse(name)
    assert (loc.prefix, loc.layer, loc.module) == (prefix, layer, module)


# --------------------------------------------------------------- severity


@pytest.mark.parametrize(("text", "value"), [("low", 0.25), ("MEDIUM", 0.5), ("high", 0.75), ("0.6", 0.6),
                                             ("0", 0.0), ("1", 1.0), (0.3, 0.3)])
def test_parse_severity(text, value):
    assert severity.parse_severity(text) == value


@pytest.mark.parametrize("text", ["severe", "1.5", "-0.1", "nan", ""])
def test_parse_severity_rejects(text):
    with pytest.raises(SpecError, match=r"severity must be a number in \[0, 1\] or one of low=0.25"):
        severity.parse_severity(text)


def test_exit_code_and_band():
    f = data.findings()
    assert severity.exit_code(f, None) == 0
    assert severity.exit_code(f, 0.91) == 1          # reaching counts
    assert severity.exit_code(f, 0.92) == 0
    assert severity.exit_code(data.findings(healthy=True), 0.0) == 0
    assert [band(s) for s in (0.1, 0.25, 0.5, 0.9)] == ["info", "low", "medium", "high"]


# ------------------------------------------------------------- flags.json


def _mutations():
    """(description, mutate(doc)) pairs; each makes a valid flags.json invalid."""
    def setf(key, value):
        def m(d):
            d["flags"][0][key] = value
        return m

    def dele(key):
        def m(d):
            del d["flags"][0][key]
        return m

    return [
        ("kind", setf("kind", "bogus")), ("severity", setf("severity", 1.2)), ("severity", setf("severity", "x")),
        ("head", setf("head", -1)), ("head", setf("head", 1.5)), ("records", setf("records", [0])),
        ("sources", setf("sources", "zh")), ("evidence", setf("evidence", [])), ("summary", dele("summary")),
        ("tensor", setf("tensor", "")), ("unexpected", setf("extra", 1)),
        ("schema", lambda d: d.update(schema=2)), ("mode", lambda d: d.update(mode="live")),
        ("n_records", lambda d: d.update(n_records=-1)), ("flags", lambda d: d.pop("flags")),
        ("not_judged", lambda d: d.update(not_judged="none")),
        ("not_judged", lambda d: d.update(not_judged=[{"kind": "conflict", "reason": "2 records per source"}])),
        ("not_judged", lambda d: d.update(not_judged=[{"kind": "conflict", "reason": "", "needed": "≥ 3"}])),
    ]


def test_flags_json_schema_accepts_findings_and_rejects_mutations():
    doc = json.loads(json.dumps(data.findings().flags_json()))
    flagsjson.validate(doc)
    for what, mutate in _mutations():
        bad = copy.deepcopy(doc)
        mutate(bad)
        errs = flagsjson.errors(bad)
        assert errs, what
        assert what in " ".join(errs), (what, errs)


def test_flags_json_checks_order_and_record_range():
    doc = json.loads(json.dumps(data.findings().flags_json()))
    doc["flags"].reverse()
    with pytest.raises(FlagsSchemaError, match="not sorted by severity"):
        flagsjson.validate(doc)
    doc = json.loads(json.dumps(data.findings().flags_json()))
    doc["flags"][0]["records"] = [0, 96]
    assert any("not a range inside the 96 records" in e for e in flagsjson.errors(doc))


def test_flags_schema_is_valid_json_schema_and_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(flagsjson.FLAGS_SCHEMA)
    v = jsonschema.Draft202012Validator(flagsjson.FLAGS_SCHEMA)
    doc = json.loads(json.dumps(data.findings().flags_json()))
    assert not list(v.iter_errors(doc))
    for what, mutate in _mutations():
        bad = copy.deepcopy(doc)
        mutate(bad)
        assert list(v.iter_errors(bad)), what


# ---------------------------------------------------------------- summary


def test_summary_names_layers_heads_sources_and_records():
    f = data.findings()
    groups = summary.group(f.flags)
    assert [g.kind for g in groups] == ["conflict", "nonfinite", "noise"]     # 0.91 and 0.84: one 'high' finding
    first = groups[0].sentence(f.n_records)
    assert first.startswith("model.layers.5–6 q_proj/k_proj, heads 2 and 5: zh and en gradients point opposite ways")
    assert "cos −0.63 to −0.62" in first and "p < 0.001" in first and "in all 96 records" in first
    assert "[8 flags]" in first
    assert "at record 10" in groups[1].sentence(96)
    assert "sources involved: code" in groups[1].sentence(96)
    assert not any("code" in g.sentence(96) for g in groups if g.kind == "conflict")


def test_findings_split_by_severity_band():
    f = data.findings()
    flags = [fl for fl in f.flags if fl.kind == "conflict"]
    flags = [type(fl)(**{**fl.__dict__, "severity": 0.9 if "layers.5" in fl.tensor else 0.6}) for fl in flags]
    high, medium = summary.group(flags)
    assert (high.band, medium.band) == ("high", "medium")
    assert high.location() == "model.layers.5 q_proj/k_proj, heads 2 and 5"
    assert medium.location() == "model.layers.6 q_proj/k_proj, heads 2 and 5"


def test_headline_healthy_and_sick():
    assert "No finding" in summary.headline(data.findings(healthy=True))
    assert summary.headline(data.findings()).startswith("10 flag(s) at or above 0.5 on 6 tensor(s) (conflict, noise, nonfinite)")


def test_overview_matrix_holds_the_planted_cells():
    f = data.findings()
    ov = overview_data(f)
    assert ov.rows == ["tconflict", "tnoise"]                      # neither registered here: the results' order
    assert ov.heads == data.HEADS and ov.layers == [*range(data.N_LAYERS), "other"]
    r = ov.rows.index("tconflict")
    row = ov.matrix[r]
    hot = {int(j) for j in np.flatnonzero(row > 0)}
    assert hot == {layer * data.HEADS + h for layer in data.CONFLICT_LAYERS for h in data.CONFLICT_HEADS}
    assert row[5 * data.HEADS + 2] == pytest.approx(0.91) and row[6 * data.HEADS + 5] == pytest.approx(0.84)
    other = len(ov.layers) - 1
    assert np.isnan(row[other * data.HEADS:]).all()               # conflict has no row outside the stack
    nf = ov.matrix[ov.rows.index("tnoise"), other * data.HEADS:]
    assert np.all(nf == pytest.approx(0.6))                        # the loss series: whole 'other' block


def test_overview_rows_registry_order_then_unregistered_then_flag_only(monkeypatch):
    from gradforensics.analysis.contract.model import Findings, Flag

    data.install(monkeypatch)                                      # REGISTRY: tconflict, then tnoise
    base = data.findings()
    results = {"textra": base.results["tnoise"], "tnoise": base.results["tnoise"],
               "tconflict": base.results["tconflict"]}             # results deliberately not in registry order
    orphan = Flag("orphan", "model.layers.1.mlp.down_proj.weight", None, (), 0.7, (0, 95),
                  {"analysis": "tgone"}, "named analysis absent from the results.")
    f = Findings("dump.zarr", 96, "replay", base.sources, base.header, results, [*base.flags, orphan])
    assert overview_data(f).rows == ["tconflict", "tnoise", "textra", "orphan"]


# ------------------------------------------------------------ the files


def _png_ok(raw: bytes) -> bool:
    from matplotlib.image import imread

    return raw[:8] == b"\x89PNG\r\n\x1a\n" and imread(io.BytesIO(raw), format="png").shape[0] > 50


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "out"
    with pytest.MonkeyPatch.context() as mp:
        data.install(mp)
        f = data.findings()
        with pytest.warns(PlotBugWarning, match="planted plot bug"):
            paths = report(f, out)
    return f, paths, out


def test_report_writes_every_output(rendered):
    f, paths, out = rendered
    assert {"html", "markdown", "flags", "tables/tconflict", "tables/tnoise", "figures/overview"} <= set(paths)
    assert all(p.exists() for p in paths.values())
    assert json.loads((out / "flags.json").read_text()) == json.loads(json.dumps(f.flags_json()))


def test_tables_put_tensor_and_head_first_with_empty_whole_tensor_heads(rendered):
    _, _, out = rendered
    t = pd.read_csv(out / "tables" / "tconflict.csv", keep_default_na=False)
    assert list(t.columns[:2]) == ["tensor", "head"]
    whole = t[t["head"] == ""]
    assert len(whole) == data.N_LAYERS * 4 * len(data.PAIRS)
    assert set(t.loc[t["head"] != "", "head"].astype(int)) == set(range(data.HEADS))
    raw = (out / "tables" / "tconflict.csv").read_text().splitlines()
    assert raw[0].startswith("tensor,head,")
    assert raw[1].split(",")[:2] == [data.tensor(0, "q_proj"), ""]   # whole-tensor row: empty head
    assert raw[2 * len(data.PAIRS) + 1].split(",")[:2] == [data.tensor(0, "q_proj"), "1"]   # head 1: a plain integer


def test_tables_reorder_scrambled_columns_tensor_and_head_first(tmp_path, monkeypatch):
    data.install(monkeypatch)
    f = data.findings(healthy=True)
    for res in f.results.values():                                 # head and tensor last, in reverse
        res.table = res.table[list(reversed(res.table.columns))]
    report(f, tmp_path / "out")
    for name in ("tconflict", "tnoise"):
        original = list(data.findings(healthy=True).results[name].table.columns)
        header = (tmp_path / "out" / "tables" / f"{name}.csv").read_text().splitlines()[0].split(",")
        assert header[:2] == ["tensor", "head"], (name, header)
        assert sorted(header[2:]) == sorted(c for c in original if c not in ("tensor", "head")), (name, header)
        t = pd.read_csv(tmp_path / "out" / "tables" / f"{name}.csv", keep_default_na=False)
        assert set(t["head"].astype(str)) == {"", *map(str, range(data.HEADS))}


def test_html_is_self_contained_and_every_figure_decodes(rendered):
    _, _, out = rendered
    html = (out / "report.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"#][^"]*)"', html)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs), refs[:3]
    assert "<link" not in html and "@import" not in html and "url(" not in html
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(imgs) == 4                                          # overview + 3 findings
    assert all(_png_ok(base64.b64decode(b)) for b in imgs)


def test_html_has_header_summary_sections_advice_and_sortable_table(rendered):
    _, _, out = rendered
    html = (out / "report.html").read_text()
    for text in ("LlamaForCausalLM", "zh 33%, en 33%, code 33%", "replay", "gradforensics test"):
        assert text in html
    summary_list = html[html.index('id="summary-list"'):html.index("</ol>")]
    assert summary_list.count("<li>") == 3
    assert "model.layers.5–6 q_proj/k_proj, heads 2 and 5: zh and en gradients point opposite ways" in summary_list
    assert "PCGrad" in html and "fp32" not in summary_list
    assert html.count('<section class="finding"') == 3
    table = html[html.index('id="layer-table"'):]
    table = table[:table.index("</table>")]
    n_units = data.N_LAYERS * (4 * (data.HEADS + 1) + 1) + 1          # + the loss series
    assert table.count("<tr>") == n_units + 1                         # + header row
    assert 'class="sortable"' in html and "gfSort" in html


def test_report_leads_with_the_verdict_then_the_map_then_findings_metadata_last(rendered):
    _, _, out = rendered
    html = (out / "report.html").read_text()
    order = [html.index(m) for m in ('id="verdict"', 'id="at-a-glance"', 'id="summary-list"', '<section class="finding"',
                                     'id="layer-table"', 'id="header"')]
    assert order == sorted(order), order
    verdict = re.search(r'<p class="verdict" id="verdict">(.*?)</p>', html).group(1)
    assert verdict.startswith("What is wrong: ") and "zh and en" in verdict and "Try first: " in verdict
    assert "model.layers.5–6" in verdict
    md = (out / "report.md").read_text()
    first = md.split("\n\n")[1]                       # the paragraph after the title
    assert first.startswith("What is wrong: ") and "Try first: " in first
    order = [md.index(m) for m in (first[:40], "## At a glance", "## Findings", "### 1.", "## Layer by layer",
                                   "## The run")]
    assert order == sorted(order), order


def test_verdict_of_a_healthy_run_says_nothing_needs_action():
    v = summary.verdict(data.findings(healthy=True))
    assert v.startswith("Nothing here needs action: no flag reaches 0.5")


def test_a_raising_plot_gives_a_note_not_a_blank_panel(rendered):
    _, _, out = rendered
    html = (out / "report.html").read_text()
    assert "plot() raised ValueError: planted plot bug" in html
    assert 'class="note"' in html
    md = (out / "report.md").read_text()
    assert "planted plot bug" in md


def test_markdown_links_figures_that_exist(rendered):
    _, _, out = rendered
    md = (out / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(links) == 4 and all((out / link).is_file() for link in links)
    assert "model.layers.5–6 q_proj/k_proj, heads 2 and 5" in md
    assert "| layer | tensor | head | tconflict | tnoise | max | flags |" in md


def test_healthy_findings_render_without_findings(tmp_path, monkeypatch):
    data.install(monkeypatch)
    paths = report(data.findings(healthy=True), tmp_path)
    html = paths["html"].read_text()
    assert "No finding in 96 records" in html and "No findings." in html
    assert json.loads(paths["flags"].read_text())["flags"] == []


# -------------------------------------------- CLI: report from a store, --fail-on


def _store_with_findings(path: Path, f) -> Path:
    """A tiny real store, with *f* persisted as its analysis results (as analyze leaves it)."""
    from gradforensics.analysis.engine.results import save_results
    from gradforensics.recording import Recorder

    rng = np.random.default_rng(0)
    with Recorder(path, sources=["zh", "en", "code"], mode="replay", background=False) as rec:
        for i in range(96):
            rec.record(step=0, loss=1.0, source=("zh", "en", "code")[i % 3],
                       grads={data.tensor(0, "q_proj"): rng.standard_normal((8, 8)).astype(np.float32)})
    save_results(path, f)
    return path


@pytest.mark.slow
def test_report_command_rerenders_without_gradients(tmp_path, monkeypatch, capsys):
    from gradforensics.errors import CorruptChunkError
    from gradforensics.store.reader import Store

    data.install(monkeypatch)
    store = _store_with_findings(tmp_path / "dump.zarr", data.findings())
    for chunks in (store / "grads").rglob("c"):                  # the gradients are gone ...
        shutil.rmtree(chunks)
    with pytest.raises(CorruptChunkError):
        Store(store)
    with pytest.warns(PlotBugWarning):
        rc = main(["report", str(store), "--out", str(tmp_path / "r")])     # ... and the report still renders
    assert rc == 0
    out = capsys.readouterr().out
    assert "report.html" in out and "0.91 conflict" in out
    assert (tmp_path / "r" / "report.html").is_file()
    assert json.loads((tmp_path / "r" / "flags.json").read_text()) == json.loads(json.dumps(data.findings().flags_json()))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    return _store_with_findings(tmp_path_factory.mktemp("stored") / "dump.zarr", data.findings())


@pytest.mark.parametrize(("fail_on", "rc"), [("high", 1), pytest.param("0.91", 1, marks=pytest.mark.slow), ("0.95", 0),
                                             pytest.param("low", 1, marks=pytest.mark.slow)])
def test_report_command_fail_on(tmp_path, monkeypatch, stored, fail_on, rc):
    data.install(monkeypatch)
    store = stored
    with pytest.warns(PlotBugWarning):
        assert main(["report", str(store), "--out", str(tmp_path / "r"), "--fail-on", fail_on]) == rc


def test_report_command_errors(tmp_path, capsys):
    from gradforensics.recording import Recorder

    with Recorder(tmp_path / "bare.zarr", sources=["a"], background=False) as rec:
        rec.record(step=0, source="a", grads={"w": np.ones((2, 2), np.float32)})
    assert main(["report", str(tmp_path / "bare.zarr"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "holds no analysis results; run `gradforensics analyze" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "r")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "bare.zarr"), "--out", str(tmp_path / "r"), "--fail-on", "severe"])
    assert exc.value.code == 2
    assert "severity must be a number in [0, 1]" in capsys.readouterr().err


# ------------------------------------------ end to end on a planted-truth store


@pytest.fixture(scope="module")
def planted_conflict_store(tmp_path_factory):
    from gradforensics.testing.planted_directions import planted_conflict

    d = tmp_path_factory.mktemp("planted")
    planted = planted_conflict(seed=0, n=96)
    planted.write(d / "dump.zarr")
    return d, planted.truth


def test_analyze_then_report_names_the_planted_layers_heads_and_sources(planted_conflict_store):
    d, truth = planted_conflict_store
    rc = main(["analyze", str(d / "dump.zarr"), "--out", str(d / "out"), "--only", "conflict", "--quiet",
               "--fail-on", "high"])
    assert rc == 1                                                   # a planted conflict reaches 'high'
    assert truth["where"] == {"model.layers.1.self_attn.q_proj.weight": [1, 2], "model.layers.2.mlp.up_proj.weight": None}
    doc = json.loads((d / "out" / "flags.json").read_text())
    flagsjson.validate(doc)
    html = (d / "out" / "report.html").read_text()
    summary_list = html[html.index('id="summary-list"'):html.index("</ol>")]
    first = re.findall(r"<li>(.*?)</li>", summary_list)[0]
    assert "model.layers.1 q_proj, heads 1–2; model.layers.2 up_proj: zh and en gradients point opposite ways" in first
    assert "code" not in " ".join(re.findall(r"conflict</a> — (.*?)</li>", summary_list))
    assert main(["report", str(d / "dump.zarr"), "--out", str(d / "again"), "--fail-on", "0.5"]) == 1
    assert json.loads((d / "again" / "flags.json").read_text()) == doc
