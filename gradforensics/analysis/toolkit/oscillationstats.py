"""Oscillation's per-unit statistics: principal directions of a unit's records, their alternation test, poles.

The maths of :mod:`gradforensics.analysis.kinds.oscillation` (its docstring states them and
their references) for one unit, or a slab of units, from the unit's Gram matrix ``K``
(rows in time order) and mixture rows: the centred (replay: source-residualised) ``K``,
its top eigenpairs (:func:`top_components`), the periodogram test of each direction's
scores (stacked over a slab, :func:`periodogram_tests`), then the best direction's
poles, bimodality, ``source_r2`` and the sources at each pole.  The analysis module
tabulates, weighs and flags them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import stacked as st
from gradforensics.analysis.toolkit.stats import bimodality_coefficients, finite_mean

__all__ = ["POLE_SHARE", "Component", "ComponentOptions", "centred", "components", "oscillation_slab", "oscillation_unit",
           "periodogram_test", "periodogram_tests", "source_r2", "top_components", "two_means_split"]

POLE_SHARE = 0.6          # a source "sits at a pole" when it holds this share of the pole's records


class ComponentOptions(Protocol):
    """What the statistics read of the analysis's options: the directions examined, the fewest cycles."""

    @property
    def components(self) -> int: ...

    @property
    def min_cycles(self) -> int: ...


def periodogram_test(x: np.ndarray, min_cycles: int = 3, dof_total: int | None = None) -> tuple[float, float]:
    """Strongest periodic component of *x* with ≥ *min_cycles* cycles: ``(period, p)``.

    Per Fourier frequency ``j/n`` (``min_cycles ≤ j ≤ n/2``), ``I_j / SS`` is
    ``Beta(d/2, (n-1-d)/2)`` for i.i.d. Gaussian *x* (``SS`` = centred sum of
    squares, ``d`` = 2, 1 at Nyquist); p is the smallest tail probability times
    the number of frequencies tested (Bonferroni).  *dof_total* is the degrees of
    freedom of ``SS`` (``n - 1`` for centred records; ``n - S`` after removing S
    source means).  A quadratic trend in time is removed first (two more degrees
    of freedom): a slowly turning mean gradient scores as a smooth ramp whose
    spectral leakage would otherwise reach ``min_cycles`` cycles (drift's business).
    """
    period, p = periodogram_tests(np.asarray(x, dtype=np.float64)[None, :], min_cycles, dof_total)
    return float(period[0]), float(p[0])


def periodogram_tests(X: np.ndarray, min_cycles: int = 3, dof_total: int | None = None,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`periodogram_test` of every row of *X* (``(m, n)``): ``(periods, ps)``, each row's floats those of
    the call on that row alone (the stacked means, least squares, dots and FFT of
    :mod:`~gradforensics.analysis.toolkit.stacked`; the rest is elementwise)."""
    from scipy.special import betaincc  # = scipy.stats.beta.sf(x, a, b), bit for bit, without its per-call checks

    X = np.ascontiguousarray(X, dtype=np.float64)
    m, n = X.shape
    nan = np.full(m, math.nan)
    nu = (n - 1 if dof_total is None else int(dof_total)) - 2
    T, j, dof = _periodogram_design(n, int(min_cycles))
    xc = X - st.row_means(X)[:, None]
    if n >= 8:
        xc = xc - st.matvec_each(T, st.lstsq_each(T, xc))
    ss = st.row_dots(xc)
    if n < 8 or j.size == 0 or not m:
        return nan, nan.copy()
    F = np.fft.rfft(xc, axis=-1)
    power = np.abs(F[:, j]) ** 2
    power = np.where(dof == 1.0, power, 2.0 * power) / n      # share of SS carried by each frequency
    ok = ~(ss <= 0)                  # the single call goes on with a NaN sum of squares
    share = np.clip(power / np.where(ok, ss, 1.0)[:, None], 0.0, 1.0)
    tail = betaincc(dof / 2.0, np.maximum(nu - dof, 1.0) / 2.0, share)
    best = np.argmin(tail, axis=1)
    period = np.where(ok, n / j[best].astype(np.float64), math.nan)
    low = tail[np.arange(m), best] * j.size
    p = np.where(ok, np.where(low < 1.0, low, 1.0), math.nan)        # min(1.0, low), NaN to 1.0 as min() does
    return period, p


@functools.lru_cache(maxsize=64)
def _periodogram_design(n: int, min_cycles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`periodogram_test` needs of the length alone, built once per ``(n, min_cycles)`` (read-only):
    the quadratic trend's design ``T``, the tested frequencies ``j`` and their degrees of freedom."""
    t = np.linspace(-1.0, 1.0, n)
    T = np.c_[t, t * t - (t * t).mean()]
    j = np.arange(min_cycles, n // 2 + 1)
    dof = np.where(2 * j == n, 1.0, 2.0)
    for a in (T, j, dof):
        a.flags.writeable = False
    return T, j, dof


def two_means_split(x: np.ndarray) -> np.ndarray:
    """Boolean mask of the upper group of the optimal 1-D two-group split (max between-group SS)."""
    order = np.argsort(x)
    xs = x[order]
    n = xs.size
    c = np.cumsum(xs)
    k = np.arange(1, n)
    m1, m2 = c[:-1] / k, (c[-1] - c[:-1]) / (n - k)
    between = k * (n - k) * (m1 - m2) ** 2
    cut = int(np.argmax(between)) + 1
    upper = np.zeros(n, bool)
    upper[order[cut:]] = True
    return upper


def source_r2(scores: np.ndarray, mixture: np.ndarray) -> float:
    """R² of the scores regressed on the source mixture (least squares, sums to one: intercept included)."""
    return _source_r2(scores, ks.shared_fit(mixture), {})


def _source_r2(scores: np.ndarray, fit: ks.SourceFit, hats: dict[int, np.ndarray]) -> float:
    """:func:`source_r2` of the mixture *fit* was fitted to (*hats*: ``fit.hat`` by the fit's id, each formed
    once a slab: the slab holds each fit)."""
    if fit.index.size < 2:
        return 0.0
    hat = hats.get(id(fit))
    if hat is None:
        hat = hats[id(fit)] = fit.hat
    resid = scores - hat @ scores
    sc = scores - _mean(scores)
    ss = sc @ sc
    return float(max(0.0, 1.0 - (resid @ resid) / ss)) if ss > 0 else math.nan


def _pole_sources(mixture: np.ndarray, mask: np.ndarray, names: tuple[str, ...], idx: np.ndarray) -> str:
    """Sources holding ≥ POLE_SHARE of a pole's records, ';'-joined ('' if none)."""
    if not mask.any():
        return ""
    pole = mixture[mask]
    share = np.add.reduce(pole, axis=0) / pole.shape[0]          # = pole.mean(axis=0)
    return ";".join(names[i] for i in idx if share[i] >= POLE_SHARE)


@dataclass
class Component:
    k: int
    lam: float
    scores: np.ndarray
    proj: np.ndarray
    period: float
    p: float


def components(Kp: np.ndarray, K: np.ndarray, n_comp: int, min_cycles: int, dof_total: int) -> list[Component]:
    """Top principal directions of *Kp* (a centred K) with their alternation test.

    *K* (uncentred) gives the records' projections ``(K u) / √λ`` on each direction.
    """
    part = _principal(Kp, K, n_comp)
    return _tested(part, *periodogram_tests(part.scores, min_cycles, dof_total)) if part.kept else []


@dataclass
class _Principal:
    """A unit's kept principal directions before their periodogram tests (scores stacked ``(k, n)``)."""

    kept: list[int]
    lam: np.ndarray
    scores: np.ndarray
    proj: list[np.ndarray]
    trace: Any = 0.0            # np.trace of the centred K (the floor of the kept directions, the explained share)


def _principal(Kp: np.ndarray, K: np.ndarray, n_comp: int) -> _Principal:
    lam, U = top_components(Kp, n_comp)
    trace = np.trace(Kp)
    floor = 1e-12 * max(trace, 1e-300)
    kept = [k for k in range(lam.size) if not lam[k] <= floor]
    scores = np.stack([U[:, k] * math.sqrt(lam[k]) for k in kept]) if kept else np.zeros((0, Kp.shape[0]))
    return _Principal(kept, lam, scores, [K @ U[:, k] / math.sqrt(lam[k]) for k in kept], trace)


def _mean(x: np.ndarray) -> Any:
    """``x.mean()`` of a non-empty float64 array, bit for bit (the sum ``mean`` divides by the count), without
    its per-call bookkeeping."""
    return np.add.reduce(x, axis=None) / x.size


def centred(K: np.ndarray) -> np.ndarray:
    """:func:`~gradforensics.analysis.toolkit.kspace.centred` (``H K H``) of a 2-d float64 *K*, bit for bit: the
    column means and the mean as the sums ``mean`` divides (``np.add.reduce`` over the count), the three
    elementwise steps in place into one new array, in the same order."""
    if not (isinstance(K, np.ndarray) and K.ndim == 2 and K.dtype == np.float64 and K.size):
        return ks.centred(K)
    r = np.add.reduce(K, axis=0) / K.shape[0]
    m = np.add.reduce(K, axis=None) / K.size
    out = np.subtract(K, r[None, :])
    out -= r[:, None]
    out += m
    return out


def top_components(Kc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~gradforensics.analysis.toolkit.kspace.top_components`, bit for bit: below its Lanczos size its dense
    ``eigh`` made by :func:`~gradforensics.analysis.toolkit.stacked.eigh_top` (the same LAPACK call without the
    wrapper's per-call work), the rest the same steps; at the Lanczos size, that function itself."""
    n = Kc.shape[0]
    k = max(1, min(k, n))
    if n >= ks.LANCZOS_MIN and k < n // 4:
        return ks.top_components(Kc, k)
    S = Kc + Kc.T
    S /= 2.0                                       # (Kc + Kc.T) / 2.0, in place
    got = st.syevr_top(S.T, k, overwrite=True)     # S.T is S (a + b = b + a), Fortran-ordered: LAPACK works in it
    if got is None:                                # spent; SciPy's eigh of it again says why (or copes)
        S = Kc + Kc.T
        S /= 2.0
        got = st.eigh_top(S, k)
    lam, U = got
    lam, U = lam[::-1], U[:, ::-1]
    s = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])])
    return np.maximum(lam, 0.0), U * np.where(s == 0, 1.0, s)


def _tested(part: _Principal, period: np.ndarray, p: np.ndarray) -> list[Component]:
    return [Component(k, float(part.lam[k]), part.scores[i], part.proj[i], float(period[i]), float(p[i]))
            for i, k in enumerate(part.kept)]


def oscillation_unit(K: np.ndarray, mixture: np.ndarray, replay: bool, opts: ComponentOptions,
                     names: tuple[str, ...]) -> tuple[dict[str, Any], Component | None]:
    """Oscillation statistics of one unit (K and mixture rows in time order)."""
    cc = ks.consecutive_cosines(K) if K.shape[0] > 1 else None
    return oscillation_slab([(K, mixture, cc)], replay, opts, names)[0]


@dataclass
class _Started:
    """One unit of a slab between its eigendecomposition and its periodogram tests."""

    row: dict[str, Any]
    Kp: np.ndarray | None = None
    fit: ks.SourceFit | None = None
    dof: int = 0
    part: _Principal | None = None


def oscillation_slab(slab: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], replay: bool,
                      opts: ComponentOptions, names: tuple[str, ...],
                      ) -> list[tuple[dict[str, Any], Component | None]]:
    """:func:`oscillation_unit` of every ``(K, mixture, consecutive cosines)`` of *slab*: the periodogram tests of
    all units with the same record count and degrees of freedom in one :func:`periodogram_tests` call (each
    row's floats its own call's), the rest unit by unit."""
    ranks: dict[int, int] = {}
    started = [_start(K, mix, replay, opts, cc, ranks) for K, mix, cc in slab]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(started):
        if s.part is not None and s.part.kept:
            groups.setdefault((s.part.scores.shape[1], s.dof), []).append(i)
    tested: dict[int, list[Component]] = {}
    for (_, dof), members in groups.items():
        period, p = periodogram_tests(np.concatenate([started[i].part.scores for i in members]),  # type: ignore[union-attr]
                                      opts.min_cycles, dof)
        at = 0
        for i in members:
            part = started[i].part
            assert part is not None
            k = len(part.kept)
            tested[i] = _tested(part, period[at:at + k], p[at:at + k])
            at += k
    chosen = {i: [c for c in comps if np.isfinite(c.p)] for i, comps in tested.items()}
    best = {i: min(comps, key=lambda c: c.p) for i, comps in chosen.items() if comps}
    by_n: dict[int, list[int]] = {}
    for i, b in best.items():
        by_n.setdefault(b.scores.size, []).append(i)
    bc: dict[int, float] = {}
    for members in by_n.values():            # the bimodality of every unit's best direction, one stack per length
        for i, v in zip(members, bimodality_coefficients(np.stack([best[i].scores for i in members])),
                        strict=True):
            bc[i] = v
    hats: dict[int, np.ndarray] = {}
    return [_finish(s, mix, names, chosen[i], best[i], bc[i], hats) if i in best else (s.row, None)
            for i, (s, (_, mix, _)) in enumerate(zip(started, slab))]


def _start(K: np.ndarray, mixture: np.ndarray, replay: bool, opts: ComponentOptions,
           cc: np.ndarray | None, ranks: dict[int, int]) -> _Started:
    n = K.shape[0]
    out = _Started({"n_records": n, "consec_cos": finite_mean(cc) if cc is not None else math.nan})
    if n < 8:
        return out
    fit = ks.shared_fit(mixture)          # the same rows for a tensor's heads: fitted once
    residualise = replay and fit.index.size >= 1
    out.Kp = ks.residual_gram(K, fit) if residualise else centred(K)
    out.fit = fit
    out.dof = n - (_rank(fit, ranks) if residualise else 1)
    out.part = _principal(out.Kp, K, opts.components)
    return out


def _rank(fit: ks.SourceFit, ranks: dict[int, int]) -> int:
    """``np.linalg.matrix_rank(fit.A)``, once per fit of a slab (*ranks*, by the fit's id: the slab holds each fit)."""
    got = ranks.get(id(fit))
    if got is None:
        got = ranks[id(fit)] = int(np.linalg.matrix_rank(fit.A))
    return got


def _finish(s: _Started, mixture: np.ndarray, names: tuple[str, ...], comps: list[Component], best: Component,
            bc: float, hats: dict[int, np.ndarray]) -> tuple[dict[str, Any], Component | None]:
    """The row of a unit whose best direction *best* (of its tested *comps*) has bimodality coefficient *bc*."""
    row = s.row
    assert s.Kp is not None and s.fit is not None and s.part is not None
    fit = s.fit
    upper = two_means_split(best.scores)
    mu_pos, mu_neg = float(_mean(best.proj[upper])), float(_mean(best.proj[~upper]))
    if mu_pos < mu_neg:
        mu_pos, mu_neg, upper = mu_neg, mu_pos, ~upper
    rev = min(abs(mu_pos), abs(mu_neg)) / max(abs(mu_pos), abs(mu_neg), 1e-300) if mu_pos > 0 > mu_neg else 0.0
    row.update(component=best.k + 1, explained=best.lam / max(float(s.part.trace), 1e-300), energy=best.lam,
               period_records=best.period, p_value=min(1.0, best.p * len(comps)),
               bimodality_coefficient=bc, pole_pos=mu_pos, pole_neg=mu_neg,
               reversal=rev, source_r2=_source_r2(best.scores, fit, hats),
               sources_pos=_pole_sources(mixture, upper, names, fit.index),
               sources_neg=_pole_sources(mixture, ~upper, names, fit.index))
    return row, best
