"""Oscillation between opposing directions: does a tensor's gradient flip back and forth?

For each tensor and head, from its Gram matrix ``K`` only (see :mod:`~gradforensics.analysis.toolkit.kspace`):

* **consecutive-record cosines** ``cos(g_i, g_{i+1})`` (negative on a period-2 flip);
* the **principal directions** of the records: eigenpairs ``(λ_k, u_k)`` of the
  centred ``H K H``; the records' scores on direction ``v_k`` are ``u_k √λ_k``
  and their *uncentred* projections ``<g_i, v_k> = (K u_k)_i / √λ_k``
  (kernel PCA with a linear kernel; Schölkopf, Smola & Müller 1998);
* the **alternation** of each of the top three score series: the periodogram
  ordinate ``I_f`` of Fourier frequency ``f`` over the centred sum of squares is
  ``Beta(d_f/2, (N-1-d_f)/2)`` under i.i.d. Gaussian records (``d_f`` = 2, or 1 at
  the Nyquist frequency, so a period-2 flip is covered), exactly, because the
  eigenvectors of a Wishart matrix are Haar-distributed and the ratio is scale
  free (Fisher 1929's g test, per ordinate, Bonferroni over the frequencies and
  components).  Only periods with at least ``min_cycles`` cycles in the records
  count, so a slow trend (drift's business) is not an oscillation;
* the **poles**: the optimal two-group split of the scores (1-D 2-means); the
  mean uncentred projection of each pole (opposite signs: the gradient along
  ``v`` reverses), the bimodality coefficient of the scores
  ``BC = (γ² + 1) / (κ + 3(n-1)²/((n-2)(n-3)))`` (SAS; Pfister et al. 2013;
  > 5/9 suggests bimodality), and the sources sitting at each pole;
* ``source_r2``: the share of the score variance explained by the records'
  source mixture (least squares on ``batches/mixture``).

**Oscillation vs conflict.**  In a ``replay`` store no optimizer step separates
the records: their order is the capture schedule, and with sources interleaved
round-robin two conflicting sources alternate exactly like a period-2 flip.  So
in replay mode the records are first centred *per source* (``K ← E K E`` with
``E = I - A(AᵀA)⁻¹Aᵀ``): a difference between the sources' mean gradients cannot
show up here and is left to :mod:`.conflict`.  In a ``training`` store the
alternation *is* the training dynamics (the weights zig-zag whatever the cause),
so it is flagged, and the sources at each pole are named; ``source_r2`` near 1
says the zig-zag follows the data order and the cure is in the data mix.

Severity = ``significance(p, n_units) × clip(reversal / 0.5, 0, 1) ×
(0.6 + 0.4 · bimodality)``, where ``reversal = min(|μ+|, |μ−|) / max(|μ+|, |μ−|)``
when the poles' mean projections have opposite signs (else 0) and
``bimodality = clip((BC - 1/3) / (5/9 - 1/3), 0, 1)`` (0 for a Gaussian, 1 at the
uniform's 5/9).  Then the severity follows the tensor's share of the oscillating energy:
a whole tensor's is weighted by ``0.4 + 0.6 · E / E_max`` (``E`` the energy of its
oscillating direction, ``λ`` of the component, and ``E_max`` the largest among the
model's tensors oscillating at the same period, to the nearest record: one oscillation),
a head's by its tensor's weight: the zig-zag is where the energy flips, not in a bias
that merely follows.  Oscillations at other periods are other events and are not
weighed against each other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.grams import WindowMoments
from gradforensics.analysis.contract.model import (
    Advice,
    Analysis,
    AnalysisResult,
    Constraints,
    Context,
    Flag,
    Interval,
    Need,
    Options,
)
from gradforensics.analysis.engine.bandstats import lag_design, oscillation_edges
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import stacked as st
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.parallel import map_slabs
from gradforensics.analysis.toolkit.stats import bimodality_coefficient, bimodality_coefficients, finite_mean  # noqa: F401  (osc.bimodality_coefficient, as before)
from gradforensics.store.names import layer_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "ADVICE",
    "ANALYSIS",
    "COLUMNS",
    "POLE_SHARE",
    "SHARE_FULL",
    "Component",
    "OscillationOptions",
    "band_oscillation",
    "components",
    "compute",
    "compute_long",
    "flags",
    "lag_design",
    "oscillation_edges",
    "oscillation_unit",
    "periodogram_test",
    "periodogram_tests",
    "plot",
    "severity",
    "source_r2",
    "top_components",
    "two_means_split",
    "weigh_by_energy",
]


COLUMNS = [
    "tensor", "head", "layer", "n_records", "n_excluded", "consec_cos", "component", "explained",
    "period_records", "period_steps", "p_value", "bimodality_coefficient", "pole_pos", "pole_neg",
    "reversal", "source_r2", "sources_pos", "sources_neg", "record_first", "record_last", "energy",
    "energy_share", "severity",
]
ENERGY_FLOOR = 0.4        # severity weight of the tensor with the least oscillating energy (the largest: 1)
POLE_SHARE = 0.6          # a source "sits at a pole" when it holds this share of the pole's records


@dataclass(frozen=True)
class OscillationOptions(Options):
    """``components``: principal directions examined; ``min_cycles``: fewest cycles for a period."""

    components: int = 3
    min_cycles: int = 3

    analysis_name = "oscillation"
    constraints: ClassVar[Constraints] = {"components": Interval(int, 1, None), "min_cycles": Interval(int, 2, None)}


# ---------------------------------------------------------------- statistics
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
    sc = scores - scores.mean()
    return float(max(0.0, 1.0 - (resid @ resid) / (sc @ sc))) if sc @ sc > 0 else math.nan


def _pole_sources(mixture: np.ndarray, mask: np.ndarray, names: tuple[str, ...], idx: np.ndarray) -> str:
    """Sources holding ≥ POLE_SHARE of a pole's records, ';'-joined ('' if none)."""
    if not mask.any():
        return ""
    share = mixture[mask].mean(axis=0)
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


def _principal(Kp: np.ndarray, K: np.ndarray, n_comp: int) -> _Principal:
    lam, U = top_components(Kp, n_comp)
    floor = 1e-12 * max(np.trace(Kp), 1e-300)
    kept = [k for k in range(lam.size) if not lam[k] <= floor]
    scores = np.stack([U[:, k] * math.sqrt(lam[k]) for k in kept]) if kept else np.zeros((0, Kp.shape[0]))
    return _Principal(kept, lam, scores, [K @ U[:, k] / math.sqrt(lam[k]) for k in kept])


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
    lam, U = st.eigh_top(S, k)
    lam, U = lam[::-1], U[:, ::-1]
    s = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])])
    return np.maximum(lam, 0.0), U * np.where(s == 0, 1.0, s)


def _tested(part: _Principal, period: np.ndarray, p: np.ndarray) -> list[Component]:
    return [Component(k, float(part.lam[k]), part.scores[i], part.proj[i], float(period[i]), float(p[i]))
            for i, k in enumerate(part.kept)]


def oscillation_unit(K: np.ndarray, mixture: np.ndarray, replay: bool, opts: OscillationOptions,
                     names: tuple[str, ...]) -> tuple[dict[str, Any], Component | None]:
    """Oscillation statistics of one unit (K and mixture rows in time order)."""
    cc = ks.consecutive_cosines(K) if K.shape[0] > 1 else None
    return _oscillation_slab([(K, mixture, cc)], replay, opts, names)[0]


@dataclass
class _Started:
    """One unit of a slab between its eigendecomposition and its periodogram tests."""

    row: dict[str, Any]
    Kp: np.ndarray | None = None
    fit: ks.SourceFit | None = None
    dof: int = 0
    part: _Principal | None = None


def _oscillation_slab(slab: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], replay: bool,
                      opts: OscillationOptions, names: tuple[str, ...],
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


def _start(K: np.ndarray, mixture: np.ndarray, replay: bool, opts: OscillationOptions,
           cc: np.ndarray | None, ranks: dict[int, int]) -> _Started:
    n = K.shape[0]
    out = _Started({"n_records": n, "consec_cos": finite_mean(cc) if cc is not None else math.nan})
    if n < 8:
        return out
    fit = ks.shared_fit(mixture)          # the same rows for a tensor's heads: fitted once
    residualise = replay and fit.index.size >= 1
    out.Kp = ks.residual_gram(K, fit) if residualise else ks.centred(K)
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
    assert s.Kp is not None and s.fit is not None
    fit = s.fit
    upper = two_means_split(best.scores)
    mu_pos, mu_neg = float(best.proj[upper].mean()), float(best.proj[~upper].mean())
    if mu_pos < mu_neg:
        mu_pos, mu_neg, upper = mu_neg, mu_pos, ~upper
    rev = min(abs(mu_pos), abs(mu_neg)) / max(abs(mu_pos), abs(mu_neg), 1e-300) if mu_pos > 0 > mu_neg else 0.0
    row.update(component=best.k + 1, explained=best.lam / max(float(np.trace(s.Kp)), 1e-300), energy=best.lam,
               period_records=best.period, p_value=min(1.0, best.p * len(comps)),
               bimodality_coefficient=bc, pole_pos=mu_pos, pole_neg=mu_neg,
               reversal=rev, source_r2=_source_r2(best.scores, fit, hats),
               sources_pos=_pole_sources(mixture, upper, names, fit.index),
               sources_neg=_pole_sources(mixture, ~upper, names, fit.index))
    return row, best


def severity(p: float, n_tests: int, reversal: float, bc: float) -> float:
    bimod = fl.ramp(bc - 1.0 / 3.0, 5.0 / 9.0 - 1.0 / 3.0)
    return fl.significance(p, n_tests) * fl.ramp(reversal, 0.5) * (0.6 + 0.4 * bimod)


# ------------------------------------------------------------------ analysis
def _slab_of(slab: list[un.Unit], mix: np.ndarray, replay: bool, opts: OscillationOptions, sources: tuple[str, ...],
             ) -> list[tuple[dict[str, Any], Component | None, np.ndarray | None]]:
    """The rows, components and consecutive cosines of a slab of units (module-level: it runs on dask workers
    too)."""
    ccs = [ks.consecutive_cosines(u.gram) if u.n > 1 else None for u in slab]    # the row's mean and the series
    done = _oscillation_slab([(u.gram, mix[u.records], cc) for u, cc in zip(slab, ccs)], replay, opts, sources)
    return [(*rc, cc) for rc, cc in zip(done, ccs, strict=True)]


def compute(ctx: Context) -> AnalysisResult:
    """The oscillation table, projection and consecutive-cosine series of every tensor and head."""
    if ctx.long is not None:
        return compute_long(ctx)
    opts = ctx.options_for("oscillation", OscillationOptions)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)), dtype=np.float64)
    replay = ctx.meta.mode == "replay"
    rows = []
    proj_pack, cc_pack = un.SeriesPack(), un.SeriesPack()
    units = un.units(ctx)
    dsteps: dict[bytes, float] = {}
    done = map_slabs(functools.partial(_slab_of, mix=mix, replay=replay, opts=opts, sources=ctx.sources), units)
    for u, (row, comp, ucc) in zip(map(units.info, range(len(units))), done, strict=True):
        key = u.records.tobytes()
        if key not in dsteps:           # one median per distinct record set (a tensor's heads share theirs)
            dsteps[key] = float(np.median(np.diff(step[u.records]))) if u.n > 1 else math.nan
        dstep = dsteps[key]
        row.update(tensor=u.tensor, head=u.head, layer=u.layer, n_excluded=u.n_excluded,
                   record_first=0, record_last=ctx.n_records - 1, period_steps=row.get("period_records", math.nan) * dstep if not replay else math.nan)
        rows.append(row)
        if comp is not None:
            proj = np.full(ctx.n_records, np.nan)
            proj[u.records] = comp.proj
            proj_pack.add(u.tensor, u.head, proj)
        if ucc is not None:
            cc = np.full(ctx.n_records, np.nan)
            cc[u.records[1:]] = ucc
            cc_pack.add(u.tensor, u.head, cc)
    table = _frame(rows)
    n_tests = int(table["p_value"].notna().sum())
    table["severity"] = [severity(p, n_tests, r, bc) for p, r, bc in
                         zip(table["p_value"], table["reversal"], table["bimodality_coefficient"])]
    weigh_by_energy(table)
    return AnalysisResult(table=table, series={**proj_pack.to_series("projection"),
                                               **cc_pack.to_series("consecutive_cosine")})


def weigh_by_energy(table: Any) -> None:
    """Severity x (ENERGY_FLOOR + (1 - ENERGY_FLOOR) E/E_max) by the whole tensor's oscillating energy share
    among the tensors oscillating at its period (module docstring)."""
    if "energy" not in table or not len(table):
        return
    whole = table.loc[table["head"].isna()].set_index("tensor")
    energy = whole["energy"].astype(float)
    period = np.round(whole["period_records"].astype(float)).fillna(-1.0)     # one oscillation = one period
    live = np.isfinite(energy) & whole["severity"].gt(0)
    top = energy.where(live).groupby(period).transform("max")
    if not (np.isfinite(top) & (top > 0)).any():
        table["energy_share"] = math.nan
        return
    share = table["tensor"].map(energy / top.where(top > 0)).astype(float)
    table["energy_share"] = share
    w = ENERGY_FLOOR + (1 - ENERGY_FLOOR) * np.clip(share.fillna(0.0).to_numpy(), 0.0, 1.0)
    table["severity"] = table["severity"].to_numpy() * w


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    table = pd.DataFrame(rows, columns=COLUMNS)
    for col in ("head", "layer", "record_first", "record_last"):
        table[col] = table[col].astype("Int64")
    return table


# ------------------------------------------------------- long histories (band)
def band_oscillation(m: WindowMoments | Any, edges: np.ndarray, min_records: int = 16) -> dict[str, Any]:
    """Windowed test for a periodic lag structure in the banded Gram of one unit, from its window moments.

    For each window and period ``P`` (2 .. band), each record's lagged products
    ``B[l, i] = <g_i, g_{i-l}>`` give ``z_i = Σ_l h_P(l) B[l, i]`` (:func:`lag_design`);
    an oscillation ``a·cos(2πi/P)·v`` adds ``a²/2·cos(2πl/P)`` to ``E B[l, i]``, a
    mean gradient, a drift or noise adds nothing to ``E z``.  The ``z_i`` of distinct
    records are sums of distinct products, so ``t = mean z / (sd z / √n)`` is
    Student's t with ``n - 1`` degrees of freedom under no oscillation (Bonferroni
    over windows and periods).  *m* is the unit's
    :class:`~gradforensics.analysis.contract.grams.WindowMoments` over *edges* (the
    pass reduces each window's ``n``, mean and sum of squares of ``z`` and ``Σ B[0]``;
    or a :class:`~gradforensics.analysis.contract.grams.LongGram` holding them).
    """
    from scipy.special import stdtr  # stdtr(df, -t) = scipy.stats.t.sf(t, df), bit for bit

    m = getattr(m, "moments", m)
    nw = edges.size - 1
    if m.count.size != nw:
        raise ValueError(f"band_oscillation: moments of {m.count.size} windows for {nw} windows of edges.")
    periods = np.arange(2, m.mean.shape[1] + 2)
    n = m.count
    use = n >= min_records
    t = np.full((nw, periods.size), np.nan)
    tail = np.full((nw, periods.size), np.nan)
    amp = np.full((nw, periods.size), np.nan)
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


def compute_long(ctx: Context) -> AnalysisResult:
    """Oscillation above ``N₀`` records: the windowed band test of every tensor and head.

    The consecutive-record cosines are kept per window of the band test (series
    ``window_consecutive_cosine``: window centre, mean cosine), not per record.
    """
    assert ctx.long is not None
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)), dtype=np.float64)
    edges = oscillation_edges(ctx.n_records, ctx.long.design.band, ctx.long.design.edges)
    centre = (edges[:-1] + edges[1:] - 1) / 2.0
    rows = []
    cc_pack, win_pack = un.SeriesPack(), un.SeriesPack()
    dstep = float(np.median(np.diff(step))) if step.size > 1 else math.nan
    for (tensor, head), g in sorted(ctx.long.grams.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        res = band_oscillation(g.moments, edges)
        n_ok = g.n_records - int(g.bad.size)
        row = {"tensor": tensor, "head": head, "layer": layer_of(tensor), "n_records": n_ok,
               "n_excluded": ctx.n_records - n_ok, "consec_cos": g.moments.consecutive_cosine(),
               **{k: v for k, v in res.items() if not k.startswith("window_")}}
        row["period_steps"] = row.get("period_records", math.nan) * dstep
        row["reversal"] = math.nan
        rows.append(row)
        cc_pack.add(tensor, head, np.c_[centre, g.moments.window_cosines()])
        if "window_t" in res:
            win_pack.add(tensor, head, np.c_[centre, res["window_t"], res["window_share"]])
    table = _frame(rows)
    n_tests = int(table["p_value"].notna().sum())
    replay = ctx.meta.mode == "replay"
    table["severity"] = [0.0 if replay else fl.significance(p, n_tests) * fl.ramp(share, SHARE_FULL)
                         for p, share in zip(table["p_value"], table["explained"])]
    return AnalysisResult(table=table, series={**cc_pack.to_series("window_consecutive_cosine"),
                                               **win_pack.to_series("window_oscillation")})


SHARE_FULL = 0.2    # long histories: the oscillating share of the gradient energy at which the effect saturates


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per oscillating tensor (or the heads that localise it), over the records where it oscillates."""
    out = []
    for r in result.table.itertuples(index=False):
        if not r.severity >= fl.REPORT_FLOOR:
            continue
        head = un.head_of(r.head)
        poles = [s for s in (r.sources_pos, r.sources_neg) if isinstance(s, str) and s]
        src = tuple(dict.fromkeys(x for s in poles for x in s.split(";")))
        span = (int(r.record_first), int(r.record_last)) if un.head_of(getattr(r, "record_first", None)) is not None \
            else (0, ctx.n_records - 1)
        summary = _summary(r, head, ctx.meta.mode) if ctx.long is None else _summary_long(r, head)
        out.append(Flag(kind="oscillation", tensor=r.tensor, head=head, sources=src, severity=float(r.severity),
                        records=span, evidence=_evidence(r), summary=summary))
    t = result.table
    involved = fl.involved_heads(t, (t["reversal"] > 0) & (t["p_value"] < 0.05))
    return fl.dedupe_heads(out, un.heads_per_tensor(t), involved, by_sources=False)


def _evidence(r: Any) -> dict[str, Any]:
    return {"period_records": r.period_records, "period_steps": r.period_steps, "p_value": r.p_value,
            "pole_pos": r.pole_pos, "pole_neg": r.pole_neg, "reversal": r.reversal,
            "bimodality_coefficient": r.bimodality_coefficient, "consec_cos": r.consec_cos,
            "explained": r.explained, "source_r2": r.source_r2}


def _summary_long(r: Any, head: int | None) -> str:
    where = r.tensor if head is None else f"{r.tensor} head {head}"
    steps = f" (~{r.period_steps:.0f} steps)" if np.isfinite(r.period_steps) else ""
    return (f"{where}: gradient oscillates with a period of {r.period_records:.0f} records{steps} over records "
            f"{int(r.record_first)}-{int(r.record_last)} ({100 * r.explained:.0f}% of the gradient energy; "
            f"consecutive-record cosine {r.consec_cos:.2f}, {fl.fmt_p(r.p_value)}; banded Gram, long history).")


def _summary(r: Any, head: int | None, mode: str) -> str:
    where = r.tensor if head is None else f"{r.tensor} head {head}"
    steps = f" (~{r.period_steps:.0f} steps)" if np.isfinite(r.period_steps) else ""
    s = (f"{where}: gradient flips between opposite directions every {r.period_records:.1f} records{steps} "
         f"along principal direction {int(r.component)} ({100 * r.explained:.0f}% of the record variance; "
         f"poles at {r.pole_pos:+.3g} and {r.pole_neg:+.3g}, consecutive-record cosine {r.consec_cos:.2f}, "
         f"{fl.fmt_p(r.p_value)})")
    pos, neg = r.sources_pos or "mixed", r.sources_neg or "mixed"
    if r.sources_pos or r.sources_neg:
        s += f"; sources at the poles: + {pos}, - {neg}"
        if r.source_r2 > 0.5 and mode == "training":
            s += f" (the data order explains {100 * r.source_r2:.0f}% of it: mix sources within batches; see conflict)"
    return s + "."


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """The records' projection on the oscillating direction, record by record."""
    proj = un.unit_series(result.series, "projection", flag.tensor, flag.head)
    win = un.unit_series(result.series, "window_oscillation", flag.tensor, flag.head)
    if proj is None and win is not None:
        _plot_windows(win, flag, ax)
        return
    if proj is not None:
        x = np.flatnonzero(np.isfinite(proj))
        y = proj[x]
        ax.plot(x, y, "-", lw=0.6, color="0.6")
        ax.scatter(x, y, s=8, c=np.where(y >= np.median(y), "C3", "C0"), zorder=3)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("record")
    ax.set_ylabel("projection on principal direction")
    where = flag.tensor if flag.head is None else f"{flag.tensor} head {flag.head}"
    period = flag.evidence.get("period_records")
    ptxt = f"period {period:.1f} records" if isinstance(period, (int, float)) and np.isfinite(period) else ""
    ax.set_title(f"oscillation: {where}\npoints alternate above and below 0: the update reverses ({ptxt})",
                 fontsize=9)


def _plot_windows(win: np.ndarray, flag: Flag, ax: Axes) -> None:
    """Long histories: the oscillating share of the gradient energy per window, the flagged stretch shaded."""
    ok = np.isfinite(win[:, 0])
    ax.plot(win[ok, 0], win[ok, 2], "o-", ms=3)
    ax.axvspan(flag.records[0], flag.records[1], color="C3", alpha=0.15)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("record (window centre)")
    ax.set_ylabel("oscillating share of gradient energy")
    where = flag.tensor if flag.head is None else f"{flag.tensor} head {flag.head}"
    ax.set_title(f"oscillation: {where}\nper window, at the flagged period (banded Gram)", fontsize=9)


#: What an ``oscillation`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Cohen2021] J. Cohen et al., "Gradient Descent on Neural Networks Typically Occurs at the Edge of
#:    Stability", ICLR 2021.
#: .. [Goyal2017] P. Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017 (warmup).
#: .. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training
#:    instabilities", 2023.
ADVICE = Advice(
    title="Oscillation",
    phrase="updates flip between two opposing directions",
    evidence_keys={"period_records": "records per period", "consec_cos": "consecutive-record cos",
                   "bimodality_coefficient": "bimodality", "p_value": "p"},
    remedies=(
        "Lower the LR (or its peak), or lengthen warmup: sign-flipping updates along the top direction are "
        "the edge-of-stability signature of a step too large for the local curvature.",
        "With Adam: raise beta2 (e.g. 0.95 -> 0.98/0.99) or epsilon so the second-moment estimate "
        "stops chasing spikes; clip gradients.",
        "If the poles are data sources, the oscillation is a mixture conflict: see the conflict remedies."),
    references=("Cohen et al. 2021, Gradient Descent ... at the Edge of Stability",
                "Goyal et al. 2017, Accurate, Large Minibatch SGD (warmup)",
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities"),
    time_axis=True,
    records_map="a run flipping between two directions zig-zags between two clouds in the step panel",
    cause="learning_rate",
)

ANALYSIS = Analysis(name="oscillation", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"oscillation": ADVICE}, options=OscillationOptions, long_history=True)
