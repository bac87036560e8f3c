"""The alpha finding judged against the fit's own uncertainty and against the run itself.

Oracles: the spread of the maximum-likelihood exponent over planted Pareto samples (its standard error,
Clauset et al. 2009 eq. 3.2), matrices built with a known power-law ESD (``W = U diag(s) Vᵀ``, ``s²``
Pareto-distributed), and planted stores whose alpha falls over the snapshots in one layer or in all.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds.spectral import findings, spectra
from gradforensics.testing.planted_units import powerlaw_matrix, run_analysis


def _alpha_flags(path, options: dict[str, float] | None = None) -> dict[str, object]:
    _, flags = run_analysis(path, "spectral", options)
    return {f.tensor: f for f in flags if f.evidence["reason"] == "alpha"}


def _quantile_matrix(rows: int, cols: int, alpha: float, seed: int) -> np.ndarray:
    """A matrix whose ``WᵀW`` eigenvalues are the quantiles of ``p(λ) ∝ λ^-alpha`` on ``[1, ∞)`` (no sampling noise)."""
    rng = np.random.default_rng(seed)
    r = min(rows, cols)
    lam = (1.0 - (np.arange(r) + 0.5) / r) ** (-1.0 / (alpha - 1.0))
    u, _ = np.linalg.qr(rng.normal(size=(rows, r)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, r)))
    return (u * np.sqrt(lam)) @ v.T


@pytest.mark.parametrize(("alpha", "n"), [(1.5, 50), (3.0, 30)])
def test_alpha_se_is_the_spread_of_the_mle(alpha: float, n: int) -> None:
    """The MLE over n Pareto draws (xmin known) scatters by (alpha - 1) / sqrt(n): within 15 % over 2000 samples."""
    rng = np.random.default_rng(0)
    x = (1.0 - rng.random((2000, n))) ** (-1.0 / (alpha - 1.0))
    mle = 1.0 + n / np.log(x).sum(axis=1)
    assert np.std(mle) == pytest.approx(findings.alpha_se(alpha, n), rel=0.15)
    assert np.isnan(findings.alpha_se(np.nan, 10)) and np.isnan(findings.alpha_se(2.0, 0))


def test_alpha_context_rule() -> None:
    assert findings.alpha_context(1.8, 12, [], 2.0)[0] == "fit"            # se 0.23: 0.2 below is < 2 se
    assert findings.alpha_context(1.5, 9, [], 2.0)[0] == "fit"             # tail too short
    assert findings.alpha_context(1.5, 100, [], 2.0) is None               # no peers: the fit is all there is
    assert findings.alpha_context(1.5, 100, [3.0, 3.5, 2.8], 2.0) is None  # the rest of the model in range
    assert findings.alpha_context(1.5, 100, [1.6, 1.7, 1.55], 2.0)[0] == "run"
    assert findings.alpha_context(1.2, 200, [1.8, 1.85, 1.9, 1.8], 2.0) is None   # a robust outlier below them


def test_planted_power_law_is_fitted_and_flagged(tmp_path) -> None:
    """A 600x400 matrix with a Pareto(1.5) ESD among layers at 3.5: alpha within 0.15, a finding >= 0.5."""
    rng = np.random.default_rng(3)
    w = {"heavy.weight": powerlaw_matrix(600, 400, 1.5, rng),
         **{f"ok{i}.weight": powerlaw_matrix(600, 400, 3.5, rng) for i in range(3)}}
    fit = spectra.powerlaw_fit(np.linalg.svd(w["heavy.weight"], compute_uv=False) ** 2)
    assert fit.alpha == pytest.approx(1.5, abs=0.15)
    with gf.Recorder(tmp_path / "a.zarr", sources=["x"], background=False) as rec:
        rec.record(step=0, source="x", weights=w)
    flags = _alpha_flags(tmp_path / "a.zarr")
    f = flags["heavy.weight"]
    assert f.severity >= 0.5 and "context" not in f.evidence
    assert f.evidence["alpha_se"] == pytest.approx((f.evidence["alpha"] - 1) / np.sqrt(f.evidence["alpha_n_tail"]))
    assert all(g.severity < 0.5 for t, g in flags.items() if t != "heavy.weight")


def test_small_matrix_below_two_by_noise_is_context(tmp_path) -> None:
    """64 eigenvalues drawn from a Pareto of exponent 2.2: a fit below 2 is noise, context, and says so."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = powerlaw_matrix(128, 64, 2.2, rng)
        fit = spectra.powerlaw_fit(np.linalg.svd(w, compute_uv=False) ** 2)
        if findings.alpha_severity(fit.alpha) >= 0.1 and fit.n_tail >= findings.MIN_TAIL:   # the first with a flag
            break
    else:
        pytest.fail("no draw fitted below 1.93")
    with gf.Recorder(tmp_path / "s.zarr", sources=["x"], background=False) as rec:
        rec.record(step=0, source="x", weights={"small.weight": w})
    f = _alpha_flags(tmp_path / "s.zarr", {"min_severity": 0.0})["small.weight"]      # a context flag is shown
    assert f.severity < 0.5 and f.evidence["context"] == "fit" and "standard error" in f.summary


def test_noise_rarely_makes_a_finding() -> None:
    """Of 400 draws of 64 eigenvalues from exponent 2.2, about 1 in 9 fits below 2; under 2 % of all are findings."""
    below = finding = 0
    for s in range(400):
        ev = (1.0 - np.random.default_rng(s).random(64)) ** (-1.0 / 1.2)
        fit = spectra.powerlaw_fit(ev)
        below += fit.alpha < 2
        finding += fit.alpha < 2 and findings.alpha_context(fit.alpha, fit.n_tail, [], 2.0) is None
    assert below >= 20 and finding <= 8


@pytest.mark.parametrize("together", [False, True])
def test_a_planted_fall_over_the_snapshots(tmp_path, together: bool) -> None:
    """One layer's alpha falls 3.5 -> 1.5 over four snapshots while three stay at 3.5: a finding on it alone.
    All four falling together: the run's regime, context ("run") on every one."""
    path = tmp_path / "f.zarr"
    path_alphas = [3.5, 2.8, 2.0, 1.5]
    with gf.Recorder(path, sources=["x"], background=False) as rec:
        for step, a in enumerate(path_alphas):
            w = {f"l{i}.weight": _quantile_matrix(400, 200, a if (i == 0 or together) else 3.5, seed=i)
                 for i in range(4)}
            rec.record(step=step, source="x", weights=w)
    flags = _alpha_flags(path)
    fit = spectra.powerlaw_fit(np.linalg.svd(_quantile_matrix(400, 200, 1.5, 0), compute_uv=False) ** 2)
    assert fit.alpha == pytest.approx(1.5, abs=0.1)
    if together:
        assert len(flags) == 4 and all(f.severity < 0.5 and f.evidence["context"] == "run" for f in flags.values())
        assert all("rest of the model" in f.summary for f in flags.values())
    else:
        assert list(flags) == ["l0.weight"] and flags["l0.weight"].severity >= 0.5
        assert "context" not in flags["l0.weight"].evidence
