"""Issue 28: the loss-curve analyses' stacked path gives every series the single calls' floats.

``loss_spectrum`` and ``fractal`` run the per-series library calls (SciPy's Savitzky–Golay
filter, Welch, ``brentq`` of the AR(1) fit) over stacks of same-length series
(:mod:`~gradforensics.analysis.toolkit.signal.rows`,
:func:`~gradforensics.analysis.toolkit.signal.spectra.line_spectra`).  Each step is held here
against the library's own per-series call with ``==`` (NaN equal to NaN), never a tolerance,
on random inputs of many lengths and scales and on the edge cases (constant rows, a window
as long as the series, NaN, roots at the bracket's ends, searches that do not converge);
then the whole analyses against their per-series code.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.signal import get_window, savgol_filter, welch

from gradforensics.analysis.contract.series import SeriesGroup
from gradforensics.analysis.kinds import fractal as fr
from gradforensics.analysis.kinds import loss_spectrum as ls
from gradforensics.analysis.toolkit.series import regularize
from gradforensics.analysis.toolkit.signal import background as bg
from gradforensics.analysis.toolkit.signal import detrending as dt
from gradforensics.analysis.toolkit.signal import rows
from gradforensics.analysis.toolkit.signal.spectra import line_spectra
from gradforensics.analysis.toolkit.signal.spectrum import SpectrumOptions, line_spectrum
from gradforensics.errors import SpecError


def _same(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def _stack(rng: np.random.Generator, u: int, n: int, scale: float) -> np.ndarray:
    Z = (rng.normal(size=(u, n)) + np.cumsum(rng.normal(size=(u, n)), axis=1) * rng.random((u, 1))) * scale
    Z[0] = 2.5 * scale                                   # a constant row
    Z[1] = np.linspace(0.0, 1.0, n) ** 3 * scale        # a cubic: the edge fits are exact
    return Z


@pytest.mark.parametrize("n", [5, 7, 31, 32, 33, 40, 64, 67, 128, 257])
def test_savgol_rows_are_scipys_filter_per_row(n: int) -> None:
    rng = np.random.default_rng(n)
    windows = sorted({w for w in (5, 7, 15, 31, 33, n // 2 | 1, n if n % 2 else n - 1) if 5 <= w <= n})
    for w in windows:
        coeffs = dt._savgol_coeffs(w)
        for scale in (1e-12, 1.0, 1e9):
            Z = _stack(rng, 12, n, scale)
            got = rows.savgol_rows(Z, coeffs)
            assert got is not None
            for z, g in zip(Z, got):
                assert _same(g, savgol_filter(z, w, 3, mode="interp")), (n, w, scale)


@pytest.mark.parametrize("n", [16, 31, 32, 33, 48, 64, 100, 257, 600])
def test_welch_rows_are_scipys_welch_per_row(n: int) -> None:
    rng = np.random.default_rng(100 + n)
    for nper in (16, 32, 64):
        if nper > n:
            continue
        R = _stack(rng, 20, n, 1.0)
        win = get_window("hann", nper)
        freq, power = rows.welch_rows(R, win, nper)
        for r, p in zip(R, power):
            f1, p1 = welch(r, fs=1.0, window=win, nperseg=nper, noverlap=nper // 2, detrend=False)
            assert _same(freq, f1) and _same(p, p1)


def _cubic_stack(rng: np.random.Generator, u: int, a: float, b: float):  # type: ignore[no-untyped-def]
    c = rng.normal(size=(4 * u, 4)) * rng.choice([1e-3, 1.0, 1e3], size=(4 * u, 1))

    def f(x: np.ndarray, k: np.ndarray) -> np.ndarray:
        return c[k, 0] + c[k, 1] * x + c[k, 2] * x ** 2 + c[k, 3] * x ** 3

    every = np.arange(c.shape[0])
    fa, fb = f(np.full(every.size, a), every), f(np.full(every.size, b), every)
    keep = np.flatnonzero(fa * fb < 0)[:u]
    c = c[keep]
    return f, fa[keep], fb[keep]


@pytest.mark.parametrize("xtol,maxiter", [(1e-6, 100), (1e-12, 100), (1e-2, 100), (1e-12, 4)])
def test_brentq_rows_is_scipys_brentq(xtol: float, maxiter: int) -> None:
    rng = np.random.default_rng(int(-np.log10(xtol)) * 10 + maxiter)
    checked = raised = 0
    for _ in range(6):
        f, fa, fb = _cubic_stack(rng, 200, -2.0, 3.0)
        root, ok = rows.brentq_rows(f, -2.0, 3.0, fa, fb, xtol, maxiter=maxiter)
        for k in range(fa.size):
            one = np.array([k])
            try:
                want = brentq(lambda x, f=f, one=one: float(f(np.array([x]), one)[0]), -2.0, 3.0, xtol=xtol,
                              maxiter=maxiter)
            except RuntimeError:                        # not converged in maxiter steps
                assert not ok[k]
                raised += 1
                continue
            assert ok[k] and root[k] == want, (k, root[k], want)
            checked += 1
    assert (raised > 500 if maxiter < 10 else checked > 1000)


def test_brentq_rows_stops_a_row_whose_function_gives_nan() -> None:
    def f(x: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.where(k == 1, np.nan, x - 0.3)

    root, ok = rows.brentq_rows(f, 0.0, 1.0, np.array([-0.3, -0.3]), np.array([0.7, 0.7]), 1e-9)
    assert ok.tolist() == [True, False]
    assert root[0] == brentq(lambda x: x - 0.3, 0.0, 1.0, xtol=1e-9)


def _residuals(rng: np.random.Generator, n: int, u: int) -> np.ndarray:
    R = rng.normal(size=(u, n)) + np.cumsum(rng.normal(size=(u, n)), axis=1) * rng.random((u, 1))
    R[0] = np.tile([1.0, -1.0], n)[:n]                 # ρ̂ = -1: below the bracket
    R[1] = np.linspace(-1.0, 1.0, n)                   # a straight line: ρ̂ near 1, above it
    R[2] = 1e200 * rng.normal(size=n)                  # ρ̂ NaN (the products overflow): fit_ar1 raises
    R[3] = 1e-200 * rng.normal(size=n)
    return R


@pytest.mark.parametrize("n,detrender", [(32, "savgol"), (40, "savgol"), (64, "diff"), (200, "savgol")])
def test_ar1_roots_are_fit_ar1(n: int, detrender: str) -> None:
    rng = np.random.default_rng(n)
    det = dt.detrend(np.cumsum(rng.normal(size=n)), detrender)
    grid = bg.GainGrid(det.gain_grid(1 << 14))
    R = _residuals(rng, det.residual.size, 150)
    with np.errstate(all="ignore"):
        rho = np.array([bg.lag1(r) for r in R])
        lo, hi = bg.AR1_BRACKET
        alpha, acov, ok = rows.ar1_roots(rho, grid, lo, hi, 16, bg.AR1_XTOL)
        for u, r in enumerate(R):
            try:
                a, s2 = bg.fit_ar1(r, grid)
            except ValueError:                          # NaN: SciPy refuses the search
                assert not ok[u]
                continue
            assert ok[u] and alpha[u] == a and _same(acov[u], grid.acov(a, 16))
            assert float(np.var(r)) / float(acov[u, 0]) == s2
    assert alpha[0] == lo and alpha[1] == hi and not ok[2]


def _series(rng: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    t = np.arange(n)
    out = []
    for i in range(count):
        y = np.exp(-t / rng.uniform(5, 50)) + 0.05 * np.cumsum(rng.normal(size=n)) + 0.02 * rng.normal(size=n)
        if i % 4 == 0:                                  # a planted line: significant peaks, the second fit
            y += 0.3 * np.sin(2 * np.pi * t / rng.uniform(3, 9))
        if i % 9 == 5:
            y[n // 2:] += 2.0                          # a level shift
        if i % 11 == 7:
            y[n // 3] += 10.0                          # a spike: winsorised
        out.append(y)
    return out


def test_detrend_many_and_the_cache_are_detrend_per_series() -> None:
    rng = np.random.default_rng(7)
    for n, window in ((32, None), (32, 31), (100, 33), (300, 51)):
        ys = _series(rng, n, 12)
        for y in ys:
            y.setflags(write=False)
        for one, many in zip([dt.detrend(y, "savgol", window) for y in ys], dt.detrend_many(ys, "savgol", window)):
            assert all(_same(getattr(one, k), getattr(many, k)) for k in ("residual", "trend", "coeffs"))
            assert one.shifts == many.shifts and one.window == many.window
        cache = dt.DetrendCache()
        first = cache.get_many(ys[:6], "savgol", window, 6.0)
        assert cache.hits == 0
        got = cache.get_many(ys, "savgol", window, 6.0)            # the first six known, the rest stacked
        assert cache.hits == 6 and all(a[1] is b[1] for a, b in zip(first, got))
        assert all(cache.get(y, "savgol", window, 6.0)[1] is g[1] for y, g in zip(ys, got))  # the same arrays
        assert cache.hits == 6 + len(ys) and not got[0][1].flags.writeable
        for y, (det, r, k) in zip(ys, got):
            want = dt.detrend(y, "savgol", window)
            assert _same(det.residual, want.residual) and (r, k)[1] == dt.winsorize(want.residual, 6.0)[1]
            assert _same(r, dt.winsorize(want.residual, 6.0)[0])


def _same_spectrum(a: object, b: object) -> bool:
    for k, x in vars(a).items():
        y = getattr(b, k)
        if k == "detrended":
            if not all(_same(getattr(x, f), getattr(y, f)) for f in ("residual", "trend", "coeffs")):
                return False
            if x.shifts != y.shifts:
                return False
        elif isinstance(x, np.ndarray):
            if not _same(x, y):
                return False
        elif repr(x) != repr(y):
            return False
    return True


@pytest.mark.parametrize("options", [SpectrumOptions(), SpectrumOptions(detrend="diff"),
                                     SpectrumOptions(nperseg=32, correction="bonferroni", clip_mad=0.0)])
def test_line_spectra_are_line_spectrum(options: SpectrumOptions) -> None:
    rng = np.random.default_rng(11)
    ys = [y for n in (32, 33, 64, 130) for y in _series(rng, n, 16)] + _series(rng, 48, 1)
    rng.shuffle(ys)                                     # lengths interleaved: the order is kept
    want = [line_spectrum(y, options) for y in ys]
    assert sum(len(w.significant) > 0 for w in want) > 5
    for w, g in zip(want, line_spectra(ys, options)):
        assert _same_spectrum(w, g)
    cache = dt.DetrendCache()
    frozen = [np.array(y) for y in ys]
    for y in frozen:
        y.setflags(write=False)
    for w, g in zip(want, line_spectra(frozen, options, cache)):
        assert _same_spectrum(w, g)
    assert cache.nbytes > 0


def test_line_spectra_refuse_what_line_spectrum_refuses() -> None:
    rng = np.random.default_rng(3)
    ys = _series(rng, 40, 3)
    for bad in (np.ones(20), np.r_[ys[0][:-1], np.nan]):
        with pytest.raises(SpecError, match="need at least 32 finite values"):
            line_spectra([*ys, bad])


def _groups(rng: np.random.Generator) -> list[SeriesGroup]:
    out = []
    ys = [y for n in (32, 32, 40, 100) for y in _series(rng, n, 10)] + [np.ones(40), np.arange(20.0)]
    for i, y in enumerate(ys):
        s = regularize(np.arange(y.size, dtype=float), y, name=f"grad_norm/t{i}", tensor=f"t{i}", unit="step")
        out.append(SeriesGroup(s))
    return out


def test_the_analyses_tables_and_series_are_the_per_series_code() -> None:
    rng = np.random.default_rng(5)
    groups = _groups(rng)
    opt = SpectrumOptions()
    for cache in (None, dt.DetrendCache()):
        got_ls = ls.analyze_series(groups, opt, cache)
        got_fr = fr.analyze_series(groups, opt, cache)
        arrays_ls: dict[str, np.ndarray] = {}
        rows_ls = [r for g in groups for r in ls._series_rows(g.combined, opt, arrays_ls)]
        arrays_fr: dict[str, np.ndarray] = {}
        rows_fr = [fr._row(g.combined, opt, arrays_fr) for g in groups]
        for got, want_rows, want_arrays in ((got_ls, rows_ls, arrays_ls), (got_fr, rows_fr, arrays_fr)):
            want = type(got.table)(want_rows, columns=got.table.columns)
            assert got.table.to_csv(float_format="%.17g") == want.to_csv(float_format="%.17g")
            assert sorted(got.series) == sorted(want_arrays)
            assert all(_same(got.series[k], want_arrays[k]) for k in want_arrays)
    assert got_ls.table["significant"].astype(bool).any()


@pytest.mark.parametrize("n", [32, 33, 40, 64, 100, 257, 1000])
def test_fractal_fits_of_a_stack_are_the_single_fits(n: int) -> None:
    rng = np.random.default_rng(200 + n)
    R = rng.normal(size=(16, n)) + np.cumsum(rng.normal(size=(16, n)), axis=1) * rng.random((16, 1))
    R[0] = np.sin(np.arange(n) / 3.0)                     # smooth: few boxes, long curve lengths
    R[1] *= 1e-8
    R[2] = np.round(R[2])                                 # ties and flat runs
    for w in sorted({31, 33, n // 2 | 1, 65, 129}):
        got = fr._fits_rows(R, w)
        assert got is not None
        for r, pair in zip(R, got):
            want = (fr.higuchi(r, kmax=max(8, w // 16)), fr.box_counting(r, max_width=max(32, w // 8)))
            for g, e in zip(pair, want):
                assert (g.dimension, g.lo, g.hi, g.r2) == (e.dimension, e.lo, e.hi, e.r2)
                assert _same(g.scales, e.scales) and _same(g.values, e.values)
    assert fr._fits_rows(R[:, :20], 513) is None          # scales beyond the series: the single calls


def test_fractal_line_fits_of_a_stack_are_polyfit() -> None:
    rng = np.random.default_rng(9)
    for m in (2, 5, 8, 24):
        x = np.log(np.arange(1.0, m + 1.0) * rng.uniform(1, 3))
        Y = rng.normal(size=(40, m)) * rng.choice([1e-6, 1.0, 1e6], size=(40, 1))
        Y[0] = 1.5                                        # ss = 0: r² is 1
        slope, r2 = fr._line_rows(x, Y)
        for u, y in enumerate(Y):
            assert (slope[u], r2[u]) == fr._line(x, y)


# ------------------------------------------------- scipy.signal's results without importing it
def test_the_replicas_are_scipy_signals_results() -> None:
    from scipy.signal import find_peaks, savgol_coeffs

    from gradforensics.analysis.toolkit.signal import replicas as rp

    for n in [*range(1, 70), 127, 128, 129, 255, 256, 1000, 1024, 4096, 16384]:
        assert _same(rp.hann_periodic(n), get_window("hann", n)), n
    for w in [*range(5, 200, 2), 255, 257, 511, 1023, 1025, 2049]:
        assert _same(rp.savgol_coeffs3(w), savgol_coeffs(w, 3)), w
    rng = np.random.default_rng(17)
    for n in (16, 17, 31, 32, 33, 48, 64, 100, 257, 600):
        for nper in (16, 17, 32, 64, 128):
            if nper > n:
                continue
            X = _stack(rng, 6, n, float(rng.choice([1e-9, 1.0, 1e9])))
            win = get_window("hann", nper)
            f2, P2 = rp.welch_density(X, win, nper)
            for x, p2 in zip(X, P2):
                f1, p1 = welch(x, fs=1.0, window=win, nperseg=nper, noverlap=nper // 2, detrend=False)
                g1, q1 = rp.welch_density(x, win, nper)
                assert _same(f1, f2) and _same(f1, g1) and _same(p1, p2) and _same(p1, q1), (n, nper)
    for n in (0, 1, 2, 3, 5, 19, 40, 300):
        for x in (rng.normal(size=n), np.round(rng.normal(size=n)), np.zeros(n), rng.integers(0, 3, n) * 1.0,
                  np.r_[[-1.0], np.where(rng.random(n) < 0.5, 0.0, rng.random(n)), [-1.0]]):
            assert _same(rp.local_maxima(x), find_peaks(x)[0]), x


def _fit_ar1_with_scipy(r: np.ndarray, grid: bg.GainGrid) -> tuple[float, float]:
    """fit_ar1 as it was: SciPy's brentq on the model."""
    rho = bg.lag1(r)

    def model(a: float) -> float:
        g = grid.acov(a, 2)
        return float(g[1] / g[0])

    lo, hi = bg.AR1_BRACKET
    if rho <= model(lo):
        a = lo
    elif rho >= model(hi):
        a = hi
    else:
        a = float(brentq(lambda x: model(x) - rho, lo, hi, xtol=bg.AR1_XTOL))
    return a, float(np.var(r)) / float(grid.acov(a, 1)[0])


@pytest.mark.parametrize("n,detrender", [(32, "savgol"), (64, "diff"), (300, "savgol")])
def test_fit_ar1_is_the_scipy_brentq_fit(n: int, detrender: str) -> None:
    rng = np.random.default_rng(300 + n)
    det = dt.detrend(np.cumsum(rng.normal(size=n)), detrender)
    grid = bg.GainGrid(det.gain_grid(1 << 14))
    R = _residuals(rng, det.residual.size, 120)
    with np.errstate(all="ignore"):
        for r in R:
            try:
                want = _fit_ar1_with_scipy(r, grid)
            except ValueError:
                with pytest.raises(ValueError):
                    bg.fit_ar1(r, grid)
                continue
            assert bg.fit_ar1(r, grid) == want


@pytest.mark.slow
def test_the_analyze_path_does_not_import_scipy_signal(tmp_path) -> None:
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from gradforensics.analysis.toolkit.signal.spectra import line_spectra\n"
            "from gradforensics.analysis.kinds import fractal\n"
            "rng = np.random.default_rng(0)\n"
            "ys = [np.cumsum(rng.normal(size=40)) + np.sin(np.arange(40)) for _ in range(3)]\n"
            "line_spectra(ys); line_spectra(ys[:1])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('scipy.signal', 'scipy.optimize', 'scipy.stats'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
