"""The AR(1) red-noise background of a detrended series, and Welch's estimate of it.

A loss curve's noise is red: batch-to-batch losses are correlated through the
slowly moving weights.  The background a peak is tested against is AR(1) noise
fitted to the *detrended* residual (:func:`fit_ar1`), seen through the
detrender's power gain (:func:`filtered_ar1_acov`), and its exact expected
Welch estimate (:func:`expected_welch`) with the equivalent degrees of freedom
of the Welch average (:func:`welch_dof`).

References
----------
Torrence, C. & Compo, G. P. (1998). A practical guide to wavelet analysis.
    Bull. Amer. Meteor. Soc. 79, 61–78 (eqs. 16–18).
Welch, P. D. (1967). The use of fast Fourier transform for the estimation of power
    spectra. IEEE Trans. Audio Electroacoust. 15, 70–73.
Percival, D. B. & Walden, A. T. (1993). Spectral Analysis for Physical
    Applications. Cambridge University Press (eq. 292b).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["AR1_BRACKET", "AR1_XTOL", "GainGrid", "expected_welch", "filtered_ar1_acov", "fit_ar1", "gain_grid_of", "hann", "lag1", "welch_dof"]


#: The bracket of :func:`fit_ar1`'s root search (an α outside it takes the nearer end) and its tolerance.
AR1_BRACKET = (-0.95, 0.995)
AR1_XTOL = 1e-6


def filtered_ar1_acov(alpha: float, gain: np.ndarray, n_lags: int) -> np.ndarray:
    """Autocovariance, lags ``0..n_lags-1``, of unit-innovation AR(1) noise passed
    through a filter of power gain *gain*.

    ``γ(τ) = ∫ G(f) / (1 + α² − 2α cos 2πf) · e^{2πifτ} df`` over one period, with
    *gain* sampled at ``f = j/M, j = 0..M/2`` (see :meth:`Detrended.gain_grid`).
    """
    m = 2 * (gain.size - 1)
    f = np.arange(gain.size) / m
    spec = gain / (1.0 + alpha * alpha - 2.0 * alpha * np.cos(2 * np.pi * f))
    return np.fft.irfft(spec, n=m)[:n_lags]


class GainGrid:
    """A detrender's power gain on the FFT grid, with :func:`filtered_ar1_acov` on it memoised.

    Series of one length share their detrender, so their AR(1) fits evaluate the
    same grid: the cosine of the grid is computed once, and every autocovariance
    once per ``alpha`` (the bracket ends of the root search are the same for every
    series; the root's own autocovariance serves the background too).  The values
    are those of :func:`filtered_ar1_acov`, bit for bit (same operations, same order).
    """

    MAX_MEMO = 64

    def __init__(self, gain: np.ndarray) -> None:
        self.gain = np.asarray(gain)
        self.m = 2 * (self.gain.size - 1)
        self.cos = np.cos(2 * np.pi * (np.arange(self.gain.size) / self.m))
        self._memo: dict[float, np.ndarray] = {}

    def acov(self, alpha: float, n_lags: int) -> np.ndarray:
        """``filtered_ar1_acov(alpha, self.gain, n_lags)`` (a fresh copy)."""
        full = self._memo.get(alpha)
        if full is None:
            # gain / (1 + α² − 2α cos), the same three operations in place in one buffer
            den = np.multiply(2.0 * alpha, self.cos)
            np.subtract(1.0 + alpha * alpha, den, out=den)
            full = np.fft.irfft(np.divide(self.gain, den, out=den), n=self.m)
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[alpha] = full
        return full[:n_lags].copy()


def gain_grid_of(gain: np.ndarray | GainGrid) -> GainGrid:
    return gain if isinstance(gain, GainGrid) else GainGrid(gain)


def lag1(r: np.ndarray) -> float:
    """Sample lag-1 autocorrelation (biased estimator, Box & Jenkins)."""
    d = r - r.mean()
    den = float(d @ d)
    return float(d[1:] @ d[:-1]) / den if den > 0 else 0.0


def fit_ar1(r: np.ndarray, gain: np.ndarray | GainGrid) -> tuple[float, float]:
    """AR(1) coefficient and innovation variance of the noise behind residual *r*.

    α solves ``ρ_model(1; α) = ρ̂(1)`` where ρ_model is the lag-1 autocorrelation
    of AR(1) noise seen through the detrending filter (for a first difference this
    is ``−(1 − α)/2``; with no filter it is α itself, Torrence & Compo eq. 16's
    input); σ² then matches the residual's variance.
    """
    from gradforensics.analysis.toolkit.signal.rows import brentq_rows

    rho = lag1(r)
    grid = gain_grid_of(gain)

    def model(a: float) -> float:
        g = grid.acov(a, 2)
        return float(g[1] / g[0])

    lo, hi = AR1_BRACKET
    m_lo, m_hi = model(lo), model(hi)
    if rho <= m_lo:
        a = lo
    elif rho >= m_hi:
        a = hi
    else:       # SciPy's brentq(model - rho, lo, hi, xtol=AR1_XTOL), its steps (rows.brentq_rows), bit for bit
        root, ok = brentq_rows(lambda x, _: np.array([model(float(x[0])) - rho]), lo, hi,
                               np.array([m_lo - rho]), np.array([m_hi - rho]), AR1_XTOL)
        if not ok[0]:           # where brentq raises: ValueError for a NaN, RuntimeError past 100 steps
            err = ValueError if np.isnan(rho) else RuntimeError
            raise err(f"fit_ar1: the AR(1) root search found no root in [{lo}, {hi}] for a lag-1 "
                      f"autocorrelation of {rho!r} (a non-finite residual?).")
        a = float(root[0])
    g0 = grid.acov(a, 1)[0]
    return a, float(np.var(r)) / float(g0)


# ------------------------------------------------------------------- Welch + dof
def hann(n: int) -> np.ndarray:
    """SciPy's periodic Hann window of *n* points (computed once per *n*; a fresh copy)."""
    return _hann(int(n)).copy()


@lru_cache(maxsize=64)
def _hann(n: int) -> np.ndarray:
    from gradforensics.analysis.toolkit.signal.replicas import hann_periodic

    return hann_periodic(n)         # scipy.signal.get_window("hann", n), bit for bit


@lru_cache(maxsize=256)
def welch_dof(nperseg: int, n_segments: int) -> float:
    """Equivalent degrees of freedom of a 50 %-overlap Hann Welch average.

    Percival & Walden (1993), eq. 292b:
    ``ν = 2 N_B / (1 + 2 Σ_{m=1}^{N_B−1} (1 − m/N_B) |Σ_t h_t h_{t+mS}|²)`` with
    ``Σ h² = 1`` and shift ``S = nperseg // 2``.
    """
    h = hann(nperseg)
    h = h / np.sqrt(h @ h)
    shift = nperseg // 2
    total = 0.0
    for m in range(1, n_segments):
        lag = m * shift
        if lag >= nperseg:
            break
        total += (1 - m / n_segments) * float(h[:-lag] @ h[lag:]) ** 2
    return 2.0 * n_segments / (1.0 + 2.0 * total)


def expected_welch(acov: np.ndarray, nperseg: int) -> np.ndarray:
    """Expected one-sided Welch density (fs = 1) of a process with autocovariance *acov*.

    ``E[P̂(f_k)] = (c_k / Σw²) Σ_{|τ|<L} γ(τ) c_w(τ) e^{−2πi k τ / L}``, with
    ``c_w(τ) = Σ_t w_t w_{t+τ}`` the window's autocorrelation and ``c_k = 2`` except
    at 0 and Nyquist (SciPy's ``scaling="density"``).
    """
    w = hann(nperseg)
    cw = np.correlate(w, w, mode="full")[nperseg - 1:]
    s = acov[:nperseg] * cw
    a = np.zeros(2 * nperseg)
    a[:nperseg] = s
    a[nperseg + 1:] = s[1:][::-1]
    spec = np.fft.rfft(a).real[::2] / float(w @ w)
    spec[1:] *= 2.0
    if nperseg % 2 == 0:
        spec[-1] /= 2.0
    return spec


