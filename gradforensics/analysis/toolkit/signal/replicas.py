"""The few ``scipy.signal`` results the loss-curve analyses use, computed without importing ``scipy.signal``.

Importing ``scipy.signal`` costs more than a CPU second (it brings ``scipy.stats``,
``scipy.interpolate`` and ``scipy.optimize`` with it), more than the whole spectrum of a
store's series once they are stacked.  What the analyses take from it is small, and each
function here takes SciPy's own steps on the same operands (the same NumPy operations in
the same order, SciPy's ``scipy.fft`` and ``scipy.linalg.lstsq`` where SciPy calls them), so
its values are SciPy's bit for bit (``tests/test_series_batched.py`` holds each against
``scipy.signal`` over many sizes and random inputs):

* :func:`hann_periodic` - ``get_window("hann", n)``;
* :func:`savgol_coeffs3` - ``savgol_coeffs(w, 3)``;
* :func:`welch_density` - ``welch(x, fs=1, window=win, nperseg, noverlap=nperseg // 2,
  detrend=False)`` along the last axis (SciPy's ``ShortTimeFFT`` spectrogram: the window
  scaled to a density, one ``rfft`` a segment, ``|X|²``, the one-sided doubling, the mean
  over the segments);
* :func:`local_maxima` - ``find_peaks(x)[0]`` (no conditions): SciPy's plateau-aware scan.
"""

from __future__ import annotations

import numpy as np

__all__ = ["hann_periodic", "local_maxima", "savgol_coeffs3", "welch_density"]


def hann_periodic(n: int) -> np.ndarray:
    """``scipy.signal.get_window("hann", n)``: the general cosine window ``0.5 − 0.5 cos`` of ``n + 1``
    points on ``[−π, π]``, its last point dropped."""
    n = int(n)
    if n <= 1:
        return np.ones(n, dtype=np.float64)
    a = np.asarray([0.5, 1.0 - 0.5], dtype=np.float64)
    fac = np.linspace(-np.pi, np.pi, n + 1, dtype=np.float64)
    w = np.zeros(n + 1, dtype=np.float64)
    for k in range(a.shape[0]):
        w += a[k] * np.cos(k * fac)
    return w[:-1]


def savgol_coeffs3(w: int) -> np.ndarray:
    """``scipy.signal.savgol_coeffs(w, 3)`` for an odd window *w* > 3 (the smoothing filter, ``use="conv"``):
    the minimum-norm solution of ``x^k · c = [k = 0]`` on ``x = w//2 … −w//2`` by SciPy's ``lstsq``."""
    from scipy.linalg import lstsq

    half = int(w) // 2
    x = np.flip(np.arange(-half, int(w) - half, dtype=np.float64))
    order = np.reshape(np.arange(4, dtype=np.float64), (-1, 1))
    A = x ** order
    y = np.zeros(4, dtype=np.float64)
    y[0] = 1.0 / (1.0 ** 0)
    coeffs, _, _, _ = lstsq(A, y, cond=np.finfo(np.float64).eps * max(A.shape))
    return np.asarray(coeffs)


def welch_density(x: np.ndarray, win: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """``scipy.signal.welch(x, fs=1.0, window=win, nperseg=nperseg, noverlap=nperseg // 2, detrend=False)``
    along the last axis of a real *x* (1-d or a stack) with ``len(win) == nperseg <= x.shape[-1]``."""
    import scipy.fft

    x = np.asarray(x, dtype=np.float64)
    n, hop = x.shape[-1], nperseg - nperseg // 2
    total = 0
    for v in win.real ** 2 + win.imag ** 2:      # Python's sum, left to right, as SciPy's scale factor takes it
        total = total + v
    scaled = win * (1 / np.sqrt(total / (1 / 1.0)))
    n_seg = (n - nperseg // 2) // hop
    starts = np.arange(n_seg) * hop
    segs = x[..., starts[:, None] + np.arange(nperseg)]              # (..., n_seg, nperseg)
    S = scipy.fft.rfft(segs * scaled.conj(), n=nperseg, axis=-1)       # (..., n_seg, f)
    P = np.ascontiguousarray(np.swapaxes(S.real ** 2 + S.imag ** 2, -1, -2))   # (..., f, n_seg), as SciPy lays it
    P[..., 1:-1 if nperseg % 2 == 0 else None, :] *= 2
    P = P.mean(axis=-1) if n_seg > 1 else P[..., 0]
    return scipy.fft.rfftfreq(nperseg, 1 / 1.0), P


def local_maxima(x: np.ndarray) -> np.ndarray:
    """``scipy.signal.find_peaks(x)[0]``: every sample (or plateau, its middle rounded down) with a smaller
    sample on each side, first and last excluded."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    out = []
    i, last = 1, x.shape[0] - 1
    while i < last:
        if x[i - 1] < x[i]:
            ahead = i + 1
            while ahead < last and x[ahead] == x[i]:
                ahead += 1
            if x[ahead] < x[i]:
                out.append((i + ahead - 1) // 2)
                i = ahead
        i += 1
    return np.array(out, dtype=np.intp)
