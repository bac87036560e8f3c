"""Welch's averaged periodograms of a stack of series: power, cross-spectrum, coherence.

Textbook estimators (Welch 1967) with the conventions of ``scipy.signal.welch`` / ``csd`` /
``coherence`` at ``fs=1, window="hann", noverlap=nperseg // 2, detrend=False,
scaling="density"``: the periodic Hann window (:func:`hann`), half-overlapping segments, each
``conj(X)·Y / Σw²``, one-sided (doubled except at 0 and Nyquist) and averaged over the
segments.  Every function works along the last axis, so a stack of series is one call.
``tests/test_signal_estimators.py`` holds them against ``scipy.signal`` at ``rtol=1e-10``.

Reference: Welch, P. D. (1967). The use of fast Fourier transform for the estimation of power
spectra. IEEE Trans. Audio Electroacoust. 15, 70–73.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["coherence", "csd", "hann", "welch"]


@lru_cache(maxsize=64)
def hann(n: int) -> np.ndarray:
    """The periodic Hann window of *n* points, ``0.5 − 0.5 cos(2πk/n)`` (read-only, made once per *n*)."""
    w = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(int(n)) / max(int(n), 1)) if n > 1 else np.ones(int(n))
    w.setflags(write=False)
    return w


def _segment_spectra(x: np.ndarray, nperseg: int) -> np.ndarray:
    """The ``rfft`` of every Hann-tapered, half-overlapping segment of *x*: ``(..., n_segments, nperseg // 2 + 1)``."""
    segs = sliding_window_view(np.asarray(x, dtype=np.float64), nperseg, axis=-1)[..., ::nperseg - nperseg // 2, :]
    return np.fft.rfft(segs * hann(nperseg), axis=-1)


def _density(P: np.ndarray, nperseg: int) -> np.ndarray:
    """Segment products ``(..., n_segments, f)`` to the one-sided density: the mean over segments over ``Σw²``."""
    w = hann(nperseg)
    out = P.mean(axis=-2) / float(w @ w)
    out[..., 1:-1 if nperseg % 2 == 0 else None] *= 2
    return out


def welch(x: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """Welch's power density of *x* (``(..., n)``, ``nperseg <= n``) along its last axis: ``(freq, power)``."""
    X = _segment_spectra(x, nperseg)
    return np.fft.rfftfreq(nperseg), _density(X.real ** 2 + X.imag ** 2, nperseg)


def csd(x: np.ndarray, y: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """Welch's cross-spectral density ``S_xy = E[conj(X)·Y]`` of two series of one length: ``(freq, Pxy)``."""
    return np.fft.rfftfreq(nperseg), _density(_segment_spectra(x, nperseg).conj() * _segment_spectra(y, nperseg),
                                               nperseg)


def coherence(x: np.ndarray, y: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Magnitude-squared coherence ``|Pxy|² / (Pxx Pyy)`` and the cross-spectrum: ``(freq, Cxy, Pxy)``."""
    X, Y = _segment_spectra(x, nperseg), _segment_spectra(y, nperseg)
    pxx, pyy = _density(X.real ** 2 + X.imag ** 2, nperseg), _density(Y.real ** 2 + Y.imag ** 2, nperseg)
    pxy = _density(X.conj() * Y, nperseg)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.fft.rfftfreq(nperseg), np.abs(pxy) ** 2 / (pxx * pyy), pxy
