"""Adding an analysis touches one module: the claim of docs/analysis-engine.md, proved.

Everything about the toy analysis ``record_norm`` is defined in this module - its
maths, options, needs, flag kind (``toy_norm``) with its advice, and plot - and it
is added with :func:`gradforensics.analysis.register`, no other file edited.  Once
registered it runs in ``gf.analyze`` (``only=``, ``options=``), writes
``tables/record_norm.csv``, its flags are valid ``flags.json`` (the schema's
``kind`` enum comes from the registry) and ``gradforensics analyze`` reports it:
section title, summary sentence, remedies, evidence figure, overview row.
After the test it is unregistered and its kind is no longer valid.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest

import gradforensics as gf
from gradforensics.analysis import REGISTRY, register, registered, unregister
from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.cli import main
from gradforensics.errors import PlotBugWarning, SpecError, UnsafeNameError
from gradforensics.reporting import flagsjson

# ====================================================================== the toy analysis
NAME, KIND = "record_norm", "toy_norm"


@dataclass(frozen=True)
class RecordNormOptions(Options):
    """``jump``: how many times the median record norm a record must reach to be flagged."""

    jump: float = 10.0

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"jump": Interval(float, 1, None, "neither")}


def norm_row(g: GramResult) -> tuple[dict[str, Any], np.ndarray]:
    """Per-record gradient norms ``sqrt(K_ii)`` of one tensor, and how far the largest jumps."""
    norms = np.sqrt(np.clip(np.diag(g.gram), 0.0, None))
    norms[~g.finite] = np.nan
    median = float(np.nanmedian(norms))
    i = int(np.nanargmax(norms))
    return ({"tensor": g.tensor, "head": g.head, "median_norm": median, "max_norm": float(norms[i]),
             "jump": float(norms[i] / median) if median > 0 else math.inf, "record": i}, norms)


def compute(ctx: Context) -> AnalysisResult:
    rows, series = [], {}
    for (tensor, head), g in sorted(ctx.grams.items(), key=lambda kv: kv[0][0]):
        if head is None and g.finite.any():
            row, norms = norm_row(g)
            rows.append(row)
            series[f"norm/{tensor}"] = norms
    table = pd.DataFrame(rows, columns=["tensor", "head", "median_norm", "max_norm", "jump", "record"])
    table["head"] = table["head"].astype("Int64")
    return AnalysisResult(table=table, series=series)


def severity(jump: float, threshold: float) -> float:
    """0.55 just past the threshold, 1 at a thousand times it."""
    return float(np.clip(0.55 + 0.15 * math.log10(jump / threshold), 0.0, 1.0))


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    opt = ctx.options_for(NAME, RecordNormOptions)
    return [Flag(kind=KIND, tensor=r.tensor, head=None, sources=(), severity=severity(r.jump, opt.jump),
                 records=(int(r.record), int(r.record)),
                 evidence={"jump": r.jump, "max_norm": r.max_norm, "median_norm": r.median_norm},
                 summary=f"{r.tensor}: record {r.record}'s gradient norm is {r.jump:.0f}x the median.")
            for r in result.table.itertuples(index=False) if r.jump > opt.jump]


def plot(result: AnalysisResult, flag: Flag, ax: Any) -> None:
    norms = result.series[f"norm/{flag.tensor}"]
    ax.plot(np.arange(norms.size), norms, "o-", ms=3)
    ax.axvline(flag.records[0], color="C3", ls="--")
    ax.set_xlabel("record")
    ax.set_ylabel("gradient norm")


ADVICE = Advice(
    title="Gradient-norm jump",
    phrase="the gradient norm of one record jumps far above the rest",
    evidence_keys={"jump": "jump", "max_norm": "largest norm"},
    remedies=("Look at the batch of that record: a corrupt or out-of-distribution sample is the usual cause.",
              "Clip the gradient norm so one batch cannot move the weights that far."),
    references=("Pascanu et al. 2013, On the difficulty of training recurrent neural networks",),
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={KIND: ADVICE}, options=RecordNormOptions)


# ====================================================================== its store and its registration
SPIKED, STEADY, SPIKE = "layers.0.mlp.up.weight", "layers.1.mlp.up.weight", 17


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """24 records of two tensors; record 17 of one of them 50x larger than the rest."""
    path = tmp_path_factory.mktemp("toy") / "dump.zarr"
    rng = np.random.default_rng(0)
    with gf.Recorder(path, sources=["a", "b"], background=False) as rec:
        for i in range(24):
            grads = {t: rng.standard_normal((16, 8)).astype(np.float32) for t in (SPIKED, STEADY)}
            grads[SPIKED] *= 50.0 if i == SPIKE else 1.0
            rec.record(step=i, loss=2.0 - 0.01 * i, source="ab"[i % 2], grads=grads)
    return str(path)


@pytest.fixture
def toy():
    """The toy analysis, registered for one test only."""
    with registered(ANALYSIS) as a:
        yield a
    assert NAME not in REGISTRY and KIND not in flagsjson.flag_schema()["properties"]["kind"]["enum"]


# ====================================================================== the claim
def test_registered_analysis_runs_in_analyze(toy, store) -> None:
    f = gf.analyze(store, only=["noise", NAME], options={NAME: {"jump": 10}, "engine": {"persist": False}},
                   progress=False)
    table = f.table(NAME)
    assert list(table.columns[:2]) == ["tensor", "head"] and set(table.tensor) == {SPIKED, STEADY}
    flagged = [x for x in f.flags if x.kind == KIND]
    assert [(x.tensor, x.records) for x in flagged] == [(SPIKED, (SPIKE, SPIKE))]
    assert flagged[0].severity > 0.5
    assert {x.kind for x in f.flags} <= {"noise", KIND}


def test_its_options_are_parsed_once_by_its_class(toy, store) -> None:
    with pytest.raises(SpecError, match=r"record_norm: bad options .* unknown key\(s\) \['jmp'\]; record_norm options must be among \['jump'\]"):
        gf.analyze(store, only=NAME, options={NAME: {"jmp": 3}}, progress=False)
    with pytest.raises(SpecError, match=r"'jump' option of record_norm must be a number > 1; got 0\.5"):
        gf.analyze(store, only=NAME, options={NAME: {"jump": 0.5}}, progress=False)
    quiet = gf.analyze(store, only=NAME, options={NAME: {"jump": 1e6}, "engine": {"persist": False}}, progress=False)
    assert quiet.flags == []


@pytest.mark.slow
def test_gradforensics_analyze_reports_it(toy, store, tmp_path) -> None:
    out = tmp_path / "report"
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlotBugWarning)
        assert main(["analyze", store, "--out", str(out), "--only", f"noise,{NAME}", "--quiet"]) == 0
    csv = pd.read_csv(out / "tables" / f"{NAME}.csv", keep_default_na=False)
    assert list(csv.columns[:2]) == ["tensor", "head"] and set(csv.tensor) == {SPIKED, STEADY}
    doc = json.loads((out / "flags.json").read_text())
    flagsjson.validate(doc)
    assert [x["tensor"] for x in doc["flags"] if x["kind"] == KIND] == [SPIKED]
    jsonschema = pytest.importorskip("jsonschema")
    assert not list(jsonschema.Draft202012Validator(flagsjson.FLAGS_SCHEMA).iter_errors(doc))
    html, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    for text in (ADVICE.title, ADVICE.phrase, ADVICE.remedies[0], ADVICE.references[0], "jump"):
        assert text in html and text in md, text
    assert 'class="note"' not in html                                  # its plot drew the evidence
    figures = sorted(p.name for p in (out / "figures").glob("finding-*.png"))
    assert figures and f"| {NAME} |" in md                            # a figure, and its column in the layer table


def test_a_kind_is_valid_only_while_its_analysis_is_registered(store, tmp_path) -> None:
    with registered(ANALYSIS):
        doc = gf.analyze(store, only=NAME, options={"engine": {"persist": False}}, progress=False).flags_json()
        assert flagsjson.errors(doc) == []
    assert any("flags.json.flags[0].kind" in e for e in flagsjson.errors(doc))
    with pytest.raises(SpecError, match="only= must name analyses among"):
        gf.analyze(store, only=NAME, progress=False)


# ====================================================================== what register() and Analysis refuse
def test_register_checks_the_analysis() -> None:
    with pytest.raises(SpecError, match="takes an Analysis"):
        register(object())                                             # type: ignore[arg-type]
    with pytest.raises(SpecError, match="'drift' is already registered"):
        register(Analysis("drift", (), compute, flags, plot))
    with pytest.raises(SpecError, match=r"flag kind\(s\) \['noise'\] already emitted by \['noise'\]"):
        register(Analysis("noisier", (), compute, flags, plot, kinds={"noise": ADVICE}))
    with pytest.raises(SpecError, match="no analysis named 'record_norm'"):
        unregister(NAME)
    assert register(REGISTRY["drift"]) is REGISTRY["drift"]            # the same object again: nothing to do
    assert NAME not in REGISTRY


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": "Record-Norm"}, "not a lower-case identifier"),
    ({"needs": ("gram", "batches")}, r"'needs' of Analysis 'record_norm' must be among \['gram', 'grads', 'acts'"),
    ({"kinds": {"Toy Norm": ADVICE}}, "'kinds' of Analysis 'record_norm' must map lower-case identifiers"),
    ({"kinds": {KIND: "clip gradients"}}, "must map lower-case identifiers to Advice"),
    ({"options": dict}, "'options' of Analysis 'record_norm' must be a dataclass subclassing Options"),
    ({"plot": None}, "'plot' of Analysis 'record_norm' must be callable"),
    ({"lazy": lambda store: {}}, "a 'lazy' hook goes with needs 'acts' or 'weights' and only then"),
    ({"needs": (Need.GRADS,)}, "a 'slab_reductions' hook goes with needs 'grads' and only then"),
])
def test_analysis_is_checked_when_constructed(kwargs: dict[str, Any], match: str) -> None:
    fields = {"name": NAME, "needs": (Need.GRAM,), "compute": compute, "flags": flags, "plot": plot,
              "kinds": {KIND: ADVICE}, "options": RecordNormOptions, **kwargs}
    with pytest.raises((SpecError, UnsafeNameError), match=match):
        Analysis(**fields)


def test_needs_are_checked_strings_or_enum() -> None:
    a = Analysis(NAME, ("gram", Need.GRAM), compute, flags, plot)
    assert a.needs == (Need.GRAM,) and a.kinds == {} and a.options().__class__.__name__ == "NoOptions"


def test_flag_of_an_undeclared_kind_is_a_bug_the_engine_names(store) -> None:
    rogue = Analysis("rogue", (Need.GRAM,), compute, flags, plot, options=RecordNormOptions)   # emits toy_norm
    with registered(rogue), pytest.raises(ValueError, match="'rogue' returned a flag of kind 'toy_norm'"):
        gf.analyze(store, only="rogue", options={"engine": {"persist": False}}, progress=False)
