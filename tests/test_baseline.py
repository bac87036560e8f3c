"""``analyze --baseline STORE`` / ``gf.analyze(..., baseline=STORE)`` (design, "Judged against the run itself").

The rule (:mod:`gradforensics.analysis.engine.baseline`) on hand-made findings, then on real stores:
a planted zh/en conflict in heads 1 and 2 of ``q_name(1)`` (``planted_conflict``) judged against a
store of the same model with the same conflict (shared: context, below 0.5) and against a healthy
store of it (``healthy_directions``: absent, so the finding stays); the CLI's error paths.
"""

from __future__ import annotations

import json

import pytest

import gradforensics as gf
from gradforensics.analysis.contract.model import AnalysisResult, Findings, Flag, baseline_of
from gradforensics.analysis.engine import baseline as B
from gradforensics.cli import main
from gradforensics.errors import ModelMismatchError, SpecError
from gradforensics.reporting import flagsjson
from gradforensics.testing import planted
from gradforensics.testing import planted_directions as P

N, LAYERS = 48, 2
WHERE = {P.q_name(1): (1, 2)}


def _flag(kind: str, severity: float, tensor: str = "t", head: int | None = None, **evidence) -> Flag:
    return Flag(kind, tensor, head, (), severity, (0, 9), evidence, f"{kind} on {tensor}.")


def _findings(flags: list[Flag], ran=("oscillation", "drift", "nonfinite")) -> Findings:
    import pandas as pd

    results = {name: AnalysisResult(pd.DataFrame()) for name in ran}
    return Findings(store="s.zarr", n_records=10, mode="training", sources=(), header={}, results=results,
                    flags=flags)


# ------------------------------------------------------------------ the rule
def test_shared_finding_is_context_new_and_stronger_ones_stay() -> None:
    target = _findings([_flag("oscillation", 0.8, "a", cosine=-0.9), _flag("oscillation", 0.9, "b"),
                        _flag("drift", 0.7, "c"), _flag("nonfinite", 1.0, "d"), _flag("oscillation", 0.3, "e")])
    base = _findings([_flag("oscillation", 0.7, "a", cosine=-0.8), _flag("oscillation", 0.5, "b"),
                      _flag("nonfinite", 1.0, "d"), _flag("oscillation", 0.2, "e"), _flag("drift", 0.9, "zzz")])
    out = {f.tensor: f for f in B.judge(target, base, "healthy.zarr", store="/x/healthy.zarr", reused=False).flags}
    # shown as strongly (0.8 vs 0.7, within 0.2): context, capped below 0.5, the summary says so
    assert out["a"].severity == B.CONTEXT < 0.5
    assert "as in the baseline healthy.zarr: severity 0.70" in out["a"].summary
    assert out["a"].evidence["baseline_severity"] == 0.7 and out["a"].evidence["baseline_evidence"] == {"cosine": -0.8}
    assert out["a"].evidence["cosine"] == -0.9                          # its own evidence is kept
    assert out["b"].severity == 0.9 and out["b"].evidence["baseline_severity"] == 0.5   # clearly stronger (+0.4)
    assert out["c"].severity == 0.7 and out["c"].evidence["baseline_severity"] == 0.0   # absent from the baseline
    assert "baseline" not in out["c"].summary
    assert out["d"].severity == 1.0                                     # a non-finite value is never context
    assert out["e"].severity == 0.3                                     # below 0.5 stays below
    doc = B.judge(target, base, "healthy.zarr", store="/x/healthy.zarr", reused=False).flags_json()
    assert doc["baseline"] == {"store": "/x/healthy.zarr", "n_records": 10, "reused": False, "context": 1}
    flagsjson.validate(doc)


def test_a_kind_the_baseline_did_not_analyse_is_kept_unjudged() -> None:
    target = _findings([_flag("drift", 0.8, "a")])
    base = _findings([_flag("drift", 0.8, "a")], ran=("oscillation",))
    (f,) = B.judge(target, base, "b", store="b", reused=True).flags
    assert f.severity == 0.8 and f.evidence["baseline_severity"] is None


def test_flags_json_baseline_is_optional_and_checked() -> None:
    doc = _findings([_flag("drift", 0.6)]).flags_json()
    assert "baseline" not in doc                                        # schema 1 documents stay as they were
    flagsjson.validate(doc)
    bad = {**doc, "baseline": {"store": "b", "n_records": -1, "reused": True, "context": 0}}
    assert flagsjson.errors(bad)
    assert baseline_of({"store": "b", "n_records": 3, "reused": True}) is None
    assert baseline_of({"store": "b", "n_records": 3, "reused": True, "context": 1}) is not None


# ------------------------------------------------------------ real stores
def conflict(path, seed: int = 1) -> str:
    return P.planted_conflict(seed=seed, n=N, n_layers=LAYERS, where=WHERE).write(path).path


def healthy(path, seed: int = 1) -> str:
    return P.healthy_directions(seed=seed, n=N, n_layers=LAYERS, mode="replay").write(path).path


def _conflicts(findings: Findings) -> dict[tuple[str, int | None], Flag]:
    return {(f.tensor, f.head): f for f in findings.flags if f.kind == "conflict" and f.tensor == P.q_name(1)
            and f.head in (1, 2)}


@pytest.mark.slow
def test_planted_conflict_shared_with_the_baseline_drops_new_one_stays(tmp_path) -> None:
    target = conflict(tmp_path / "target.zarr", seed=1)
    alone = _conflicts(gf.analyze(target, progress=False, options={"engine": {"persist": False}}))
    assert alone and all(f.severity >= 0.5 for f in alone.values())
    # against a healthy run of the model: the conflict is new, it keeps its severity, its evidence gains 0
    clean = gf.analyze(target, progress=False, baseline=healthy(tmp_path / "healthy.zarr"))
    kept = _conflicts(clean)
    assert {k: f.severity for k, f in kept.items()} == {k: f.severity for k, f in alone.items()}
    assert all(f.evidence["baseline_severity"] == 0.0 for f in kept.values())
    assert clean.header["baseline"]["store"].endswith("healthy.zarr") and clean.header["baseline"]["context"] == 0
    # against a run of the model that had the same conflict: context, below 0.5
    shared_base = conflict(tmp_path / "earlier.zarr", seed=2)
    judged = gf.analyze(target, progress=False, baseline=shared_base)
    ctx = _conflicts(judged)
    assert set(ctx) == set(alone)
    for f in ctx.values():
        assert f.severity < 0.5 and "as in the baseline earlier.zarr" in f.summary
        assert f.evidence["baseline_severity"] >= 0.5
    assert judged.header["baseline"]["context"] >= len(ctx) and not judged.header["baseline"]["reused"]
    # the baseline's pass was saved in it: the next judgement reuses it
    again = gf.analyze(target, progress=False, baseline=shared_base)
    assert again.header["baseline"]["reused"]
    assert [f.to_dict() for f in again.flags] == [f.to_dict() for f in judged.flags]


@pytest.mark.slow
def test_baseline_of_another_model_or_itself_is_refused(tmp_path) -> None:
    target = healthy(tmp_path / "target.zarr")
    other = planted.healthy_store(tmp_path / "other.zarr", n_records=8).path
    with pytest.raises(ModelMismatchError, match="another model: no gradient tensor in common"):
        gf.analyze(target, progress=False, baseline=other)
    with pytest.raises(SpecError, match="is the store being analysed"):
        gf.analyze(target, progress=False, baseline=target)


@pytest.mark.slow
def test_cli_baseline(tmp_path, capsys) -> None:
    target, base = conflict(tmp_path / "target.zarr"), conflict(tmp_path / "earlier.zarr", seed=2)
    other = planted.healthy_store(tmp_path / "other.zarr", n_records=8).path
    out = tmp_path / "out"
    assert main(["analyze", target, "--out", str(out), "--quiet", "--baseline", base]) == 0
    doc = json.loads((out / "flags.json").read_text())
    flagsjson.validate(doc)
    assert doc["baseline"]["store"].endswith("earlier.zarr") and doc["baseline"]["context"] >= 2
    assert "judged against the baseline" in capsys.readouterr().err
    for bad, says in [(other, "another model"), (str(tmp_path / "nowhere.zarr"), "nowhere.zarr"),
                      (target, "the store being analysed")]:
        assert main(["analyze", target, "--out", str(tmp_path / "o2"), "--quiet", "--baseline", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("gradforensics analyze: error:") and says in err


def test_report_header_names_the_baseline() -> None:
    from gradforensics.reporting.document import header_items

    target = _findings([_flag("drift", 0.8, "a")])
    judged = B.judge(target, _findings([_flag("drift", 0.7, "a")]), "early.zarr", store="/r/early.zarr", reused=True)
    items = dict(header_items(judged, None))
    assert items["Baseline"] == ("judged against /r/early.zarr (10 records): 1 finding(s) it shows as strongly are "
                                 "context, below 0.5")
    assert "Baseline" not in dict(header_items(target, None))


@pytest.mark.slow
def test_real_runs_eos_against_its_healthy_twin_and_against_itself(tmp_path) -> None:
    """Real digits-MLP runs (``real_runs``): GD past the edge of stability keeps its oscillation against
    the eta-0.1 twin of the same model (new there), and it is context against another EoS run."""
    pytest.importorskip("torch")
    from gradforensics.testing import real_runs

    eos = real_runs.train("mlp-eos", tmp_path / "eos.zarr", seed=0)
    twin = real_runs.train("mlp-gd", tmp_path / "gd.zarr", seed=0)
    other = real_runs.train("mlp-eos", tmp_path / "eos-1.zarr", seed=1)
    opts = {"engine": {"persist": False}}
    only = "oscillation"            # the finding of these runs (test_real_runs: every analysis, no other flag)
    alone = gf.analyze(eos, progress=False, options=opts, only=only)
    loud = [x for x in alone.flags if x.severity >= 0.5]
    assert loud and loud[0].kind == "oscillation"
    against_twin = gf.analyze(eos, progress=False, options=opts, only=only, baseline=twin)
    assert [(x.kind, x.tensor, x.severity) for x in against_twin.flags if x.severity >= 0.5] == \
        [(x.kind, x.tensor, x.severity) for x in loud]
    against_sick = gf.analyze(eos, progress=False, options=opts, only=only, baseline=other)
    assert not [x for x in against_sick.flags if x.severity >= 0.5]
    assert any("as in the baseline eos-1.zarr" in x.summary for x in against_sick.flags)
    assert against_sick.header["baseline"]["context"] == len(loud)
