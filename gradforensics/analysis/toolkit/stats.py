"""Small statistics more than one analysis uses (tested against SciPy in ``tests/test_shared_helpers.py``).

* :func:`rank_trend` - Spearman's rank correlation of a series with its position:
  is it rising or falling over the records (drift, saturation, spectral);
* :func:`bimodality_coefficient` - Sarle's bimodality coefficient of a sample
  (oscillation's projections, saturation's unit polarities);
* :func:`sequential_permutation_test` - Besag & Clifford's sequential Monte-Carlo p-values of
  many one-sided tests at once, each test stopping on its own (conflict's permutation null).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SEQUENTIAL_BLOCKS", "SEQUENTIAL_CELLS", "SequentialNull", "average_ranks", "bimodality_coefficient",
           "bimodality_coefficients", "finite_mean", "rank_trend", "rank_trends", "sequential_permutation_test"]


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


SEQUENTIAL_BLOCKS = (32, 64, 128, 256)
"""Draws per round of :func:`sequential_permutation_test`: 32, 64, 128, then 256 a round (the p-values do not
depend on them, only the draws computed past a test's stop do)."""
SEQUENTIAL_CELLS = 2**20
"""Null statistics (float64) one round holds at most: a round's draws are cut to fit (8 MiB)."""


@dataclass(frozen=True)
class SequentialNull:
    """What :func:`sequential_permutation_test` gives per test (arrays of the tests' length).

    ``p``: the p-value (NaN where the observed statistic is not finite); ``draws``: the finite
    null draws the test used (``L`` where it stopped); ``stopped``: it stopped early, at its
    ``h``-th draw reaching the observed statistic; ``mean``, ``sd``: the null's mean and
    (population) standard deviation over those draws (``sd`` NaN below two draws).
    """

    p: np.ndarray
    draws: np.ndarray
    stopped: np.ndarray
    mean: np.ndarray
    sd: np.ndarray


def sequential_permutation_test(observed: Any, draw: Callable[[np.ndarray, int], np.ndarray], groups: Any, B: int,
                                h: int | None, tie: Any = 0.0, blocks: tuple[int, ...] = SEQUENTIAL_BLOCKS,
                                cells: int = SEQUENTIAL_CELLS) -> SequentialNull:
    """One-sided (lower) Monte-Carlo p-values of many tests, each stopped sequentially (Besag & Clifford 1991).

    Test ``i`` compares its *observed* statistic ``t_i`` with null draws ``t_i1, t_i2, ...``; a draw
    *reaches* it when ``t_ij <= t_i + tie_i``.  Rule: a test stops at the draw ``L < B`` where
    *h* draws have reached it, ``p = h / L``; otherwise it takes all *B* draws and
    ``p = (1 + #{reaching}) / (B + 1)``, the fixed test's p-value (Phipson & Smyth 2010) on the
    same draws.  ``h=None``: every test takes *B* draws (the fixed test).  Non-finite draws are
    left out (``L`` and *B* count the finite ones).

    Valid: under the null the observed statistic and its draws are exchangeable, so its rank among
    them is uniform, and Besag & Clifford's p-value then has ``P(p <= a) <= a`` for every ``a``.
    Each test's p is a function of its own sequence of draws up to its stop only, so tests that
    share draws (the pairs of one unit) may stop at different draws.  Where the h-th reaching
    draw is the B-th, ``(h + 1) / (B + 1) > h / B`` is reported: more conservative, and equal to
    the fixed test's p.

    Vectorised: every test of every group advances together, one round of *blocks* draws at a
    time (fewer where a round would hold more than *cells* values), until all tests of a group
    have stopped.  *groups* (non-decreasing, one per test) names the stream a test's draws come
    from (a unit: its pairs share each permutation); ``draw(active, size)`` returns the next
    *size* draws of the groups *active* (sorted indices into ``unique(groups)``'s positions,
    i.e. the group values), a ``size x m`` array whose columns are the tests of those groups in
    test order.  A group draws only while one of its tests runs, so a seeded stream per group
    gives the same draws, and the same p-values, whatever the rounds.
    """
    obs = np.asarray(observed, dtype=np.float64).ravel()
    grp = np.asarray(groups).ravel()
    if grp.shape != obs.shape or (grp.size and (np.diff(grp) < 0).any()):
        raise ValueError("groups: one per test, non-decreasing")
    thr = obs + np.broadcast_to(np.asarray(tie, dtype=np.float64), obs.shape)
    m = obs.size
    hits = np.zeros(m, dtype=np.int64)
    n = np.zeros(m, dtype=np.int64)
    mean_y = np.zeros(m)                     # null mean and M2 of y = t_ij - t_i (centred on the observed)
    m2 = np.zeros(m)
    stopped = np.zeros(m, dtype=bool)
    live = np.isfinite(obs)
    done, k = 0, 0
    while done < B and live.any():
        active = np.unique(grp[live])
        cols = np.flatnonzero(np.isin(grp, active))
        size = min(blocks[min(k, len(blocks) - 1)], B - done, max(1, cells // max(cols.size, 1)))
        k += 1
        V = np.asarray(draw(active, size), dtype=np.float64)
        if V.shape != (size, cols.size):
            raise ValueError(f"draw returned {V.shape}, expected {(size, cols.size)}")
        lv = live[cols]
        fin = np.isfinite(V) & lv[None, :]
        hit = fin & (thr[cols][None, :] >= V)          # the draw reaches the observed statistic
        last = np.full(cols.size, size - 1)
        stop = np.zeros(cols.size, dtype=bool)
        if h is not None:
            reached = (hits[cols][None, :] + np.cumsum(hit, axis=0) >= h) & hit
            first = np.where(reached.any(axis=0), reached.argmax(axis=0), size)
            stop = lv & (first < size) & (done + first + 1 < B)
            last = np.where(stop, first, last)
        use = fin & (np.arange(size)[:, None] <= last[None, :])
        nb = use.sum(axis=0)
        Y = np.where(use, V - obs[cols][None, :], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mb = np.where(nb > 0, Y.sum(axis=0) / np.maximum(nb, 1), 0.0)
            m2b = np.where(use, (Y - mb[None, :]) ** 2, 0.0).sum(axis=0)
            n0 = n[cols]
            tot = n0 + nb
            delta = mb - mean_y[cols]
            w = np.where(tot > 0, nb / np.maximum(tot, 1), 0.0)
            mean_y[cols] += delta * w                              # Chan et al.'s pairwise merge
            m2[cols] += m2b + delta**2 * n0 * w
        n[cols] = tot
        hits[cols] += (hit & use).sum(axis=0)
        stopped[cols[stop]] = True
        live[cols[stop]] = False
        done += size
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(stopped, hits / np.maximum(n, 1), (1.0 + hits) / (n + 1.0))
        sd = np.where(n > 1, np.sqrt(m2 / np.maximum(n, 1)), np.nan)
    p = np.where(np.isfinite(obs), p, np.nan)
    mean = np.where(n > 0, obs + mean_y, np.nan)
    return SequentialNull(p=p, draws=n, stopped=stopped, mean=mean, sd=sd)
