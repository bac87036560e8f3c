"""Detrending a loss curve with linear filters of known power gain.

A training loss falls fast, then slowly; abrupt level shifts (a learning-rate
drop, a resumed run) and single spikes ride on it.  :func:`detrend_many` removes
the trend of a stack of series of one length in three steps: a cubic in log-time
(:func:`~gradforensics.analysis.toolkit.signal.trend.log_time_fit`), the level shifts
(:func:`~gradforensics.analysis.toolkit.signal.trend.remove_level_shifts`) and a
Savitzky–Golay high-pass (:func:`savgol_smooth`) whose power gain ``G(f)`` is known exactly
(:class:`Detrended`), so the red-noise background can be passed through the
same filter (:mod:`~gradforensics.analysis.toolkit.signal.background`); :func:`detrend` is
one series.  :func:`~gradforensics.analysis.toolkit.signal.trend.winsorize` clips what is
left so one spike does not become broadband power.

References
----------
Savitzky, A. & Golay, M. J. E. (1964). Anal. Chem. 36, 1627–1639; Schafer, R. W.
    (2011). What is a Savitzky–Golay filter? IEEE Signal Process. Mag. 28, 111–117.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from gradforensics.analysis.toolkit.signal.trend import log_time_fit, remove_level_shifts, winsorize
from gradforensics.errors import SpecError

__all__ = ["DETRENDERS", "DetrendCache", "Detrended", "default_nperseg", "detrend", "detrend_many", "savgol_coeffs",
           "savgol_smooth", "savgol_window"]


DETRENDERS = ("savgol", "diff")


@dataclass(frozen=True)
class Detrended:
    """The residual of a linear detrending filter and its power gain.

    ``residual[i]`` sits at sample ``i + offset`` of the input (``offset`` is 1 for
    a first difference).  :meth:`gain` is ``|1 - H(f)|²`` for a smoother ``H``
    (or ``|1 - e^{-2πif}|²`` for the difference), f in cycles per sample.
    """

    residual: np.ndarray
    trend: np.ndarray
    method: str
    window: int
    offset: int
    coeffs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    shifts: tuple[tuple[int, float], ...] = ()

    def gain_grid(self, m: int) -> np.ndarray:
        """:meth:`gain` at ``f = j/m, j = 0..m/2`` (by FFT of the smoother's kernel)."""
        if self.method == "diff":
            return self.gain(np.arange(m // 2 + 1) / m)
        half = (self.coeffs.size - 1) // 2
        h = np.zeros(m)
        h[: half + 1] = self.coeffs[half:]
        h[m - half:] = self.coeffs[:half]
        return (1.0 - np.fft.rfft(h).real) ** 2

    def gain(self, f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=float)
        if self.method == "diff":
            return 2.0 - 2.0 * np.cos(2 * np.pi * f)
        half = (self.coeffs.size - 1) // 2
        if half * f.size > 1 << 22:  # long kernels: the FFT grid, 64 points per 1/w, interpolated
            m = 1 << int(np.ceil(np.log2(max(128 * half, 1 << 16))))
            return np.interp(np.abs(f) % 1.0, np.arange(m // 2 + 1) / m, self.gain_grid(m))
        k = np.arange(1, half + 1)
        h = self.coeffs[half] + 2.0 * np.cos(2 * np.pi * np.multiply.outer(f, k)) @ self.coeffs[half + 1:]
        return (1.0 - h) ** 2


def default_nperseg(n: int) -> int:
    """Largest power of two ≤ n/8, at least 16 (and at most n)."""
    return int(min(n, max(16, 2 ** int(np.floor(np.log2(max(n / 8, 1)))))))


def detrend(y: np.ndarray, method: str = "savgol", window: int | None = None) -> Detrended:
    """Remove the slow trend of *y* with a linear filter of known gain (:func:`detrend_many` of one series).

    Parameters
    ----------
    y
        Uniformly sampled, finite values.
    method
        ``"savgol"``: ``y - savgol_filter(y, window, 3)`` (edges by polynomial fit);
        ``"diff"``: ``y[1:] - y[:-1]``.
    window
        Savitzky–Golay window (odd; default ``2 * default_nperseg(len(y)) + 1``,
        capped at the largest odd number ≤ len(y)).
    """
    return detrend_many([y], method, window)[0]


def detrend_many(ys: list[np.ndarray], method: str = "savgol", window: int | None = None) -> list[Detrended]:
    """:func:`detrend` of every series of *ys*, the series of one length smoothed as one stack."""
    arrs = [np.asarray(y, dtype=float) for y in ys]
    if method == "diff":
        return [Detrended(np.diff(y), y[:-1], "diff", 0, 1) for y in arrs]
    if method != "savgol":
        raise SpecError(f"detrend: method must be one of {DETRENDERS}; got {method!r}.")
    out: list[Detrended | None] = [None] * len(arrs)
    by_size: dict[int, list[int]] = {}
    for i, y in enumerate(arrs):
        by_size.setdefault(y.size, []).append(i)
    for n, idx in by_size.items():
        w = savgol_window(n, window)
        Y = np.stack([arrs[i] for i in idx])
        base = log_time_fit(Y)
        parts = [remove_level_shifts(y - b, max(8, w // 8)) for y, b in zip(Y, base)]
        Z = np.stack([z for z, _ in parts])
        R = Z - savgol_smooth(Z, w)
        coeffs = savgol_coeffs(w)
        for i, y, r, (_, shifts) in zip(idx, Y, R, parts):
            out[i] = Detrended(r, y - r, "savgol", w, 0, coeffs, tuple(shifts))
    return [d for d in out if d is not None]


def savgol_window(n: int, window: int | None = None) -> int:
    """The Savitzky–Golay window :func:`detrend` uses on *n* points: *window* (default
    ``2 * default_nperseg(n) + 1``) made odd and capped at the largest odd number ≤ n."""
    w = 2 * default_nperseg(n) + 1 if window is None else int(window)
    w = min(w | 1, n if n % 2 else n - 1)
    if w < 5:
        raise SpecError(f"detrend: need at least 5 points for a Savitzky–Golay window; got {n}.")
    return w


@lru_cache(maxsize=64)
def _cubic_fit(w: int) -> tuple[np.ndarray, np.ndarray]:
    """The cubic least-squares fit on *w* points as two factors ``(V, P)``: ``V @ (P @ z)`` is the fitted
    cubic at each point (``V`` the Vandermonde matrix on ``[−1, 1]``, ``P`` its pseudo-inverse; read-only)."""
    u = np.linspace(-1.0, 1.0, int(w))
    V = np.vander(u, 4, increasing=True)
    P = np.linalg.pinv(V)
    V.setflags(write=False)
    P.setflags(write=False)
    return V, P


@lru_cache(maxsize=64)
def savgol_coeffs(w: int) -> np.ndarray:
    """The cubic Savitzky–Golay smoothing coefficients of an odd window *w* > 3: the weights giving the
    least-squares cubic's value at the centre (``scipy.signal.savgol_coeffs(w, 3)``; read-only)."""
    V, P = _cubic_fit(w)
    c = np.array(V[int(w) // 2] @ P)
    c.setflags(write=False)
    return c


def savgol_smooth(Z: np.ndarray, w: int) -> np.ndarray:
    """The cubic Savitzky–Golay smooth of window *w* of each row of *Z* (``(..., n)``, ``n >= w``), edges by the
    cubic fitted to the first and last *w* samples (``scipy.signal.savgol_filter(z, w, 3, mode="interp")``).

    The interior is one FFT convolution of the whole stack (``O(n log n)`` a row, any window)."""
    Z = np.asarray(Z, dtype=np.float64)
    n, w = Z.shape[-1], int(w)
    half = w // 2
    m = 1 << int(np.ceil(np.log2(n + w - 1)))
    out = np.fft.irfft(np.fft.rfft(Z, m, axis=-1) * np.fft.rfft(savgol_coeffs(w), m), m, axis=-1)[..., half:half + n]
    V, P = _cubic_fit(w)
    out[..., :half] = (Z[..., :w] @ P.T) @ V[:half].T
    out[..., n - half:] = (Z[..., n - w:] @ P.T) @ V[w - half:].T
    return out


class DetrendCache:
    """Each series' :func:`detrend` and :func:`winsorize`, computed once for every analysis of a run.

    ``loss_spectrum`` and ``fractal`` detrend the same series with the same filter
    whenever their windows agree (every series of 32 to 67 points at the default options: both
    windows are then 2·16 + 1, capped at the series' length), and winsorise it at the same
    ``clip_mad``.  :meth:`get` returns what the direct calls return (it *is* those calls, made once); the arrays it
    hands out are read-only, so no analysis can change what the next one reads.

    Only read-only series are remembered (the run's shared series,
    :func:`~gradforensics.analysis.toolkit.series.shared_series`): a writable array could
    change between two calls.  A series is known by its array's identity (the entry keeps
    the array, so the identity cannot be reused) and the filter's effective parameters.
    At most *max_bytes* of arrays are held (residual, trend, clipped residual and the
    filter's coefficients, counted per entry); past it a series is detrended again by each
    analysis, as without the cache.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self.hits = 0
        self._entries: dict[tuple[int, str, int, float], tuple[np.ndarray, Detrended, np.ndarray, int]] = {}

    def get(self, y: np.ndarray, method: str, window: int | None, clip_mad: float
            ) -> tuple[Detrended, np.ndarray, int]:
        """``det = detrend(y, method, window)`` and ``winsorize(det.residual, clip_mad)``: ``(det, r, n_clipped)``."""
        src, y = y, np.asarray(y, dtype=float)          # known by the caller's array (asarray may copy)
        w = 0 if method == "diff" else savgol_window(y.size, window) if method == "savgol" else -1
        key = (id(src), method, w, float(clip_mad))
        got = self._entries.get(key)
        if got is not None and got[0] is src:
            self.hits += 1
            return got[1], got[2], got[3]
        return self._remember(key, src, detrend(y, method, window), clip_mad)

    def get_many(self, ys: list[np.ndarray], method: str, window: int | None, clip_mad: float
                 ) -> list[tuple[Detrended, np.ndarray, int]]:
        """``[self.get(y, method, window, clip_mad) for y in ys]``, the series not yet known detrended
        together (:func:`detrend_many`)."""
        out: list[tuple[Detrended, np.ndarray, int] | None] = [None] * len(ys)
        todo: dict[int, list[int]] = {}
        for i, src in enumerate(ys):
            y = np.asarray(src, dtype=float)
            w = 0 if method == "diff" else savgol_window(y.size, window) if method == "savgol" else -1
            key = (id(src), method, w, float(clip_mad))
            got = self._entries.get(key)
            if got is not None and got[0] is src:
                self.hits += 1
                out[i] = (got[1], got[2], got[3])
            else:
                todo.setdefault(y.size if y.ndim == 1 else -1 - i, []).append(i)
        for idx in todo.values():
            dets = detrend_many([ys[i] for i in idx], method, window)
            for i, det in zip(idx, dets):
                y = np.asarray(ys[i], dtype=float)
                w = 0 if method == "diff" else savgol_window(y.size, window) if method == "savgol" else -1
                out[i] = self._remember((id(ys[i]), method, w, float(clip_mad)), ys[i], det, clip_mad)
        return [o for o in out if o is not None]

    def _remember(self, key: tuple[int, str, int, float], src: Any, det: Detrended, clip_mad: float
                  ) -> tuple[Detrended, np.ndarray, int]:
        r, n = winsorize(det.residual, clip_mad)
        if isinstance(src, np.ndarray) and _immutable(src):           # y: src itself or a private copy
            size = sum(a.nbytes for a in {id(a): a for a in (det.residual, det.trend, det.coeffs, r)}.values())
            if self.nbytes + size <= self.max_bytes:
                det, r = _read_only(det, r)
                self._entries[key] = (src, det, r, n)
                self.nbytes += size
        return det, r, n


def _immutable(a: np.ndarray) -> bool:
    """*a* and every array it is a view of are read-only (bytes below them count as read-only)."""
    obj: Any = a
    while isinstance(obj, np.ndarray):
        if obj.flags.writeable:
            return False
        obj = obj.base
    return obj is None or isinstance(obj, bytes)


def _read_only(det: Detrended, r: np.ndarray) -> tuple[Detrended, np.ndarray]:
    for a in (det.residual, det.trend, det.coeffs, r):
        a.setflags(write=False)
    return det, r
