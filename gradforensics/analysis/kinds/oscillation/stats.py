"""Oscillation's statistics: principal directions of a unit's records, their alternation test, poles; the band test.

The maths of :mod:`gradforensics.analysis.kinds.oscillation` (its docstring states them and
their references) for a slab of units, from each unit's Gram matrix ``K`` (rows in time
order) and mixture rows: the centred (replay: source-residualised) ``K``
(:func:`centred`, :func:`residual_gram`), its top eigenpairs (:func:`top_components`), the
periodogram test of each direction's scores (every unit of a slab at once,
:func:`periodogram_tests`), then the best direction's poles, bimodality, ``source_r2`` and
the sources at each pole (:func:`oscillation_slab`).  Long histories: the windowed band
test of :func:`band_oscillation`.  The analysis module tabulates, weighs and flags them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gradforensics.analysis.contract.grams import WindowMoments
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit.stats import bimodality_coefficients, finite_mean

__all__ = ["LANCZOS_MIN", "POLE_SHARE", "Component", "ComponentOptions", "band_oscillation", "centred",
           "consecutive_cosines", "noise_tests", "oscillation_slab", "periodogram_tests", "residual_gram", "top_components",
           "two_means_split"]

POLE_SHARE = 0.6          # a source "sits at a pole" when it holds this share of the pole's records
LANCZOS_MIN = 768         # records from which the top eigenpairs come from Lanczos (eigsh), not a dense eigh


class ComponentOptions(Protocol):
    """What the statistics read of the analysis's options: the directions examined, the fewest cycles."""

    @property
    def components(self) -> int: ...

    @property
    def min_cycles(self) -> int: ...


# ------------------------------------------------------------------ K algebra
def consecutive_cosines(K: np.ndarray) -> np.ndarray:
    """``cos(g_i, g_{i+1})`` for consecutive rows of K (length N-1)."""
    d = np.sqrt(np.maximum(np.diag(K), 0.0))
    return ks.safe_div(np.diag(K, 1), d[:-1] * d[1:])


def centred(K: np.ndarray) -> np.ndarray:
    """``H K H`` with ``H = I - 11ᵀ/N``: the Gram matrix of the centred records."""
    r = K.sum(axis=0) / K.shape[0]
    out = K - r[None, :]
    out -= r[:, None]
    out += r.sum() / K.shape[0]
    return out


def residual_gram(K: np.ndarray, fit: ks.SourceFit) -> np.ndarray:
    """Gram matrix of the records with their source means removed: ``E K E``, ``E = I - A C``.

    Costs O(N² S) (never forms E K E by N×N products).
    """
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    ACK = A @ CK
    return K - ACK - ACK.T + A @ G @ A.T


def top_components(Kc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-*k* eigenpairs of a (centred) Gram matrix, largest first: ``(lam, U)``.

    The scores of the records on component j are ``U[:, j] * sqrt(lam[j])`` (kernel PCA,
    linear kernel).  Dense LAPACK ``dsyevr`` (the top *k* only: ``scipy.linalg.eigh(S,
    subset_by_index=(n - k, n - 1))`` without the wrapper's per-call work, which is a sixth of
    the unit's cost at 64 records) below :data:`LANCZOS_MIN` records, Lanczos (``eigsh``, seeded
    start vector) above.  Each eigenvector's largest-magnitude entry is positive.
    """
    n = Kc.shape[0]
    k = max(1, min(k, n))
    S = Kc + Kc.T
    S /= 2.0
    if n >= LANCZOS_MIN and k < n // 4:
        from scipy.sparse.linalg import eigsh

        lam, U = eigsh(S, k=k, which="LA", v0=np.random.default_rng(0).standard_normal(n), tol=1e-8)
        order = np.argsort(lam)
        lam, U = lam[order], U[:, order]
    else:
        lam, U = _syevr_top(S.T, k)               # S.T is S (symmetric), Fortran-ordered: LAPACK works in it
    lam, U = lam[::-1], U[:, ::-1]
    s = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])])
    return np.maximum(lam, 0.0), U * np.where(s == 0, 1.0, s)


def _syevr_top(S: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top *k* eigenpairs of a finite symmetric float64 *S* (spent), ascending, by ``scipy.linalg.lapack.dsyevr``."""
    from scipy.linalg import lapack

    n = S.shape[0]
    if not np.isfinite(S).all():
        raise ValueError("top_components: the Gram matrix holds a non-finite value.")
    lwork, liwork = _syevr_work(n)
    w, v, m, _, info = lapack.dsyevr(S, compute_v=1, range="I", il=n - k + 1, iu=n, lower=1, overwrite_a=1,
                                     lwork=lwork, liwork=liwork)
    if info != 0:
        raise np.linalg.LinAlgError(f"top_components: LAPACK dsyevr failed (info = {info}).")
    return w[:m], v[:, :m]


@functools.lru_cache(maxsize=16)
def _syevr_work(n: int) -> tuple[int, int]:
    """The optimal workspace sizes of ``dsyevr`` for an ``n × n`` matrix (``scipy.linalg.lapack.dsyevr_lwork``)."""
    from scipy.linalg import lapack

    lwork, liwork, info = lapack.dsyevr_lwork(n, lower=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"dsyevr_lwork failed (info = {info}).")
    return max(math.ceil(lwork), 26 * n, 1), max(int(liwork), 10 * n, 1)


# ----------------------------------------------------------- periodogram test
def periodogram_tests(X: np.ndarray, min_cycles: int = 3, dof_total: int | None = None, noise: bool = False,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Strongest periodic component of every row of *X* (``(m, n)``) with ≥ *min_cycles* cycles: ``(periods, ps)``.

    Per Fourier frequency ``j/n`` (``min_cycles ≤ j ≤ n/2``), ``I_j / SS`` is
    ``Beta(d/2, (n-1-d)/2)`` for i.i.d. Gaussian *x* (``SS`` = centred sum of
    squares, ``d`` = 2, 1 at Nyquist); p is the smallest tail probability times
    the number of frequencies tested (Bonferroni).  *dof_total* is the degrees of
    freedom of ``SS`` (``n - 1`` for centred records; ``n - S`` after removing S
    source means).  A quadratic trend in time is removed first (two more degrees
    of freedom): a slowly turning mean gradient scores as a smooth ramp whose
    spectral leakage would otherwise reach ``min_cycles`` cycles (drift's business).

    ``noise=True`` tests against what healthy training noise shows instead of white noise
    (:func:`noise_tests`): a flip (consecutive values reversing) beyond the batch-noise
    baseline, a slower period above the continuum of its neighbouring frequencies.
    Rows of fewer than 8 values, or with no frequency to test: NaN.
    """
    from scipy.special import betaincc  # betaincc(a, b, x) = scipy.stats.beta.sf(x, a, b)

    X = np.asarray(X, dtype=np.float64)
    m, n = X.shape
    Q, j, dof = _periodogram_design(n, int(min_cycles))
    if n < 8 or j.size == 0 or not m:
        return np.full(m, math.nan), np.full(m, math.nan)
    xc = X - (X @ Q) @ Q.T                       # the mean and the quadratic trend removed
    ordinates = _ordinates(xc)                   # (m, n//2): d_k |F_k|^2 / n, summing to SS
    nu = (n - 1 if dof_total is None else int(dof_total)) - 2
    ok = ordinates.sum(axis=1) > 0
    if noise:
        period, p = noise_tests(xc, ordinates, j, dof, nu)
        return np.where(ok, period, math.nan), np.where(ok, p, math.nan)
    ss = ordinates.sum(axis=1)
    share = np.clip(ordinates[:, j - 1] / np.where(ss > 0, ss, 1.0)[:, None], 0.0, 1.0)
    tail = betaincc(dof / 2.0, np.maximum(nu - dof, 1.0) / 2.0, share)
    best = np.argmin(tail, axis=1)
    period = np.where(ok, n / j[best].astype(np.float64), math.nan)
    p = np.where(ok, np.minimum(tail[np.arange(m), best] * j.size, 1.0), math.nan)
    return period, p


def _ordinates(xc: np.ndarray) -> np.ndarray:
    """``d_k |F_k|² / n`` of Fourier frequencies ``k = 1 .. n//2`` of zero-mean rows (they sum to the rows' sum of
    squares, Parseval; ``d_k`` = 2, 1 at Nyquist)."""
    n = xc.shape[1]
    F = np.abs(np.fft.rfft(xc, axis=-1)[:, 1:n // 2 + 1]) ** 2
    F[:, :(n - 1) // 2] *= 2.0
    return F / n


#: Frequencies nearest a slow period (its own two neighbours, where a line leaks, left out) on which the
#: continuum under it is fitted.
CONTINUUM = 14
#: A period that lasts only part of the run (a burst of c cycles at frequency k/n) spreads its line over about
#: k/c ordinates; the continuum is fitted beyond k / LINE_CYCLES of them, so a burst of 8 cycles or more does not
#: raise the continuum it is tested against.
LINE_CYCLES = 8
_EULER = 0.5772156649015329
_GH = np.polynomial.hermite_e.hermegauss(24)          # nodes and weights for E over a standard normal


def noise_tests(xc: np.ndarray, ordinates: np.ndarray, j: np.ndarray, dof: np.ndarray, nu: int,
                ) -> tuple[np.ndarray, np.ndarray]:
    """The alternation test of the detrended rows *xc* (their *ordinates*, tested frequencies *j* of ``dof``
    degrees of freedom; *nu* those of their sum of squares) against healthy training noise: ``(periods, ps)``.

    A record's projection on a direction of curvature ``λ`` under SGD at step ``η`` with
    batch noise ``ξ`` is ``g_{t+1} = (1 - ηλ) g_t + ξ_{t+1} - ξ_t`` (ARMA(1,1) with its MA
    root on the unit circle: the step answers the last batch's noise).  While ``ηλ ≤ 1``
    its lag-1 autocorrelation is ``-(ηλ)/2 ≥ -1/2`` (-1/2 at ``ηλ = 1``, the differenced
    noise): consecutive records reverse somewhat by chance; slow weight motion, momentum
    and Adam's averaging only make the series redder.  Two tests, Bonferroni over both:

    * a **flip**: the lag-1 autocorrelation ``r1`` of the row below the batch-noise
      baseline -1/2, one-sided, ``r1`` normal with Bartlett's variance ``(1 - 3ρ² + 4ρ⁴)/n
      = 1/(2n)`` at ``ρ = -1/2``; its period is that of the strongest ordinate above
      ``n/4`` cycles (under 4 records: the frequencies whose sinusoid reverses);
    * a **slow period** (at most ``n/4`` cycles) rides on the red continuum, whose shape no
      one model fixes: a power law is fitted to the :data:`CONTINUUM` ordinates nearest it
      (those within ``max(1, k/8)`` of it, where a line - or a burst of 8 cycles or more - leaks,
      left out; none below 3 cycles, which the
      trend removal thins) by least squares in log-log (the log of an ordinate is its level
      plus a log-exponential variate of mean ``-γ`` and variance ``π²/6``); its tail is the
      log-exponential's, averaged over the normal error of the fitted level
      (:func:`_continuum_tail`), Bonferroni over the slow frequencies.  A period must stand
      out from the frequencies around it; series too short for the fit keep the white test.
    """
    from scipy.special import betaincc, ndtr

    m, n = xc.shape
    n2 = ordinates.shape[1]
    ss = np.einsum("ij,ij->i", xc, xc)
    r1 = np.einsum("ij,ij->i", xc[:, 1:], xc[:, :-1]) / np.where(ss > 0, ss, 1.0)
    p_flip = ndtr((r1 + 0.5) / math.sqrt(0.5 / n))
    band = np.arange(n // 4 + 1, n2 + 1)
    k_flip = band[np.argmax(ordinates[:, band - 1], axis=1)] if band.size else np.full(m, n2)
    slow = np.flatnonzero(4 * j <= n)
    p_slow, k_slow = np.ones(m), np.full(m, n2)
    if slow.size:
        tails, excess = np.empty((m, slow.size)), np.empty((m, slow.size))
        total = ordinates.sum(axis=1)
        lo = max(int(j.min()), 3)
        logs = np.log(np.maximum(ordinates, 1e-300))
        for i, c in enumerate(slow):
            k = int(j[c])
            cols, log_near = _continuum_bins(k, lo, n2)
            if cols.size < CONTINUUM:             # the white test
                share = np.clip(ordinates[:, k - 1] / np.where(total > 0, total, 1.0), 0.0, 1.0)
                tails[:, i] = betaincc(dof[c] / 2.0, max(nu - dof[c], 1.0) / 2.0, share)
                excess[:, i] = np.log(np.maximum(share * n2, 1e-300))
            else:
                tails[:, i], excess[:, i] = _continuum_tail(logs[:, cols], log_near, logs[:, k - 1], math.log(k))
        best = np.argmax(excess, axis=1)        # the period standing out most (tails underflow alike)
        p_slow = np.minimum(tails[np.arange(m), best] * slow.size, 1.0)
        k_slow = j[slow][best]
    flip = p_flip <= p_slow
    period = n / np.where(flip, k_flip, k_slow).astype(np.float64)
    return period, np.minimum(2.0 * np.minimum(p_flip, p_slow), 1.0)


@functools.lru_cache(maxsize=1024)
def _continuum_bins(k: int, lo: int, n2: int) -> tuple[np.ndarray, np.ndarray]:
    """The :data:`CONTINUUM` ordinates nearest frequency *k* among ``lo .. n2 - 1`` outside its leak guard
    (:func:`noise_tests`; nearest first, the lower on a tie): their columns (``q - 1``) and ``log q``.

    They depend on the frequencies only, not on the rows, so they are found once per ``(k, lo, n2)``
    (read-only arrays: the cache hands the same ones to every slab).
    """
    guard = max(1, k // LINE_CYCLES)              # a burst of LINE_CYCLES cycles leaks into k / LINE_CYCLES bins
    near = sorted((q for q in range(lo, n2) if abs(q - k) > guard), key=lambda q: (abs(q - k), q))[:CONTINUUM]
    cols, logs = np.asarray(near, dtype=np.intp) - 1, np.log(near) if near else np.empty(0)
    cols.flags.writeable = logs.flags.writeable = False
    return cols, logs


def _continuum_tail(y: np.ndarray, x: np.ndarray, yk: np.ndarray, xk: float) -> tuple[np.ndarray, np.ndarray]:
    """``P(ordinate ≥ observed)`` of each row under a power-law continuum fitted to its log ordinates *y* at log
    frequencies *x* (:func:`noise_tests`), and the log of the ordinate over the fitted continuum."""
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    ym = y.mean(axis=1)
    slope = (y - ym[:, None]) @ (x - xm) / sxx
    level = ym + slope * (xk - xm) + _EULER                       # log of the continuum's mean at the frequency
    sd = math.sqrt(math.pi**2 / 6.0 * (1.0 / x.size + (xk - xm) ** 2 / sxx))
    nodes, weights = _GH
    t = (yk - level)[:, None] - sd * nodes[None, :]
    tail = np.clip((np.exp(-np.exp(np.minimum(t, 700.0))) @ weights) / math.sqrt(2.0 * math.pi), 0.0, 1.0)
    return tail, yk - level


@functools.lru_cache(maxsize=64)
def _periodogram_design(n: int, min_cycles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`periodogram_tests` needs of the length alone, once per ``(n, min_cycles)`` (read-only): an
    orthonormal basis ``Q`` of the constant and the quadratic trend, the tested frequencies and their degrees of
    freedom."""
    t = np.linspace(-1.0, 1.0, n)
    Q = np.linalg.qr(np.c_[np.ones(n), t, t * t])[0] if n >= 3 else np.zeros((n, 0))
    j = np.arange(min_cycles, n // 2 + 1)
    dof = np.where(2 * j == n, 1.0, 2.0)
    for a in (Q, j, dof):
        a.flags.writeable = False
    return Q, j, dof


# -------------------------------------------------------------- the components
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


def _source_r2(scores: np.ndarray, fit: ks.SourceFit) -> float:
    """R² of the scores regressed on the source mixture of *fit* (least squares, sums to one: intercept included)."""
    if fit.index.size < 2:
        return 0.0
    resid = scores - fit.A @ (fit.C @ scores)
    sc = scores - scores.sum() / scores.size
    ss = sc @ sc
    return float(max(0.0, 1.0 - (resid @ resid) / ss)) if ss > 0 else math.nan


def _pole_sources(mixture: np.ndarray, mask: np.ndarray, names: tuple[str, ...], idx: np.ndarray) -> str:
    """Sources holding ≥ POLE_SHARE of a pole's records, ';'-joined ('' if none)."""
    if not mask.any():
        return ""
    pole = mixture[mask]
    share = pole.sum(axis=0) / pole.shape[0]
    return ";".join(names[i] for i in idx if share[i] >= POLE_SHARE)


@dataclass
class Component:
    k: int
    lam: float
    scores: np.ndarray
    proj: np.ndarray
    period: float
    p: float


@dataclass
class _Started:
    """One unit of a slab between its eigendecomposition and its periodogram tests."""

    row: dict[str, Any]
    fit: ks.SourceFit | None = None
    dof: int = 0
    kept: np.ndarray | None = None      # indices of the kept directions
    lam: np.ndarray | None = None
    scores: np.ndarray | None = None    # (k, n)
    proj: np.ndarray | None = None      # (k, n): the records' uncentred projections (K u) / √λ
    trace: float = 0.0                  # of the centred K (the floor of the kept directions, the explained share)


def _start(K: np.ndarray, mixture: np.ndarray, replay: bool, opts: ComponentOptions, cc: np.ndarray | None) -> _Started:
    n = K.shape[0]
    out = _Started({"n_records": n, "consec_cos": finite_mean(cc) if cc is not None else math.nan})
    if n < 8:
        return out
    fit = ks.shared_fit(mixture)          # the same rows for a tensor's heads: fitted once
    residualise = replay and fit.index.size >= 1
    Kp = residual_gram(K, fit) if residualise else centred(K)
    out.fit = fit
    out.dof = n - (_rank(fit) if residualise else 1)
    lam, U = top_components(Kp, opts.components)
    out.trace = float(np.trace(Kp))
    kept = np.flatnonzero(~(lam <= 1e-12 * max(out.trace, 1e-300)))
    if kept.size:
        root = np.sqrt(lam[kept])
        out.kept, out.lam = kept, lam
        out.scores = (U[:, kept] * root).T
        out.proj = (K @ U[:, kept] / root).T
    return out


def _rank(fit: ks.SourceFit) -> int:
    """``np.linalg.matrix_rank(fit.A)``, once per distinct mixture."""
    return _rank_of(fit.A.shape, fit.A.tobytes())


@functools.lru_cache(maxsize=8)
def _rank_of(shape: tuple[int, int], raw: bytes) -> int:
    return int(np.linalg.matrix_rank(np.frombuffer(raw, dtype=np.float64).reshape(shape)))


def oscillation_slab(slab: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], replay: bool,
                     opts: ComponentOptions, names: tuple[str, ...],
                     ) -> list[tuple[dict[str, Any], Component | None]]:
    """Oscillation statistics of every ``(K, mixture, consecutive cosines)`` of *slab* (K and mixture rows in time
    order; a single unit is a slab of one): each unit's row and its best component (None: no tested direction).

    The periodogram tests of all units with the same record count and degrees of freedom run in one
    :func:`periodogram_tests` call, the bimodality coefficients of their best directions in one call per length.
    """
    started = [_start(K, mix, replay, opts, cc) for K, mix, cc in slab]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(started):
        if s.scores is not None:
            groups.setdefault((s.scores.shape[1], s.dof), []).append(i)
    chosen: dict[int, list[Component]] = {}
    for (_, dof), members in groups.items():
        period, p = periodogram_tests(np.concatenate([started[i].scores for i in members]),  # type: ignore[misc]
                                      opts.min_cycles, dof, noise=not replay)
        at = 0
        for i in members:
            s = started[i]
            assert s.kept is not None and s.lam is not None and s.scores is not None and s.proj is not None
            comps = [Component(int(k), float(s.lam[k]), s.scores[r], s.proj[r], float(period[at + r]),
                               float(p[at + r])) for r, k in enumerate(s.kept)]
            at += len(comps)
            chosen[i] = [c for c in comps if np.isfinite(c.p)]
    best = {i: min(comps, key=lambda c: c.p) for i, comps in chosen.items() if comps}
    by_n: dict[int, list[int]] = {}
    for i, b in best.items():
        by_n.setdefault(b.scores.size, []).append(i)
    bc: dict[int, float] = {}
    for members in by_n.values():
        bc.update(zip(members, bimodality_coefficients(np.stack([best[i].scores for i in members])), strict=True))
    return [_finish(s, mix, names, chosen[i], best[i], bc[i]) if i in best else (s.row, None)
            for i, (s, (_, mix, _)) in enumerate(zip(started, slab))]


def _finish(s: _Started, mixture: np.ndarray, names: tuple[str, ...], comps: list[Component], best: Component,
            bc: float) -> tuple[dict[str, Any], Component | None]:
    """The row of a unit whose best direction *best* (of its tested *comps*) has bimodality coefficient *bc*."""
    row = s.row
    assert s.fit is not None
    upper = two_means_split(best.scores)
    up, down = best.proj[upper], best.proj[~upper]
    mu_pos, mu_neg = float(up.sum() / up.size), float(down.sum() / down.size)
    if mu_pos < mu_neg:
        mu_pos, mu_neg, upper = mu_neg, mu_pos, ~upper
    rev = min(abs(mu_pos), abs(mu_neg)) / max(abs(mu_pos), abs(mu_neg), 1e-300) if mu_pos > 0 > mu_neg else 0.0
    row.update(component=best.k + 1, explained=best.lam / max(s.trace, 1e-300), energy=best.lam,
               period_records=best.period, p_value=min(1.0, best.p * len(comps)),
               bimodality_coefficient=bc, pole_pos=mu_pos, pole_neg=mu_neg,
               reversal=rev, source_r2=_source_r2(best.scores, s.fit),
               sources_pos=_pole_sources(mixture, upper, names, s.fit.index),
               sources_neg=_pole_sources(mixture, ~upper, names, s.fit.index))
    return row, best


# ------------------------------------------------------- long histories (band)
def band_oscillation(m: WindowMoments | Any, edges: np.ndarray, min_records: int = 16) -> dict[str, Any]:
    """Windowed test for a periodic lag structure in the banded Gram of one unit, from its window moments.

    For each window and period ``P`` (2 .. band), each record's lagged products
    ``B[l, i] = <g_i, g_{i-l}>`` give ``z_i = Σ_l h_P(l) B[l, i]``
    (:func:`~gradforensics.analysis.engine.bandstats.lag_design`); an oscillation
    ``a·cos(2πi/P)·v`` adds ``a²/2·cos(2πl/P)`` to ``E B[l, i]``, a mean gradient, a drift
    or noise adds nothing to ``E z``.  The ``z_i`` of distinct records are sums of distinct
    products, so ``t = mean z / (sd z / √n)`` is Student's t with ``n - 1`` degrees of
    freedom under no oscillation (Bonferroni over windows and periods).  *m* is the unit's
    :class:`~gradforensics.analysis.contract.grams.WindowMoments` over *edges* (each
    window's ``n``, mean and sum of squares of ``z`` and ``Σ B[0]``; or a
    :class:`~gradforensics.analysis.contract.grams.LongGram` holding them).
    """
    from scipy.special import stdtr  # stdtr(df, -t) = scipy.stats.t.sf(t, df)

    m = getattr(m, "moments", m)
    nw = edges.size - 1
    if m.count.size != nw:
        raise ValueError(f"band_oscillation: moments of {m.count.size} windows for {nw} windows of edges.")
    periods = np.arange(2, m.mean.shape[1] + 2)
    n = m.count
    use = n >= min_records
    t, tail, amp = (np.full((nw, periods.size), np.nan) for _ in range(3))
    if use.any():                       # every tested window at once
        k = n[use][:, None]
        mu = m.mean[use]
        sd = np.sqrt(m.m2[use] / (k - 1))
        e0 = m.e0[use][:, None] / k
        t[use] = np.where(sd > 0, mu / np.where(sd > 0, sd, 1.0) * np.sqrt(k), 0.0)
        tail[use] = stdtr(k - 1, -t[use])
        with np.errstate(invalid="ignore", divide="ignore"):
            amp[use] = np.where(e0 > 0, 2.0 * mu / np.where(e0 > 0, e0, 1.0), np.nan)
    tested = int(np.isfinite(t).sum())
    if not tested:
        return {"p_value": math.nan}
    w, k = (int(i) for i in np.unravel_index(int(np.nanargmin(tail)), t.shape))
    p = float(min(1.0, tail[w, k] * tested))
    # the stretch: contiguous windows around the best one where this period is significant
    hot = np.nan_to_num(tail[:, k], nan=1.0) * tested < 0.01
    lo = hi = int(w)
    while lo > 0 and hot[lo - 1]:
        lo -= 1
    while hi < nw - 1 and hot[hi + 1]:
        hi += 1
    share = float(np.clip(np.nanmean(amp[lo:hi + 1, k]), 0.0, 1.0))
    return {"p_value": p, "period_records": float(periods[k]), "explained": share,
            "record_first": int(edges[lo]), "record_last": int(edges[hi + 1] - 1),
            "window_t": t[:, k], "window_share": amp[:, k]}
