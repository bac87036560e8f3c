"""No all-clear without evidence (issue 45, items 1, 2, 6 and 8).

* An analysis that could not have fired on a store says so: ``Findings.not_judged`` (kind,
  reason, needed), ``flags.json`` ``not_judged``, the verdict and the overview.  Each
  threshold is checked against planted truth: one step below it a strong planted trouble
  does not reach 0.5 (so "not judged" is true), at it the trouble is flagged.
* A partial pass (``only=``) merges into the committed results.
* The verdict's cause follows the evidence it quotes (an oscillation the data order explains).
* The overview greys analyses that had nothing to read.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.model import Findings, NotJudged
from gradforensics.analysis.engine.results import read_findings
from gradforensics.analysis.kinds import conflict, drift, oscillation
from gradforensics.reporting import figures, flagsjson, summary
from gradforensics.store.reader import Store
from gradforensics.testing.planted_directions import planted_conflict, planted_drift, planted_oscillation


def _sev(result, flags) -> float:
    return max([f.severity for f in flags], default=0.0)


# ------------------------------------------------------------ thresholds against planted truth
@pytest.mark.parametrize("mode", ["replay", "training"])
def test_conflict_needs_its_records_per_source(mode):
    need = conflict.min_per_source(mode)
    for per_source, fires in ((need - 1, False), (need, True)):
        ctx = planted_conflict(n=3 * per_source, snr=50.0, strength=3.0, mode=mode).context()
        res = conflict.compute(ctx)
        sev = _sev(res, conflict.flags(res, ctx))
        assert (sev >= 0.5) is fires, (mode, per_source, sev)
        assert bool(res.not_judged) is not fires
    ctx = planted_conflict(n=3 * (need - 1), mode=mode).context()
    (nj,) = conflict.compute(ctx).not_judged
    assert nj.kind == "conflict" and f"zh {need - 1}" in nj.reason and nj.needed.startswith(f"≥ {need} records")


def test_drift_and_oscillation_need_their_history():
    for n, fires in ((drift.MIN_RECORDS - 1, False), (drift.MIN_RECORDS, True)):
        ctx = planted_drift(n=n, since=n // 4, snr=200.0).context()
        res = drift.compute(ctx)
        assert (_sev(res, drift.flags(res, ctx)) >= 0.5) is fires, n
        assert [x.kind for x in res.not_judged] == ([] if fires else ["drift"])
    for n, fires in ((oscillation.MIN_RECORDS - 2, False), (oscillation.MIN_RECORDS, True)):
        ctx = planted_oscillation(n=n, snr=200.0, amplitude=3.0, sources=("a", "b", "c")).context()
        res = oscillation.compute(ctx)
        assert (_sev(res, oscillation.flags(res, ctx)) >= 0.5) is fires, n
        assert [x.kind for x in res.not_judged] == ([] if fires else ["oscillation"])
    # a replay store has no history to judge: nothing is "not judged" for want of one
    ctx = planted_drift(n=8, since=2, mode="replay").context()
    assert drift.compute(ctx).not_judged == []


# ------------------------------------------------------------ end to end: 2 records per source
@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """What `whatif ... --steps 6` records: a training store of 6 steps, 2 records per source."""
    path = tmp_path_factory.mktemp("short") / "short.zarr"
    planted_conflict(n=6, snr=50.0, strength=3.0, mode="training").write(path)
    return path, gf.analyze(path, progress=False)


def test_short_run_is_not_an_all_clear(short_run, tmp_path):
    path, f = short_run
    kinds = {n.kind for n in f.not_judged}
    assert {"conflict", "drift", "oscillation", "loss_spectrum", "noise"} <= kinds
    assert not [x for x in f.flags if x.severity >= 0.5]
    verdict = summary.verdict(f)
    assert verdict.startswith("Not an all-clear") and "Nothing here needs action" not in verdict
    assert "conflict (too few records per source: zh 2, en 2, code 2" in verdict and "≥ 4 records per source" in verdict
    gf.report(f, tmp_path / "r")
    doc = json.loads((tmp_path / "r" / "flags.json").read_text())
    flagsjson.validate(doc)
    assert {d["kind"] for d in doc["not_judged"]} == kinds
    assert all(set(d) == {"kind", "reason", "needed"} and d["needed"] for d in doc["not_judged"])
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Not an all-clear" in md and "Nothing here needs action" not in md
    again = read_findings(Store(path))                 # saved with the findings, read back as they were
    assert again.not_judged == f.not_judged


def test_enough_records_judge_everything_and_the_all_clear_stays(tmp_path):
    f = Findings(store="x", n_records=96, mode="replay", sources=("a", "b"), header={}, results={}, flags=[])
    assert summary.verdict(f).startswith("Nothing here needs action")
    f.not_judged = [NotJudged("conflict", "too few records per source: a 2", "≥ 3 records per source")]
    assert summary.verdict(f).startswith("Not an all-clear")


def test_overview_greys_nothing_to_read_and_not_judged(short_run):
    _, f = short_run
    ov = figures.overview_data(f)
    for name in ("curvature", "optimizer", "attention"):          # empty tables: the store holds none of it
        r = ov.rows.index(name)
        assert ov.status[name] == "nothing to read" and np.isnan(ov.matrix[r]).all(), name
        assert ov.label(name) == f"{name}: nothing to read"
    r = ov.rows.index("conflict")
    assert ov.status["conflict"] == "not judged" and np.isnan(ov.matrix[r]).all()
    assert ov.status["noise"] == "not judged"                   # 6 records, noise needs min_records = 8
    assert ov.status.get("spectral") is None and not np.isnan(ov.matrix[ov.rows.index("spectral")]).all()


# ------------------------------------------------------------ a partial pass merges
def test_only_merges_into_the_committed_results(tmp_path):
    path = tmp_path / "c.zarr"
    planted_conflict(n=24, snr=5.0, mode="replay").write(path)
    full = gf.analyze(path, progress=False)
    top = full.flags[0]
    assert top.kind == "conflict" and top.severity >= 0.75
    time.sleep(1.1)                                              # the times are to the second
    part = gf.analyze(path, only="drift", progress=False)
    assert set(part.results) == {"drift"}                        # what this pass ran, as asked
    kept = read_findings(Store(path))
    assert set(kept.results) == set(full.results)
    assert [x.to_dict() for x in kept.flags if x.kind == "conflict"] == \
        [x.to_dict() for x in full.flags if x.kind == "conflict"]
    when = kept.header["analyses"]
    assert when["drift"] == part.header["finished"] and when["conflict"] == full.header["finished"]
    from gradforensics.cli import main

    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Nothing here needs action" not in md and "Data-source conflict" in md
    assert f"drift ({part.header['finished'].replace('T', ' ').replace('+00:00', ' UTC')})" in md
    # a pass over every analysis replaces them all (one time for all)
    gf.analyze(path, progress=False)
    assert len(set(read_findings(Store(path)).header["analyses"].values())) == 1


# ------------------------------------------------------------ the cause follows the evidence
def test_an_oscillation_the_data_order_explains_is_not_blamed_on_the_learning_rate():
    ctx = planted_oscillation(n=64, snr=5.0, amplitude=3.0, sources=("zh", "en")).context()
    res = oscillation.compute(ctx)
    fl = oscillation.flags(res, ctx)
    assert fl and fl[0].severity >= 0.5 and "the data order explains" in fl[0].summary
    assert fl[0].evidence["cause"] == "data"
    f = Findings(store="x", n_records=64, mode="training", sources=("zh", "en"), header={},
                 results={"oscillation": res}, flags=fl)
    v = summary.verdict(f)
    assert "learning rate vs curvature" not in v and "Most likely cause: data (oscillation" in v
    assert "Lower the LR" not in v.split("Try first:")[1]
    # three sources round-robin, period 2: the data order does not explain it: learning rate vs curvature
    ctx = planted_oscillation(n=64, snr=5.0, amplitude=3.0, sources=("a", "b", "c")).context()
    res = oscillation.compute(ctx)
    fl = oscillation.flags(res, ctx)
    f = Findings(store="x", n_records=64, mode="training", sources=("a", "b", "c"), header={},
                 results={"oscillation": res}, flags=fl)
    assert "Most likely cause: learning rate vs curvature (oscillation" in summary.verdict(f)


# ------------------------------------------------------------ analyze prints its top findings
def test_cli_analyze_prints_its_top_findings_most_severe_first(tmp_path, short_run, capsys):
    from gradforensics.cli import main

    path = tmp_path / "c.zarr"
    planted_conflict(n=24, snr=5.0, mode="replay").write(path)
    assert main(["analyze", str(path), "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'a' / 'report.html'}" in out
    sev = [float(line.split()[0]) for line in out.splitlines() if line.startswith("  ") and line.split()[0][0].isdigit()]
    assert sev and sev == sorted(sev, reverse=True) and sev[0] >= 0.75
    assert "conflict" in out and "zh and en gradients point opposite ways" in out
    assert main(["analyze", str(path), "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert capsys.readouterr().out == ""                             # --quiet: nothing on stdout
    short, _ = short_run
    assert main(["analyze", str(short), "--out", str(tmp_path / "s"), "--only", "conflict,drift"]) == 0
    io = capsys.readouterr()
    assert "  not judged: conflict (too few records per source: zh 2, en 2, code 2" in io.out
    assert "drift (too short a history" in io.out
    assert "note: this report holds the analyses run now (drift, conflict); the store's saved results keep" in io.err
