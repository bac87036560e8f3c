"""Small statistics more than one analysis uses (each tested once, in ``tests/test_shared_helpers.py``).

* :func:`rank_trend` - Spearman's rank correlation of a series with its position:
  is it rising or falling over the records (drift, saturation, spectral);
* :func:`bimodality_coefficient` - Sarle's bimodality coefficient of a sample
  (oscillation's projections, saturation's unit polarities).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["bimodality_coefficient", "bimodality_coefficients", "rank_trend", "rank_trends"]


def rank_trend(y: Any, *, min_n: int = 3, alternative: str = "two-sided",
               skip_nonfinite: bool = False) -> tuple[float, float]:
    """``(rho, p)``: Spearman's rank correlation of *y* with its position (a monotone trend).

    Parameters
    ----------
    y
        The series, in record (or window) order.
    min_n
        Fewest values for a test; below, ``(nan, nan)``.
    alternative
        ``"two-sided"``, ``"less"`` (a fall) or ``"greater"`` (a rise), as :func:`scipy.stats.spearmanr`.
    skip_nonfinite
        Leave NaN/inf values out (the others keep their positions); by default a
        series holding one gives ``(nan, nan)``.

    A constant series has no trend: ``(nan, nan)``.
    """
    y = np.asarray(y, dtype=float).ravel()
    x = np.arange(y.size)
    ok = np.isfinite(y)
    if skip_nonfinite:
        x, y = x[ok], y[ok]
    elif not ok.all():
        return math.nan, math.nan
    if y.size < max(int(min_n), 2) or np.ptp(y) == 0:
        return math.nan, math.nan
    return _spearman_with_position(y, alternative)


def rank_trends(ys: list[Any], *, min_n: int = 3, alternative: str = "two-sided",
                skip_nonfinite: bool = False) -> list[tuple[float, float]]:
    """``[rank_trend(y, ...) for y in ys]``, each pair bit for bit, with the series of one length tested in one
    stacked pass (the ranks sorted row by row, ``corrcoef``'s arithmetic over the stack: its
    means along each row and its ``dot`` per item, as ``np.matmul`` runs them; the rest elementwise)."""
    out: list[tuple[float, float]] = [(math.nan, math.nan)] * len(ys)
    by_len: dict[int, list[tuple[int, np.ndarray]]] = {}
    for i, y in enumerate(ys):
        y = np.asarray(y, dtype=float).ravel()
        ok = np.isfinite(y)
        if skip_nonfinite:
            y = y[ok]
        elif not ok.all():
            continue
        if y.size < max(int(min_n), 2) or np.ptp(y) == 0:
            continue
        by_len.setdefault(y.size, []).append((i, y))
    for members in by_len.values():
        rho, p = _spearman_stack(np.stack([y for _, y in members]), alternative)
        for (i, _), r, q in zip(members, rho.tolist(), p.tolist(), strict=True):
            out[i] = (r, q)
    return out


def _stack_ranks(Y: np.ndarray) -> np.ndarray:
    """:func:`_average_ranks` of every row of *Y*: rows without ties by one stacked sort, the others one by one."""
    U, n = Y.shape
    j = np.argsort(Y, axis=1, kind="stable")
    s = np.take_along_axis(Y, j, axis=1)
    ties = (s[:, :-1] == s[:, 1:]).any(axis=1)
    out = np.empty((U, n), dtype=np.float64)
    np.put_along_axis(out, j, np.broadcast_to(np.arange(1, n + 1, dtype=np.float64), (U, n)), axis=1)
    for u in np.flatnonzero(ties):
        out[u] = _average_ranks(Y[u])
    return out


def _spearman_stack(Y: np.ndarray, alternative: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_spearman_with_position` of every row of *Y* (finite, non-constant, one length)."""
    U, n = Y.shape
    ranked = np.empty((U, n, 2), dtype=np.float64)          # each item the (n, 2) column stack corrcoef gets
    ranked[:, :, 0] = np.arange(1, n + 1, dtype=np.float64)
    ranked[:, :, 1] = _stack_ranks(Y)
    X = ranked.transpose(0, 2, 1)                            # corrcoef's X = m.T (rowvar=False)
    X = X - X.mean(axis=2)[:, :, None]
    c = np.matmul(X, X.transpose(0, 2, 1))
    c *= np.true_divide(1, n - 1)
    stddev = np.sqrt(np.diagonal(c, axis1=1, axis2=2))
    rs = np.clip(c[:, 1, 0] / stddev[:, 1] / stddev[:, 0], -1, 1)
    return rs, _rank_p(rs, n - 2, alternative)


def _rank_p(rs: np.ndarray, dof: int, alternative: str) -> np.ndarray:
    """The p-values of rank correlations *rs* (elementwise) from their t statistics on *dof* degrees of freedom."""
    from scipy.special import stdtr

    with np.errstate(divide="ignore"):
        t = rs * np.sqrt((dof / ((rs + 1.0) * (1.0 - rs))).clip(0))
    if alternative == "less":
        return np.asarray(stdtr(dof, t))
    if alternative == "greater":
        return np.asarray(stdtr(dof, -t))
    if alternative == "two-sided":
        return np.asarray(2 * stdtr(dof, -np.abs(t)))
    raise ValueError("`alternative` must be 'less', 'greater', or 'two-sided'.")


def _average_ranks(y: np.ndarray) -> np.ndarray:
    """:func:`scipy.stats.rankdata` (``method="average"``) of a finite 1-d array, the same float64 values."""
    j = np.argsort(y, kind="stable")
    s = y[j]
    first = np.concatenate(([True], s[:-1] != s[1:]))
    idx = np.flatnonzero(first)
    counts = np.diff(idx, append=y.size)
    ranks = np.arange(1, y.size + 1, dtype=np.float64)[first] + (counts.astype(np.float64) - 1) / 2
    out = np.empty(y.size, dtype=np.float64)
    out[j] = np.repeat(ranks, counts)
    return out


def _spearman_with_position(y: np.ndarray, alternative: str) -> tuple[float, float]:
    """:func:`scipy.stats.spearmanr` of (position, *y*) for a finite, non-constant *y*: the same
    arithmetic on the same arrays (ranks, ``corrcoef``, the t statistic, ``stdtr``), bit for bit,
    without its per-call argument handling (drift calls it three times per unit)."""
    n = y.size
    ranked = np.column_stack((np.arange(1, n + 1, dtype=np.float64), _average_ranks(y)))
    rs = np.corrcoef(ranked, rowvar=False)
    return float(rs[1, 0]), float(_rank_p(rs, n - 2, alternative)[1, 0])


def bimodality_coefficient(x: Any) -> float:
    """Sarle's bimodality coefficient from the bias-corrected skewness G1 and excess kurtosis G2.

    ``G1 = g1 √(n(n-1)) / (n-2)``, ``G2 = ((n+1) g2 + 6)(n-1) / ((n-2)(n-3))``
    (Joanes & Gill 1998), ``BC = (G1² + 1) / (G2 + 3(n-1)²/((n-2)(n-3)))``: 1/3 for a
    normal sample, 5/9 for a uniform one, towards 1 for two separated modes.  NaN
    below 4 values or for a constant sample.
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    n = x.size
    if n < 4 or np.ptp(x) == 0:
        return math.nan
    d = x - x.mean()
    m2, m3, m4 = (d**2).mean(), (d**3).mean(), (d**4).mean()
    g1, g2 = m3 / m2**1.5, m4 / m2**2 - 3.0
    G1 = g1 * math.sqrt(n * (n - 1)) / (n - 2)
    G2 = ((n + 1) * g2 + 6.0) * (n - 1) / ((n - 2) * (n - 3))
    return float((G1**2 + 1.0) / (G2 + 3.0 * (n - 1) ** 2 / ((n - 2) * (n - 3))))


def bimodality_coefficients(X: Any) -> list[float]:
    """:func:`bimodality_coefficient` of every row of *X* (``(m, n)``), each bit for bit: the centring and the
    three moments are taken over the stack (means along each row of C-contiguous arrays: the 1-d call's
    pairwise sums; the powers elementwise), the last few operations on each row's moments as the
    1-d call does them, on NumPy scalars (a scalar power is not always an array's, in the last bit)."""
    X = np.ascontiguousarray(X, dtype=np.float64)
    m, n = X.shape
    if n < 4 or not m:
        return [math.nan] * m
    d = X - X.mean(axis=1)[:, None]
    m2, m3, m4 = (d**2).mean(axis=1), (d**3).mean(axis=1), (d**4).mean(axis=1)
    flat = np.ptp(X, axis=1) == 0
    return [math.nan if flat[i] else _bc(n, m2[i], m3[i], m4[i]) for i in range(m)]


def _bc(n: int, m2: Any, m3: Any, m4: Any) -> float:
    g1, g2 = m3 / m2**1.5, m4 / m2**2 - 3.0
    G1 = g1 * math.sqrt(n * (n - 1)) / (n - 2)
    G2 = ((n + 1) * g2 + 6.0) * (n - 1) / ((n - 2) * (n - 3))
    return float((G1**2 + 1.0) / (G2 + 3.0 * (n - 1) ** 2 / ((n - 2) * (n - 3))))


def finite_mean(x: Any) -> float:
    """Mean of the finite entries of *x*; NaN (quietly) when there are none.

    A tensor that got no gradient (all-zero records) has undefined cosines
    everywhere; ``np.nanmean`` would warn "Mean of empty slice" on the user's
    terminal for what the table already shows as NaN.
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan
