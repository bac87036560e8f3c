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

__all__ = ["bimodality_coefficient", "rank_trend"]


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
    from scipy.special import stdtr

    n = y.size
    ranked = np.column_stack((np.arange(1, n + 1, dtype=np.float64), _average_ranks(y)))
    rs = np.corrcoef(ranked, rowvar=False)
    dof = n - 2
    with np.errstate(divide="ignore"):
        t = rs * np.sqrt((dof / ((rs + 1.0) * (1.0 - rs))).clip(0))
    if alternative == "less":
        prob = stdtr(dof, t)
    elif alternative == "greater":
        prob = stdtr(dof, -t)
    elif alternative == "two-sided":
        prob = 2 * stdtr(dof, -np.abs(t))
    else:
        raise ValueError("`alternative` must be 'less', 'greater', or 'two-sided'.")
    return float(rs[1, 0]), float(prob[1, 0])


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


def finite_mean(x: Any) -> float:
    """Mean of the finite entries of *x*; NaN (quietly) when there are none.

    A tensor that got no gradient (all-zero records) has undefined cosines
    everywhere; ``np.nanmean`` would warn "Mean of empty slice" on the user's
    terminal for what the table already shows as NaN.
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan
