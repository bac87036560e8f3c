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

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from gradforensics.analysis.toolkit.signal.welch import hann

__all__ = ["AR1_BRACKET", "AR1_XTOL", "GainGrid", "ar1_fits", "bracketed_roots", "expected_welch",
           "filtered_ar1_acov", "fit_ar1", "lag1", "welch_dof"]


#: The bracket of :func:`fit_ar1`'s root search (an α outside it takes the nearer end) and its tolerance.
AR1_BRACKET = (-0.95, 0.995)
AR1_XTOL = 1e-6


def filtered_ar1_acov(alpha: float, gain: np.ndarray, n_lags: int) -> np.ndarray:
    """Autocovariance, lags ``0..n_lags-1``, of unit-innovation AR(1) noise passed
    through a filter of power gain *gain*.

    ``γ(τ) = ∫ G(f) / (1 + α² − 2α cos 2πf) · e^{2πifτ} df`` over one period, with
    *gain* sampled at ``f = j/M, j = 0..M/2`` (see :meth:`Detrended.gain_grid`).
    """
    return GainGrid(gain).acov_rows(np.array([float(alpha)]))[0, :n_lags]


class GainGrid:
    """A detrender's power gain on the FFT grid, with :func:`filtered_ar1_acov` on it.

    Series of one length share their detrender, so their AR(1) fits evaluate the
    same grid: its cosine is computed once, the autocovariances of many α in one
    2-d inverse FFT (:meth:`acov_rows`), their lag-1 autocorrelations by two weighted
    sums (:meth:`lag1_rows`).
    """

    def __init__(self, gain: np.ndarray) -> None:
        self.gain = np.asarray(gain)
        self.m = 2 * (self.gain.size - 1)
        self.cos = np.cos(2 * np.pi * (np.arange(self.gain.size) / self.m))
        w = np.full(self.gain.size, 2.0)
        w[0] = w[-1] = 1.0                                # m is even: the Nyquist term counts once
        self._w01 = np.stack([w, w * self.cos], axis=1)

    def _spectra(self, alpha: np.ndarray) -> np.ndarray:
        """``gain / (1 + α² − 2α cos 2πf)`` on the grid for each α: ``(len(alpha), m // 2 + 1)``."""
        alpha = np.asarray(alpha, dtype=np.float64)[:, None]
        den = np.multiply(2.0 * alpha, self.cos)
        np.subtract(1.0 + alpha * alpha, den, out=den)
        return np.divide(self.gain, den, out=den)

    def acov_rows(self, alpha: np.ndarray) -> np.ndarray:
        """The full autocovariance (``m`` lags) for each α of *alpha*: ``(len(alpha), m)``."""
        return np.fft.irfft(self._spectra(alpha), n=self.m, axis=-1)

    def lag1_rows(self, alpha: np.ndarray) -> np.ndarray:
        """The lag-1 autocorrelation ``γ(1)/γ(0)`` for each α of *alpha* (two weighted sums of the spectrum,
        the first two terms of :meth:`acov_rows`'s inverse FFT)."""
        g = self._spectra(alpha) @ self._w01
        return g[:, 1] / g[:, 0]


def lag1(R: np.ndarray) -> np.ndarray:
    """Sample lag-1 autocorrelation of each row of *R* (biased estimator, Box & Jenkins); 0 for a constant row."""
    D = R - R.mean(axis=-1, keepdims=True)
    den = (D * D).sum(axis=-1)
    num = (D[..., 1:] * D[..., :-1]).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(np.isnan(den), np.nan, 0.0))


def bracketed_roots(f: Callable[[np.ndarray, np.ndarray], np.ndarray], lo: float, hi: float, f_lo: np.ndarray,
                    f_hi: np.ndarray, xtol: float, maxiter: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Roots of many functions bracketed by ``[lo, hi]``, all searched at once: ``(roots, converged)``.

    ``f(x, rows)`` returns ``f_u(x[k])`` for ``u = rows[k]``; *f_lo* and *f_hi* are the values at the ends,
    of opposite signs.  The Illinois variant of regula falsi (Dowell & Jarratt 1971) with a bisection
    step whenever two steps did not halve the bracket; a row stops once its bracket is narrower than
    ``2·xtol`` (the root returned, its end of smaller ``|f|``, is within ``2·xtol`` of the true root) or
    ``f`` vanishes; a row whose ``f`` is NaN, or that has not converged after *maxiter* steps, comes back
    with ``converged`` False.
    """
    fa, fb = np.array(f_lo, dtype=float), np.array(f_hi, dtype=float)
    a, b = np.full(fa.size, float(lo)), np.full(fa.size, float(hi))
    ok = np.zeros(fa.size, dtype=bool)
    live = ~(np.isnan(fa) | np.isnan(fb))
    kept, width = np.zeros(fa.size, dtype=np.int8), np.full(fa.size, float(hi) - float(lo))
    with np.errstate(all="ignore"):
        for step in range(int(maxiter)):
            done = live & ((np.abs(b - a) < 2 * xtol) | (fa == 0) | (fb == 0))
            ok |= done
            live &= ~done
            rows = np.flatnonzero(live)
            if rows.size == 0:
                break
            ra, rb, ga, gb = a[rows], b[rows], fa[rows], fb[rows]
            x = (ra * gb - rb * ga) / (gb - ga)
            x = np.where(~((x > ra) & (x < rb)) | (step % 2 == 1) & (rb - ra > 0.5 * width[rows]), 0.5 * (ra + rb), x)
            if step % 2 == 1:
                width[rows] = rb - ra
            fx = f(x, rows)
            left = np.sign(fx) == np.sign(ga)          # the root is in [x, b]: x replaces a
            r, q = rows[left], rows[~left]
            a[r], fa[r] = x[left], fx[left]
            fb[r] = np.where(kept[r] == 1, 0.5 * fb[r], fb[r])       # Illinois: halve the end kept twice
            b[q], fb[q] = x[~left], fx[~left]
            fa[q] = np.where(kept[q] == 2, 0.5 * fa[q], fa[q])
            kept[r], kept[q] = 1, 2
            live[rows[np.isnan(fx)]] = False
    return np.where(np.abs(fa) <= np.abs(fb), a, b), ok


def ar1_fits(R: np.ndarray, grid: GainGrid, n_lags: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fit_ar1` of every row of *R* (``(U, n)``): ``(alpha, sigma2, acov, converged)``.

    ``acov[u]`` is the model's autocovariance at ``alpha[u]``, lags ``0..n_lags-1``; the model's lag-1
    autocorrelation is evaluated for every row still searching at once (:meth:`GainGrid.lag1_rows`).
    """
    R = np.asarray(R, dtype=float)
    rho = lag1(R)
    lo, hi = AR1_BRACKET
    m_lo, m_hi = grid.lag1_rows(np.array([lo, hi]))
    alpha = np.where(rho <= m_lo, lo, hi).astype(np.float64)
    ok = ~np.isnan(rho)
    inside = np.flatnonzero((rho > m_lo) & (rho < m_hi))
    if inside.size:
        r_in = rho[inside]
        alpha[inside], ok[inside] = bracketed_roots(lambda x, rows: grid.lag1_rows(x) - r_in[rows], lo, hi,
                                                    m_lo - r_in, m_hi - r_in, AR1_XTOL)
    acov = grid.acov_rows(alpha)[:, :max(int(n_lags), 1)]
    return alpha, R.var(axis=-1) / acov[:, 0], acov, ok


def fit_ar1(r: np.ndarray, gain: np.ndarray | GainGrid) -> tuple[float, float]:
    """AR(1) coefficient and innovation variance of the noise behind residual *r*.

    α solves ``ρ_model(1; α) = ρ̂(1)`` where ρ_model is the lag-1 autocorrelation
    of AR(1) noise seen through the detrending filter (for a first difference this
    is ``−(1 − α)/2``; with no filter it is α itself, Torrence & Compo eq. 16's
    input), to ``2·AR1_XTOL``; σ² then matches the residual's variance.  :func:`ar1_fits` of one row.
    """
    grid = gain if isinstance(gain, GainGrid) else GainGrid(gain)
    alpha, sigma2, _, ok = ar1_fits(np.asarray(r, dtype=float)[None, :], grid, 1)
    if not ok[0]:
        raise ValueError(f"fit_ar1: the AR(1) root search found no root in {AR1_BRACKET} for a lag-1 "
                         f"autocorrelation of {float(lag1(np.asarray(r, dtype=float)))!r} (a non-finite residual?).")
    return float(alpha[0]), float(sigma2[0])


# ------------------------------------------------------------------- Welch + dof
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
    """Expected one-sided Welch density (fs = 1) of a process with autocovariance *acov* (each row of a stack).

    ``E[P̂(f_k)] = (c_k / Σw²) Σ_{|τ|<L} γ(τ) c_w(τ) e^{−2πi k τ / L}``, with
    ``c_w(τ) = Σ_t w_t w_{t+τ}`` the window's autocorrelation and ``c_k = 2`` except
    at 0 and Nyquist (SciPy's ``scaling="density"``).
    """
    w = hann(nperseg)
    cw = np.correlate(w, w, mode="full")[nperseg - 1:]
    s = np.asarray(acov)[..., :nperseg] * cw
    a = np.zeros((*s.shape[:-1], 2 * nperseg))
    a[..., :nperseg] = s
    a[..., nperseg + 1:] = s[..., 1:][..., ::-1]
    spec = np.fft.rfft(a, axis=-1).real[..., ::2] / float(w @ w)
    spec[..., 1:] *= 2.0
    if nperseg % 2 == 0:
        spec[..., -1] /= 2.0
    return spec
