"""Small statistics more than one analysis uses (tested against SciPy in ``tests/test_shared_helpers.py``).

* :func:`rank_trend` - Spearman's rank correlation of a series with its position:
  is it rising or falling over the records (drift, saturation, spectral);
* :func:`bimodality_coefficient` - Sarle's bimodality coefficient of a sample
  (oscillation's projections, saturation's unit polarities).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["average_ranks", "bimodality_coefficient", "bimodality_coefficients", "finite_mean", "rank_trend", "rank_trends"]


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

    A constant series has no trend: ``(nan, nan)``.  ``rank_trends([y])[0]``.
    """
    return rank_trends([y], min_n=min_n, alternative=alternative, skip_nonfinite=skip_nonfinite)[0]


def rank_trends(ys: list[Any], *, min_n: int = 3, alternative: str = "two-sided",
                skip_nonfinite: bool = False) -> list[tuple[float, float]]:
    """:func:`rank_trend` of every series of *ys*: those of one length (after *skip_nonfinite*) in one stacked pass.

    The statistic is Pearson's correlation of the average ranks (:func:`average_ranks`) with the
    positions' ranks, its p-value the t approximation ``t = ρ √((n-2) / (1-ρ²))`` on ``n - 2`` degrees
    of freedom, as :func:`scipy.stats.spearmanr` computes them (Kendall & Stuart 1979, §31.19).
    """
    if alternative not in ("two-sided", "less", "greater"):
        raise ValueError("`alternative` must be 'less', 'greater', or 'two-sided'.")
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
        rho, p = _spearman_with_position(np.stack([y for _, y in members]), alternative)
        for (i, _), r, q in zip(members, rho.tolist(), p.tolist(), strict=True):
            out[i] = (r, q)
    return out


def _spearman_with_position(Y: np.ndarray, alternative: str) -> tuple[np.ndarray, np.ndarray]:
    """Spearman's ρ of every row of *Y* (finite, non-constant, one length) with its position, and its p-value."""
    from scipy.special import stdtr  # stdtr(df, t) = scipy.stats.t.cdf(t, df)

    n = Y.shape[1]
    ry = average_ranks(Y)
    ry -= (n + 1) / 2.0
    rx = np.arange(1, n + 1, dtype=np.float64) - (n + 1) / 2.0
    rs = np.clip((ry @ rx) / np.sqrt(np.einsum("ij,ij->i", ry, ry) * (rx @ rx)), -1.0, 1.0)
    dof = n - 2
    with np.errstate(divide="ignore", invalid="ignore"):
        t = rs * np.sqrt((dof / ((rs + 1.0) * (1.0 - rs))).clip(0))
    if alternative == "less":
        return rs, np.asarray(stdtr(dof, t))
    if alternative == "greater":
        return rs, np.asarray(stdtr(dof, -t))
    return rs, np.asarray(2 * stdtr(dof, -np.abs(t)))


def average_ranks(Y: np.ndarray) -> np.ndarray:
    """The ranks (1..n) of each row of *Y* (``(m, n)``, finite), ties given their mean rank.

    What :func:`scipy.stats.rankdata` gives with ``method="average"`` along axis 1, computed here with
    one sort of the stack (importing ``scipy.stats`` costs about 0.6 s a process, more than every
    trend test of a pass).
    """
    Y = np.asarray(Y, dtype=np.float64)
    m, n = Y.shape
    order = np.argsort(Y, axis=1, kind="stable")
    s = np.take_along_axis(Y, order, axis=1)
    pos = np.broadcast_to(np.arange(n), (m, n))
    starts = np.ones((m, n), dtype=bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]                   # a tie group begins here
    ends = np.ones((m, n), dtype=bool)
    ends[:, :-1] = starts[:, 1:]                            # ... and ends here
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
    last = np.minimum.accumulate(np.where(ends, pos, n - 1)[:, ::-1], axis=1)[:, ::-1]
    ranks = np.empty((m, n))
    np.put_along_axis(ranks, order, (first + last) / 2.0 + 1.0, axis=1)
    return ranks


def bimodality_coefficient(x: Any) -> float:
    """Sarle's bimodality coefficient from the bias-corrected skewness G1 and excess kurtosis G2.

    ``G1 = g1 √(n(n-1)) / (n-2)``, ``G2 = ((n+1) g2 + 6)(n-1) / ((n-2)(n-3))``
    (Joanes & Gill 1998), ``BC = (G1² + 1) / (G2 + 3(n-1)²/((n-2)(n-3)))``: 1/3 for a
    normal sample, 5/9 for a uniform one, towards 1 for two separated modes.  NaN
    below 4 values or for a constant sample.  ``bimodality_coefficients([x])[0]``.
    """
    return bimodality_coefficients(np.asarray(x, dtype=np.float64).ravel()[None, :])[0]


def bimodality_coefficients(X: Any) -> list[float]:
    """:func:`bimodality_coefficient` of every row of *X* (``(m, n)``)."""
    X = np.asarray(X, dtype=np.float64)
    m, n = X.shape
    if n < 4 or not m:
        return [math.nan] * m
    d = X - X.mean(axis=1)[:, None]
    d2 = d * d
    m2, m3, m4 = d2.mean(axis=1), (d2 * d).mean(axis=1), (d2 * d2).mean(axis=1)
    flat = np.ptp(X, axis=1) == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        g1, g2 = m3 / m2**1.5, m4 / m2**2 - 3.0
        G1 = g1 * math.sqrt(n * (n - 1)) / (n - 2)
        G2 = ((n + 1) * g2 + 6.0) * (n - 1) / ((n - 2) * (n - 3))
        bc = (G1**2 + 1.0) / (G2 + 3.0 * (n - 1) ** 2 / ((n - 2) * (n - 3)))
    return np.where(flat, math.nan, bc).tolist()


def finite_mean(x: Any) -> float:
    """Mean of the finite entries of *x*; NaN (quietly) when there are none.

    A tensor that got no gradient (all-zero records) has undefined cosines
    everywhere; ``np.nanmean`` would warn "Mean of empty slice" on the user's
    terminal for what the table already shows as NaN.
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan
