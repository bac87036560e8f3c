"""The robust steps around the detrender's smoother: the log-time fit, level shifts, median, winsorising.

:func:`~gradforensics.analysis.toolkit.signal.detrending.detrend` removes a cubic in
log-time first (:func:`log_time_fit`, its five candidate bases made once per length:
:func:`log_time_bases`, solved together: :func:`log_time_coefs`), then abrupt level shifts
(:func:`remove_level_shifts`); :func:`winsorize` clips what the smoother leaves so one spike
does not become broadband power; :func:`median` is ``np.median``'s value without its
machinery.  Pure NumPy on 1-d arrays.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from gradforensics.analysis.toolkit.stacked import pinv_stack

__all__ = ["log_time_bases", "log_time_coefs", "log_time_fit", "median", "remove_level_shifts",
           "stacked_log_time_bases", "stacked_log_time_pinv", "winsorize"]


def log_time_fit(y: np.ndarray, degree: int = 3) -> np.ndarray:
    """Least-squares polynomial of *degree* in ``u = log(i + s)`` (i = sample index).

    A training loss falls fastest at the start; in log-time that fall is gentle,
    so a cubic in ``u`` follows a power-law or exponential decay that a
    fixed-window smoother cannot.  The offset ``s`` is the best of
    ``{0.1, 0.3, 1, 3, 10} % of N`` by residual sum of squares.
    """
    n = y.size
    best, best_rss = np.full(n, y.mean()), np.inf
    for basis, coef in zip(log_time_bases(n, degree), log_time_coefs(y, degree)):
        fit = basis @ coef
        rss = float(((y - fit) ** 2).sum())
        if rss < best_rss:
            best, best_rss = fit, rss
    return best


def log_time_coefs(y: np.ndarray, degree: int) -> list[np.ndarray]:
    """``np.linalg.lstsq(basis, y, rcond=None)[0]`` for each basis of :func:`log_time_bases` (to rounding).

    The bases' pseudo-inverses, made once per ``(n, degree)`` (:func:`stacked_log_time_pinv`), times *y*.
    Where that is not finite, the public call per basis (which raises its own error then).
    """
    n = y.size
    if y.ndim == 1 and y.dtype == np.float64:
        with np.errstate(all="ignore"):
            x = stacked_log_time_pinv(n, degree) @ y
        if np.all(np.isfinite(x)):
            return list(x)
    return [np.linalg.lstsq(basis, y, rcond=None)[0] for basis in log_time_bases(n, degree)]


@lru_cache(maxsize=32)
def stacked_log_time_pinv(n: int, degree: int) -> np.ndarray:
    """The pseudo-inverses of :func:`log_time_bases` (``lstsq``'s cutoff), one read-only ``(5, degree + 1, n)`` stack."""
    out = pinv_stack(stacked_log_time_bases(n, degree))
    out.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def stacked_log_time_bases(n: int, degree: int) -> np.ndarray:
    """:func:`log_time_bases` as one read-only ``(5, n, degree + 1)`` stack."""
    out = np.stack(log_time_bases(n, degree))
    out.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def log_time_bases(n: int, degree: int) -> tuple[np.ndarray, ...]:
    """The design matrices of :func:`log_time_fit` for series of *n* points (read-only, shared)."""
    i = np.arange(n, dtype=float)
    out = []
    for frac in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1):
        u = np.log(i + max(frac * n, 1.0))
        basis = np.vander((u - u.mean()) / u.std(), degree + 1)
        basis.setflags(write=False)
        out.append(basis)
    return tuple(out)


def remove_level_shifts(z: np.ndarray, k: int, threshold: float = 8.0,
                        max_shifts: int = 5) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """Remove abrupt level shifts (a learning-rate drop, a resumed run) from *z*.

    ``D_t = mean(z[t:t+k]) − mean(z[t−k:t])``; while ``max |D − median D|`` exceeds
    *threshold* robust standard deviations (1.4826 · MAD) of D, subtract a step
    of size ``D_t`` at its argmax.  Returns the corrected copy and the
    ``(index, size)`` of each shift removed.
    """
    z = np.array(z, dtype=float)
    n = z.size
    shifts: list[tuple[int, float]] = []
    if n < 4 * k:
        return z, shifts
    t = np.arange(k, n - k + 1)
    for _ in range(max_shifts):
        c = np.concatenate([[0.0], np.cumsum(z)])
        d = (c[t + k] - 2 * c[t] + c[t - k]) / k
        dev = np.abs(d - median(d))
        scale = 1.4826 * median(dev)
        j = int(np.argmax(dev))
        if not scale > 0 or dev[j] < threshold * scale:
            break
        z[t[j]:] -= d[j]
        shifts.append((int(t[j]), float(d[j])))
    return z, shifts


def median(a: np.ndarray) -> float:
    """``float(np.median(a))`` of a 1-D float array, bit for bit (NaN when *a* holds one), without
    its general machinery: the middle order statistics by one partition and the mean of the two
    (or of the one) as ``np.median`` takes it (a few microseconds instead of tens, per call)."""
    n = a.size
    if n == 0:
        return float(np.median(a))
    k = n // 2
    lo = k - 1 + n % 2
    part = np.partition(a, (lo, k, -1) if lo != k else (k, -1))
    return float("nan") if np.isnan(part[-1]) else float(np.mean(part[lo:k + 1]))


def winsorize(r: np.ndarray, clip_mad: float) -> tuple[np.ndarray, int]:
    """Clip *r* at ``median ± clip_mad · 1.4826 · MAD``; returns (clipped, count).

    Skipped when the MAD scale is under a quarter of the standard deviation (a
    two-valued or square-wave residual, where the MAD says nothing about outliers).
    """
    if clip_mad <= 0 or r.size == 0:
        return r, 0
    med = median(r)
    scale = 1.4826 * median(np.abs(r - med))
    if not scale > 0.25 * float(np.std(r)):
        return r, 0
    lo, hi = med - clip_mad * scale, med + clip_mad * scale
    n = int(np.count_nonzero((r < lo) | (r > hi)))
    return np.clip(r, lo, hi), n
