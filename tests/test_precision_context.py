"""Precision severities as this run can suffer them: a what-if format and lost fp32 updates stay context.

Issue 40 saw precision 0.94 on the conv biases of an fp32 CNN whose own summary said "context, not a
problem of this run".  A severity never contradicts its summary: a format the run does not keep its
weights in stays below 0.5, and weighs nothing when the whole run moved the tensor by less than that
format's half ULP (a bias before a BatchNorm: its gradient is rounding noise); an fp32 update too small
to change its weight (below 2^-24 of it) is not a finding.  The oracle is ml_dtypes' rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.kinds import precision as P
from gradforensics.analysis.kinds.precision import formats as F
from gradforensics.testing.planted_units import run_analysis

ml_dtypes = pytest.importorskip("ml_dtypes")
CAST = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def test_run_counts_match_ml_dtypes_rounding_of_the_whole_runs_update() -> None:
    """``run_swamped_f``: elements whose net change first -> last is zero or rounds back to ``cast(w0)``."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(0, 0.1, 50_000).astype(np.float32)
    rel = np.where(rng.random(w0.size) < 0.5, 1e-5, 1e-1) * rng.normal(size=w0.size)
    w1 = (w0 * (1 + rel)).astype(np.float32)
    w1[:1000] = w0[:1000]                                              # never moved
    got = F.run_counts(w0, w1)
    x0, d = w0.astype(np.float64), w1.astype(np.float64) - w0.astype(np.float64)
    assert got["n"] == w0.size
    for fmt, dtype in CAST.items():
        wf = x0.astype(dtype).astype(np.float64)
        want = np.count_nonzero((d == 0) | ((wf + d).astype(dtype).astype(np.float64) == wf))
        assert abs(got[f"run_swamped_{fmt}"] - want) <= 1e-4 * w0.size      # float32 ties may round either way
    assert 0.45 < got["run_swamped_bf16"] / w0.size < 0.55


def _row(**kw: float) -> dict[str, float]:
    row = {"swamped_bf16": 0.0, "swamped_fp16": 0.0, "lost_share": 0.0, "snapshot_gap": 1.0,
           "grad_underflow_fp16": 0.0, "grad_underflow_fp16_energy": 0.0, "run_swamped_bf16": 0.0,
           "run_swamped_fp16": 0.0}
    return row | kw


@pytest.mark.parametrize(("row", "fmt", "own", "want"), [
    (_row(swamped_bf16=1.0), "bf16", "bf16", 1.0),                              # its own format: in full
    (_row(swamped_bf16=1.0), "bf16", None, 1.0),                                # no dtypes: assumed bf16
    (_row(swamped_bf16=1.0), "bf16", "fp32", P.WHATIF_WEIGHT),                  # what-if: context
    (_row(swamped_bf16=1.0, run_swamped_bf16=1.0), "bf16", "fp32", 0.0),        # the run never moved it
    (_row(swamped_bf16=1.0, run_swamped_bf16=0.6), "bf16", "fp32", 0.4 * P.WHATIF_WEIGHT),
    (_row(lost_share=0.94), "bf16", "fp32", 0.0),                               # fp32: below 2^-24 of w
    (_row(lost_share=0.94), "bf16", "bf16", 0.94),                              # bf16 weights: updates lost
    (_row(lost_share=0.94), "bf16", None, 0.94),
    (_row(grad_underflow_fp16=0.8, grad_underflow_fp16_energy=1.0), "fp16", "fp32", 0.8 * P.WHATIF_WEIGHT),
])
def test_severity_is_what_this_run_can_suffer(row, fmt, own, want) -> None:
    sev, parts = P.severity(row, fmt, own)
    assert sev == pytest.approx(want, abs=1e-12)
    assert set(parts) == {"swamped", "lost", "underflow"}


def _fp32_run(path, parameters: str) -> None:
    """SGD on two tensors recorded with weights every step: a weight that learns (1 % steps) and a bias whose
    gradient is rounding noise (steps of 3e-8 of it: below half an fp32 ULP for most elements, lost)."""
    import gradforensics as gf

    rng = np.random.default_rng(1)
    w = {"conv.weight": rng.normal(0, 0.1, (16, 9)).astype(np.float32),
         "conv.bias": rng.uniform(0.05, 0.3, (1, 16)).astype(np.float32)}
    rel = {"conv.weight": 1e-2, "conv.bias": 3e-8}
    if parameters == "bfloat16":
        w = {n: v.astype(ml_dtypes.bfloat16).astype(np.float32) for n, v in w.items()}
    with gf.Recorder(path, sources=("a",), mode="training", background=False, dtypes={"parameters": parameters}) as rec:
        for i in range(12):
            g = {n: rng.normal(0, 1, v.shape).astype(np.float32) for n, v in w.items()}
            rec.record(step=i, loss=1.0, source="a", grads=g, weights={n: v.copy() for n, v in w.items()}, lr=1.0)
            for n in w:
                new = w[n].astype(np.float64) - rel[n] * np.abs(w[n]) * g[n]
                w[n] = (new.astype(ml_dtypes.bfloat16) if parameters == "bfloat16" else new).astype(np.float32)


def test_an_fp32_bias_with_rounding_noise_updates_is_no_finding(tmp_path) -> None:
    _fp32_run(tmp_path / "f.zarr", "float32")
    result, flags = run_analysis(tmp_path / "f.zarr", "precision")
    t = result.table.set_index("tensor")
    assert t.loc["conv.bias", "lost_share"] > 0.5 and t.loc["conv.bias", "swamped_bf16"] == 1.0
    assert t.loc["conv.bias", "run_swamped_bf16"] == 1.0 and t.loc["conv.weight", "run_swamped_bf16"] < 0.2
    assert not [f for f in flags if f.tensor == "conv.bias"]
    assert all(f.severity < 0.5 and "what-if" in f.summary for f in flags)


def test_the_same_run_in_bf16_weights_loses_the_bias_updates(tmp_path) -> None:
    _fp32_run(tmp_path / "b.zarr", "bfloat16")
    _, flags = run_analysis(tmp_path / "b.zarr", "precision")
    loud = {f.tensor for f in flags if f.severity >= 0.5}
    assert loud == {"conv.bias"}
    assert "did not change at all" in next(f for f in flags if f.tensor == "conv.bias").summary


def test_lost_updates_of_bf16_weights_checked_for_fp16_are_this_runs_problem(tmp_path) -> None:
    """The what-if format (fp16) is context; the bf16 snapshots' own lost updates are not, and say so."""
    _fp32_run(tmp_path / "b.zarr", "bfloat16")
    _, flags = run_analysis(tmp_path / "b.zarr", "precision", options={"format": "fp16"})
    f = next(f for f in flags if f.tensor == "conv.bias")
    assert f.severity >= 0.5 and "what-if" not in f.summary and "bf16 weights themselves lost" in f.summary
    assert all(g.severity < 0.5 for g in flags if g.tensor != "conv.bias")
