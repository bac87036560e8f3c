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
* :func:`csd_density` - ``csd(x, y, ...)`` with the same arguments: the cross-spectrogram
  ``conj(X)·Y`` of the same segments, doubled and averaged as SciPy lays it out;
* :func:`coherence_density` - ``coherence(x, y, ...)``: ``|Pxy|² / Pxx / Pyy`` of the two
  above, as SciPy divides;
* :func:`fftconvolve_same` - ``fftconvolve(a, b, mode="same")`` of two real 1-d arrays: SciPy's
  ``rfftn`` / ``irfftn`` at ``next_fast_len`` and its centring;
* :func:`local_maxima` - ``find_peaks(x)[0]`` (no conditions): SciPy's plateau-aware scan.
"""

from __future__ import annotations

import numpy as np

__all__ = ["coherence_density", "csd_density", "fftconvolve_same", "hann_periodic", "local_maxima", "savgol_coeffs3",
           "welch_density"]


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


def _segment_spectra(x: np.ndarray, win: np.ndarray, nperseg: int) -> np.ndarray:
    """SciPy's ``ShortTimeFFT.stft_detrend`` of *x* for ``csd``: the window scaled to a density, one
    ``rfft`` a half-overlapping segment; ``(..., n_seg, f)``."""
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
    return np.asarray(scipy.fft.rfft(segs * scaled.conj(), n=nperseg, axis=-1))


def _one_sided_mean(P: np.ndarray, nperseg: int) -> np.ndarray:
    """``csd``'s last steps on a ``(..., f, n_seg)`` spectrogram: the one-sided doubling, the mean over segments."""
    P[..., 1:-1 if nperseg % 2 == 0 else None, :] *= 2
    return P.mean(axis=-1) if P.shape[-1] > 1 else P[..., 0]


def welch_density(x: np.ndarray, win: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """``scipy.signal.welch(x, fs=1.0, window=win, nperseg=nperseg, noverlap=nperseg // 2, detrend=False)``
    along the last axis of a real *x* (1-d or a stack) with ``len(win) == nperseg <= x.shape[-1]``."""
    import scipy.fft

    S = _segment_spectra(x, win, nperseg)                               # (..., n_seg, f)
    P = np.ascontiguousarray(np.swapaxes(S.real ** 2 + S.imag ** 2, -1, -2))   # (..., f, n_seg), as SciPy lays it
    return scipy.fft.rfftfreq(nperseg, 1 / 1.0), _one_sided_mean(P, nperseg)


def csd_density(x: np.ndarray, y: np.ndarray, win: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """``scipy.signal.csd(x, y, fs=1.0, window=win, nperseg=nperseg, noverlap=nperseg // 2, detrend=False)``
    of two real series of one length ``>= nperseg`` (``len(win) == nperseg``): ``S_xy = conj(X)·Y``
    (*y* the very object *x*: SciPy's real ``welch``)."""
    import scipy.fft

    if y is x:
        return welch_density(x, win, nperseg)
    sx = np.ascontiguousarray(np.swapaxes(_segment_spectra(x, win, nperseg), -1, -2))
    sy = np.ascontiguousarray(np.swapaxes(_segment_spectra(y, win, nperseg), -1, -2))
    P = sy * sx.conj()                           # SciPy's spectrogram(y, x): Sy · conj(Sx), (..., f, n_seg)
    return scipy.fft.rfftfreq(nperseg, 1 / 1.0), _one_sided_mean(P, nperseg)


def coherence_density(x: np.ndarray, y: np.ndarray, win: np.ndarray, nperseg: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``scipy.signal.coherence(x, y, ...)`` with :func:`csd_density`'s arguments, and the cross-spectrum
    itself: ``(f, Cxy, Pxy)`` with ``Cxy = |Pxy|² / Pxx / Pyy`` as SciPy divides."""
    f, pxx = welch_density(x, win, nperseg)
    _, pyy = welch_density(y, win, nperseg)
    _, pxy = csd_density(x, y, win, nperseg)
    return f, np.abs(pxy) ** 2 / pxx / pyy, pxy


def fftconvolve_same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``scipy.signal.fftconvolve(a, b, mode="same")`` of two real 1-d float arrays longer than one point:
    ``irfftn(rfftn(a) · rfftn(b))`` at SciPy's ``next_fast_len`` of the full length, its centre."""
    import scipy.fft

    shape = a.shape[0] + b.shape[0] - 1
    fshape = [scipy.fft.next_fast_len(shape, True)]
    sp1 = scipy.fft.rfftn(a, fshape, axes=[0])
    sp2 = scipy.fft.rfftn(b, fshape, axes=[0])
    ret = scipy.fft.irfftn(sp1 * sp2, fshape, axes=[0])[:shape]
    start = (shape - a.shape[0]) // 2
    return np.array(ret[start:start + a.shape[0]], copy=True)


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
