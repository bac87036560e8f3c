""":func:`line_spectra`: :func:`~gradforensics.analysis.toolkit.signal.spectrum.line_spectrum` of many series.

A store of thousands of small tensors has thousands of gradient-norm series of one
length; their line spectra share the detrending window, the Welch segments and the gain
grid of the AR(1) fit.  :func:`line_spectra` runs the steps that were one library call
per series over each stack of same-length series at once
(:mod:`~gradforensics.analysis.toolkit.signal.rows`: the Savitzky–Golay smooth, Welch, the
first AR(1) root search), and the rest (the tests, the peaks, a second fit where peaks
are significant) per series, as :func:`line_spectrum` does.  Every result is the one
:func:`line_spectrum` returns for that series, bit for bit: the first series of each
stack is checked against the single calls, which are kept where it differs
(``tests/test_series_batched.py`` holds the whole against ``line_spectrum``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradforensics.analysis.toolkit.signal.background import AR1_BRACKET, AR1_XTOL, fit_ar1, hann, lag1
from gradforensics.analysis.toolkit.signal.detrending import DetrendCache, Detrended, detrend_many, winsorize
from gradforensics.analysis.toolkit.signal.spectrum import (
    MIN_POINTS,
    LineSpectrum,
    SpectrumOptions,
    gain_grid,
    line_spectrum,
    spectrum_window,
    tested_spectrum,
)

__all__ = ["STACK", "line_spectra"]

#: Series transformed together at most (bounds the stack of 16,384-point autocovariances).
STACK = 256


def line_spectra(ys: Sequence[np.ndarray], options: SpectrumOptions | None = None,
                 cache: DetrendCache | None = None) -> list[LineSpectrum]:
    """``[line_spectrum(y, options, cache) for y in ys]``, the same values, series of one length stacked.

    A series :func:`line_spectrum` would refuse (too short, not finite) raises its error here too.
    """
    opt = options or SpectrumOptions()
    out: list[LineSpectrum | None] = [None] * len(ys)
    by_size: dict[int, list[int]] = {}
    for i, y in enumerate(ys):
        a = np.asarray(y, dtype=float)
        if a.ndim != 1 or a.size < MIN_POINTS or not np.all(np.isfinite(a)):
            out[i] = line_spectrum(y, opt, cache)            # raises its own error
        else:
            by_size.setdefault(a.size, []).append(i)
    for idx in by_size.values():
        for k in range(0, len(idx), STACK):
            part = idx[k:k + STACK]
            for i, res in zip(part, _stacked([ys[i] for i in part], opt, cache)):
                out[i] = res
    return [o for o in out if o is not None]


def _stacked(ys: list[np.ndarray], opt: SpectrumOptions, cache: DetrendCache | None) -> list[LineSpectrum]:
    """:func:`line_spectrum` of finite series of one length (at least :data:`MIN_POINTS` points)."""
    if len(ys) < 2:
        return [line_spectrum(y, opt, cache) for y in ys]
    nper, window = spectrum_window(np.asarray(ys[0]).size, opt)
    got = _detrended(ys, opt, window, cache)
    R = np.stack([r for _, r, _ in got])
    nper = min(nper, R.shape[1])
    welch = _welch(R, nper)
    first = _first_fits(R, got[0][0], nper) if welch is not None else None
    out = []
    for u, (det, r, n_clipped) in enumerate(got):
        w = (welch[0], welch[1][u].copy()) if welch is not None else None
        fit = first[u] if first is not None else None
        out.append(tested_spectrum(r, det, n_clipped, nper, opt, w, fit))
    return out


def _detrended(ys: list[np.ndarray], opt: SpectrumOptions, window: int | None, cache: DetrendCache | None
               ) -> list[tuple[Detrended, np.ndarray, int]]:
    if cache is not None:
        return cache.get_many(ys, opt.detrend, window, opt.clip_mad)
    return [(det, *winsorize(det.residual, opt.clip_mad)) for det in detrend_many(list(ys), opt.detrend, window)]


def _welch(R: np.ndarray, nper: int) -> tuple[np.ndarray, np.ndarray] | None:
    """SciPy's Welch estimate of every row, or None where the first row is not the 1-d call's."""
    from gradforensics.analysis.toolkit.signal.replicas import welch_density
    from gradforensics.analysis.toolkit.signal.rows import welch_rows

    win = hann(nper)
    freq, power = welch_rows(R, win, nper)
    f0, p0 = welch_density(R[0], win, nper)
    if not (np.array_equal(f0, freq) and np.array_equal(p0, power[0])):
        return None
    return freq, power


def _first_fits(R: np.ndarray, det: Detrended, nper: int) -> list[tuple[float, float, np.ndarray] | None] | None:
    """:func:`fit_ar1` of every row and its autocovariance (lags ``0..nper-1``); None for a row whose root
    search failed (the single call raises there), None in all where the first row is not the single call's."""
    from gradforensics.analysis.toolkit.signal.rows import ar1_roots

    grid = gain_grid(det, nper)
    rho = np.array([lag1(r) for r in R])
    lo, hi = AR1_BRACKET
    alpha, acov, ok = ar1_roots(rho, grid, lo, hi, nper, AR1_XTOL)
    fits: list[tuple[float, float, np.ndarray] | None] = [
        (float(alpha[u]), float(np.var(R[u])) / float(acov[u, 0]), acov[u, :nper].copy()) if ok[u] else None
        for u in range(R.shape[0])]
    if fits[0] is None:
        return None
    a0, s0 = fit_ar1(R[0], grid)
    if not (a0 == fits[0][0] and s0 == fits[0][1] and np.array_equal(grid.acov(a0, nper), fits[0][2])):
        return None
    return fits
