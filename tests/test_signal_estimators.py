"""The loss-curve analyses' signal estimators against their oracles, at stated tolerances.

``scipy.signal`` (Hann window, Welch, csd, coherence, Savitzky–Golay, ``find_peaks``),
``scipy.optimize.brentq``, ``np.linalg.lstsq``, closed forms and planted truths.  The
float64 FFT estimators agree with SciPy to ``rtol=1e-10`` (both are a few FFTs and sums:
their rounding is ~1e-15 of the data's scale); the root finder to its ``xtol``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import scipy.signal as ss
from scipy.optimize import brentq

from gradforensics.analysis.toolkit.signal.background import GainGrid, ar1_fits, bracketed_roots, fit_ar1, lag1
from gradforensics.analysis.toolkit.signal.detrending import detrend, detrend_many, savgol_coeffs, savgol_smooth
from gradforensics.analysis.toolkit.signal.peaks import local_maxima
from gradforensics.analysis.toolkit.signal.spectrum import SpectrumOptions, chi2_isf, chi2_sf, line_spectra
from gradforensics.analysis.toolkit.signal.trend import log_time_bases, log_time_fit, median
from gradforensics.analysis.toolkit.signal.welch import coherence, csd, hann, welch


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Equal to *rtol* of the oracle's scale (an absolute floor where values pass through zero)."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want), initial=0.0)))


def test_hann_is_scipys_periodic_hann() -> None:
    for n in [1, 2, 3, 16, 17, 64, 1000, 16384]:
        _close(hann(n), ss.get_window("hann", n), 1e-12)


@pytest.mark.parametrize("n,nper", [(16, 16), (33, 17), (64, 16), (257, 64), (600, 128), (601, 33)])
def test_welch_csd_coherence_are_scipys(n: int, nper: int) -> None:
    rng = np.random.default_rng(n + nper)
    kw = {"fs": 1.0, "window": "hann", "nperseg": nper, "noverlap": nper // 2, "detrend": False}
    for scale in (1e-9, 1.0, 1e9):
        X = (rng.normal(size=(5, n)) + np.cumsum(rng.normal(size=(5, n)), axis=1)) * scale
        Y = X * 0.5 + rng.normal(size=(5, n)) * scale + np.sin(2 * np.pi * np.arange(n) / 9.0) * scale
        f, P = welch(X, nper)                                    # a stack: every row at once
        f1, P1 = ss.welch(X, **kw)
        _close(f, f1, 1e-12)
        _close(P, P1, 1e-10)
        _close(welch(X[0], nper)[1], P1[0], 1e-10)               # one series
        _close(csd(X, Y, nper)[1], ss.csd(X, Y, **kw)[1], 1e-10)
        _, C, Pxy = coherence(X[1], Y[1], nper)
        _close(C, ss.coherence(X[1], Y[1], **kw)[1], 1e-10)
        _close(Pxy, ss.csd(X[1], Y[1], **kw)[1], 1e-10)


def test_savgol_coefficients_are_the_closed_form_and_scipys() -> None:
    for w in [5, 7, 31, 33, 257, 1025, 2049]:
        m = w // 2
        j = np.arange(-m, m + 1, dtype=float)
        exact = (3 * (3 * m * m + 3 * m - 1) - 15 * j * j) / ((2 * m - 1) * (2 * m + 1) * (2 * m + 3))
        _close(savgol_coeffs(w), exact, 1e-12)                    # Savitzky & Golay's cubic smoothing weights
        _close(savgol_coeffs(w), ss.savgol_coeffs(w, 3), 1e-9)    # SciPy's unscaled lstsq: ~1e-11 off at w = 2049


@pytest.mark.parametrize("n,w", [(5, 5), (32, 31), (64, 33), (300, 65), (1000, 999), (9000, 2049)])
def test_savgol_smooth_is_scipys_filter(n: int, w: int) -> None:
    rng = np.random.default_rng(n)
    Z = np.cumsum(rng.normal(size=(4, n)), axis=1) * 1e3
    Z[0] = np.linspace(0.0, 1.0, n) ** 3                         # a cubic: its own smooth
    want = np.stack([ss.savgol_filter(z, w, 3, mode="interp") for z in Z])
    got = savgol_smooth(Z, w)
    for g, e in zip(got, want):
        _close(g, e, 1e-9)
    _close(got[0], Z[0], 1e-9)


def test_local_maxima_are_find_peaks() -> None:
    rng = np.random.default_rng(17)
    for n in (0, 1, 2, 3, 5, 19, 40, 300):
        for x in (rng.normal(size=n), np.round(rng.normal(size=n)), np.zeros(n), rng.integers(0, 3, n) * 1.0,
                  np.r_[[-1.0], np.where(rng.random(n) < 0.5, 0.0, rng.random(n)), [-1.0]]):
            np.testing.assert_array_equal(local_maxima(x), ss.find_peaks(x)[0])


@pytest.mark.parametrize("xtol", [1e-6, 1e-10, 1e-2])
def test_bracketed_roots_are_brentqs_within_xtol(xtol: float) -> None:
    rng = np.random.default_rng(int(-np.log10(xtol)))
    r0 = rng.uniform(-1.9, 2.9, 300)                                  # one planted root each, in [-2, 3]
    c = rng.lognormal(0, 2, (300, 3)) * rng.choice([-1.0, 1.0], (300, 1))

    def f(x: np.ndarray, k: np.ndarray) -> np.ndarray:               # monotone: c0 (x − r) + c1 (x − r)³ + c2 sinh
        d = x - r0[k]
        return c[k, 0] * d + c[k, 1] * d ** 3 + c[k, 2] * np.sinh(d)

    every = np.arange(r0.size)
    root, ok = bracketed_roots(f, -2.0, 3.0, f(np.full(r0.size, -2.0), every), f(np.full(r0.size, 3.0), every), xtol)
    assert ok.all()
    np.testing.assert_allclose(root, r0, rtol=0, atol=2 * xtol)      # the stated bound: within 2·xtol
    want = [brentq(lambda x, k=k: float(f(np.array([x]), np.array([k]))[0]), -2.0, 3.0, xtol=xtol) for k in every]
    np.testing.assert_allclose(root, want, rtol=0, atol=3 * xtol)
    root, ok = bracketed_roots(lambda x, k: np.where(k == 1, np.nan, x - 0.3), 0.0, 1.0, np.array([-0.3, -0.3]),
                               np.array([0.7, 0.7]), 1e-9)
    assert ok.tolist() == [True, False] and abs(root[0] - 0.3) < 2e-9


def test_ar1_fit_matches_its_model_and_the_analytic_cases() -> None:
    rng = np.random.default_rng(3)
    m = 1 << 12
    f = np.arange(m // 2 + 1) / m
    R = np.cumsum(rng.normal(size=(40, 200)), axis=1) * rng.random((40, 1)) + rng.normal(size=(40, 200))
    _close(lag1(R), [((r - r.mean())[1:] @ (r - r.mean())[:-1]) / ((r - r.mean()) @ (r - r.mean())) for r in R], 1e-12)
    flat = GainGrid(np.ones(f.size))                              # no filter: ρ_model(α) = α
    grid = GainGrid(2 - 2 * np.cos(2 * np.pi * f) * rng.uniform(0.2, 1.0))
    a = np.linspace(-0.95, 0.995, 50)
    full = grid.acov_rows(a)
    _close(grid.lag1_rows(a), full[:, 1] / full[:, 0], 1e-12)     # two sums = the inverse FFT's first lags
    alpha, sigma2, acov, ok = ar1_fits(R, flat, 3)
    assert ok.all() and np.all(np.abs(alpha - np.clip(lag1(R), -0.95, 0.995)) < 2e-6)
    _close(acov, acov[:, :1] * alpha[:, None] ** np.arange(3), 1e-6)          # γ(τ) = γ(0) α^τ
    _close(sigma2, R.var(axis=1) * (1 - alpha ** 2), 1e-6)                      # γ(0) = 1 / (1 − α²)
    diff = GainGrid(2 - 2 * np.cos(2 * np.pi * f))                # a first difference: ρ = −(1 − α)/2
    a1, _, _, ok = ar1_fits(R[:, 1:] - R[:, :-1], diff, 2)
    inside = (lag1(R[:, 1:] - R[:, :-1]) > -0.975) & (lag1(R[:, 1:] - R[:, :-1]) < -0.0025)
    assert ok.all() and np.all(np.abs(a1 - (1 + 2 * lag1(R[:, 1:] - R[:, :-1])))[inside] < 1e-5)
    assert fit_ar1(R[0], flat)[0] == pytest.approx(float(alpha[0]), abs=1e-12)
    with pytest.raises(ValueError):
        fit_ar1(np.r_[R[0, :-1], np.nan], flat)


def test_chi2_tails_are_scipy_stats() -> None:
    from scipy.stats import chi2

    rng = np.random.default_rng(6)
    dof = rng.uniform(0.5, 60, 500)
    x = np.concatenate([[0.0, 1e-300], rng.exponential(5, 498)])
    _close(chi2_sf(x, dof), chi2.sf(x, dof), 1e-12)                # the same special functions: rounding only
    for level in (0.01, 0.01 / 37, 1e-9):
        _close(chi2_isf(level, dof), chi2.isf(level, dof), 1e-12)


def test_log_time_fit_is_lstsq_and_median_is_numpys() -> None:
    rng = np.random.default_rng(5)
    for n in (32, 47, 512):
        Y = np.exp(-np.arange(n) / (n / 5))[None, :] * rng.lognormal(0, 2, (6, 1)) + rng.normal(size=(6, n)) * 0.01
        got = log_time_fit(Y)
        for y, g in zip(Y, got):
            fits = [b @ np.linalg.lstsq(b, y, rcond=None)[0] for b, _ in log_time_bases(n, 3)]
            best = min(fits, key=lambda fit: float(((y - fit) ** 2).sum()))
            _close(g, best, 1e-9)
            _close(log_time_fit(y), best, 1e-9)
    for n in (1, 2, 7, 64):
        a = np.round(rng.normal(size=n), 1)
        assert median(a) == float(np.median(a))


def test_detrend_of_a_stack_is_detrend_of_each_series() -> None:
    rng = np.random.default_rng(6)
    ys = [np.exp(-np.arange(n) / 30.0) + rng.normal(size=n) * 0.05 for n in (64, 40, 64, 40, 64)]
    for method in ("savgol", "diff"):
        for y, d in zip(ys, detrend_many(ys, method)):
            one = detrend(y, method)
            _close(d.residual, one.residual, 1e-12)
            _close(d.residual + d.trend, y[d.offset:], 1e-12)


def test_planted_periods_are_found_in_a_stack_of_red_noise_series() -> None:
    rng = np.random.default_rng(7)
    n, periods = 1024, (5.0, 8.0, 13.0, 21.0)
    ys = []
    for i in range(12):
        e = np.zeros(n + 200)
        for t in range(1, e.size):                                # AR(1), α = 0.6
            e[t] = 0.6 * e[t - 1] + rng.normal()
        y = 3.0 * np.exp(-np.arange(n) / 200) + 0.05 * e[200:]
        if i < len(periods):
            y += 0.05 * np.sin(2 * np.pi * np.arange(n) / periods[i])
        ys.append(y)
    res = line_spectra(ys, SpectrumOptions())
    for i, r in enumerate(res):
        if i < len(periods):
            assert r.significant and abs(1 / r.significant[0].frequency - periods[i]) < 0.05 * periods[i]
        else:
            assert not r.significant
        assert abs(r.ar1 - 0.6) < 0.2


def test_the_analyze_path_does_not_import_scipy_signal() -> None:
    code = ("import sys, numpy as np\n"
            "from gradforensics.analysis.kinds import coherence, fractal\n"
            "from gradforensics.analysis.toolkit.signal.spectrum import line_spectra\n"
            "rng = np.random.default_rng(0)\n"
            "ys = [np.cumsum(rng.normal(size=3000)) + np.sin(np.arange(3000)) for _ in range(3)]\n"
            "line_spectra(ys); coherence.pair_coherence(ys[0], ys[1]); fractal.higuchi(ys[0])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('scipy.signal', 'scipy.optimize', 'scipy.stats'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
