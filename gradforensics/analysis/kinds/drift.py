"""Direction drift: has the mean gradient of a tensor (or head) turned away from where it started?

For each tensor and head, from its Gram matrix ``K`` only (see :mod:`~gradforensics.analysis.toolkit.kspace`):

* ``m_0``, the mean gradient of the *opening window* (the first ``w`` records in
  step order, ``w = max(4, ceil(N/16))`` by default);
* the cosine of every record to ``m_0`` (leave-one-out inside the opening window)
  and of every window mean to ``m_0``;
* the **trend**: Spearman's rank correlation ρ between time and the per-record
  cosine after the opening window, one-sided (a fall).  Under a stationary run
  those cosines are exchangeable (they share ``m_0``), so the rank test is valid;
  its p-value uses the t approximation (Kendall & Stuart 1979, §31.19);
* the **effect**: ``rotation = 1 - cos(G_late, G_0)``, the cosine between the
  *population* means of the last third of the windows and the opening window,
  estimated without the noise floor by U-statistics
  (``mean_{i∈late, j∈open} K_ij / sqrt(U_late U_open)``).  A falling gradient
  SNR alone (noise attenuating every cosine) therefore does not count as drift.
  Where a U-statistic is not positive (too little signal), the ratio of raw
  window cosines ``1 - c_late / c_early`` is used instead;
* **since when**: the change point of a hinge fit (flat, then linear fall) to the
  per-record cosines, least squares over every candidate record (Hudson 1966);
* **towards what**: the cosine between each source's mean gradient (least
  squares on ``batches/mixture``) and the new direction ``m_late - m_0``.

Severity = ``significance(p, n_units) × clip(rotation / 0.5, 0, 1)``: a
Bonferroni-adjusted significance over every unit of the store, times the effect.
In a ``training`` store the gradient of a model that learns turns as it learns, so
drift alone is not trouble: when the recorded loss *fell* over the run (the mean of
the last third of the records at least :data:`LEARNING_DROP` below the opening
window's), the drift is ordinary learning and its severity is scaled by
:data:`LEARNING_WEIGHT` (context, below 0.5).  Drift with a flat or rising loss, or
with no loss recorded, keeps its severity (``loss_change`` in the table).
Drift is a statement about training history: in a ``replay`` store (one fixed
checkpoint) the table is produced but no flag is raised.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import stacked as st
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.batches import LEARNING_DROP, loss_change
from gradforensics.analysis.toolkit.parallel import map_slabs
from gradforensics.analysis.toolkit.stats import finite_mean, rank_trends

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "ADVICE",
    "ANALYSIS",
    "COLUMNS",
    "EFFECT_FULL",
    "DriftOptions",
    "UnitDrift",
    "compute",
    "drift_slab",
    "drift_unit",
    "flags",
    "hinge_changepoint",
    "hinge_changepoints",
    "opening_cosines",
    "pd_int",
    "plot",
]


COLUMNS = [
    "tensor", "head", "layer", "n_records", "n_excluded", "window", "cos_early", "cos_late",
    "cos_late_debiased", "rotation", "rho", "p_value", "rho_windows", "since_record", "since_step",
    "aligned_source", "aligned_cosine", "loss_change", "severity",
]
EFFECT_FULL = 0.5  # rotation at which the effect score saturates
LEARNING_WEIGHT = 0.45  # severity weight of drift while the loss falls: context, never an alarm
ALIGN_MIN, ALIGN_MARGIN = 0.3, 0.15


@dataclass(frozen=True)
class DriftOptions(Options):
    """``window``: records per window (default ``max(4, ceil(N/16))``)."""

    window: int | None = None

    analysis_name = "drift"
    constraints: ClassVar[Constraints] = {"window": [Interval(int, 2, None), None]}


# ---------------------------------------------------------------- statistics
def hinge_changepoint(y: np.ndarray) -> tuple[int | None, float]:
    """Least-squares fit of ``y_t = a`` (t < k), ``a + b (t - k)`` (t ≥ k), ``b < 0``.

    Returns ``(k, b)`` minimising the residual sum of squares over every
    candidate ``k`` in ``1 .. n-2`` (NaNs are skipped), or ``(None, nan)`` when no
    candidate has a falling slope.  O(n) via suffix sums: for the regressor
    ``z_t = max(0, t - t_k)``, ``Σz``, ``Σz²`` and ``Σzy`` over ``t > t_k`` are
    polynomials in ``t_k`` of the suffix sums of ``1, t, t², y, t·y``.
    """
    return hinge_changepoints([y])[0]


def hinge_changepoints(ys: list[np.ndarray]) -> list[tuple[int | None, float]]:
    """:func:`hinge_changepoint` of every series of *ys*, each pair bit for bit: the series with the same finite
    positions in one stacked pass (suffix sums by ``cumsum`` along each row, means, sums and dots along
    each row as the 1-d calls take them; the rest elementwise)."""
    out: list[tuple[int | None, float]] = [(None, math.nan)] * len(ys)
    groups: dict[bytes, list[int]] = {}
    finite = [np.isfinite(y) for y in ys]
    for i, f in enumerate(finite):
        if int(np.count_nonzero(f)) >= 4:
            groups.setdefault(np.packbits(f).tobytes() + f.size.to_bytes(8, "little"), []).append(i)
    for members in groups.values():
        t = np.flatnonzero(finite[members[0]]).astype(np.float64)
        V = np.stack([np.asarray(ys[i], dtype=np.float64)[finite[i]] for i in members])
        for i, res in zip(members, _hinge_stack(t, V), strict=True):
            out[i] = res
    return out


def _suffix(a: np.ndarray) -> np.ndarray:
    """``Σ_{j > k} a_j`` for every k along the last axis (``cumsum`` of the reversed rows: sequential, as in 1-d)."""
    zero = np.zeros((*a.shape[:-1], 1))
    return np.concatenate((np.cumsum(a[..., ::-1], axis=-1)[..., ::-1][..., 1:], zero), axis=-1)


def _hinge_stack(t: np.ndarray, V: np.ndarray) -> list[tuple[int | None, float]]:
    """The hinge fit of every row of *V* (``(U, n)``, finite) at positions *t*."""
    n = t.size
    m, st, stt = _suffix(np.ones(n)), _suffix(t), _suffix(t * t)
    sy, sty = _suffix(V), _suffix(t * V)
    sz = st - m * t
    szz = stt - 2 * t * st + m * t * t
    szy = sty - t * sy
    vc = V - V.mean(axis=-1)[:, None]
    var_z = szz - sz**2 / n
    cov_zy = szy - sz * np.add.reduce(V, axis=-1)[:, None] / n
    ok = np.zeros(n, bool)
    ok[1:n - 1] = var_z[1:n - 1] > 1e-12
    slope = np.where(ok, cov_zy / np.where(ok, var_z, 1.0), 0.0)
    ss = np.matmul(vc[:, None, :], vc[:, :, None])[:, 0]          # vc @ vc per row
    sse = np.where(ok & (slope < 0), ss - cov_zy**2 / np.where(ok, var_z, 1.0), np.inf)
    j = np.argmin(sse, axis=-1)
    live = np.asarray(np.isfinite(sse).any(axis=-1))
    return [(int(t[k]), float(slope[u, k])) if live[u] else (None, math.nan) for u, k in enumerate(j.tolist())]


def opening_cosines(K: np.ndarray, open_rows: np.ndarray) -> np.ndarray:
    """Per-record cosine to the opening mean; leave-one-out for the opening records.

    For an opening record ``i`` the reference is the mean of the other ``w-1``
    opening records: ``cos = (S_i - K_ii) / sqrt(K_ii (T - 2 S_i + K_ii))`` with
    ``S_i = Σ_{j∈open} K_ij`` and ``T = Σ_{j,k∈open} K_jk``.
    """
    return _opening_fix(K, open_rows, ks.record_cosines(K, ks.mean_coefficients(K.shape[0], open_rows)))


def _opening_fix(K: np.ndarray, open_rows: np.ndarray, cos: np.ndarray) -> np.ndarray:
    """:func:`opening_cosines` from the records' cosines *cos* to the opening mean: the opening records' own
    (leave-one-out) written in."""
    if open_rows.size > 1:
        sub = ks.block(K, open_rows)
        S, T, d = sub.sum(axis=1), sub.sum(), np.diag(sub)
        cos[open_rows] = ks.safe_div(S - d, np.sqrt(np.maximum(d * (T - 2 * S + d), 0.0)))
    return cos


@dataclass
class UnitDrift:
    row: dict[str, Any]
    record_cos: np.ndarray
    window_cos: np.ndarray        # W×2: centre position, cosine


def drift_unit(K: np.ndarray, mixture: np.ndarray, window: int | None) -> UnitDrift:
    """All drift statistics of one unit (K in time order, mixture rows alike)."""
    return drift_slab([(K, mixture)], window)[0]


def drift_slab(slab: list[tuple[np.ndarray, np.ndarray]], window: int | None) -> list[UnitDrift]:
    """:func:`drift_unit` of every ``(K, mixture)`` of *slab*: the rank trends of all its units in one
    :func:`~gradforensics.analysis.toolkit.stats.rank_trends` call per series kind (each unit's floats its own
    call's), the rest unit by unit."""
    pre = _slab_cosines(slab, window)
    started = [_drift_start(K, mix, window, pre.get(i)) for i, (K, mix) in enumerate(slab)]
    live = [i for i, (_, trends) in enumerate(started) if trends is not None]
    rec = rank_trends([started[i][1][0] for i in live], min_n=4, alternative="less", skip_nonfinite=True)  # type: ignore[index]
    win = rank_trends([started[i][1][1] for i in live], min_n=4, alternative="less", skip_nonfinite=True)  # type: ignore[index]
    since = hinge_changepoints([started[i][0].record_cos for i in live])
    for i, (rho, p), (rho_w, _), (pos, _) in zip(live, rec, win, since, strict=True):
        started[i][0].row.update(rho=rho, p_value=p, rho_windows=rho_w, since_pos=pos)
    return [res for res, _ in started]


STACK_BYTES = 32 * 2**20
"""Bytes of Gram matrices one stacked cosine pass of a slab copies, at most (one unit a pass above it)."""


def _slab_cosines(slab: list[tuple[np.ndarray, np.ndarray]], window: int | None,
                  ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None, float]]:
    """Unit index -> its records' cosines to the opening mean (:func:`opening_cosines`), its window cosines, its
    sources' cosines to the new direction (None: no alignment) and its debiased late cosine, for the units of
    *slab* that are tested: the units of one record count and mixture rows at a time, through the stacked
    :func:`~gradforensics.analysis.toolkit.stacked.cosines_each`,
    :func:`~gradforensics.analysis.toolkit.stacked.record_cosines_each` and the blocks' sums of
    :func:`_opening_fix_each` and :func:`_debiased_each` (each unit's floats the single calls')."""
    groups: dict[tuple[int, bytes], list[int]] = {}
    for i, (K, mix) in enumerate(slab):
        n = K.shape[0]
        live = _windows(n, ks.window_size(n, window))[0].shape[0] >= 4
        if live and isinstance(K, np.ndarray) and K.dtype == np.float64 and K.flags.c_contiguous:   # as the units' K
            groups.setdefault((n, np.ascontiguousarray(mix, dtype=np.float64).tobytes()), []).append(i)
    out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None, float]] = {}
    for (n, _), members in groups.items():
        W, rows_of = _windows(n, ks.window_size(n, window))
        open_rows, late = rows_of[0], _late(rows_of)
        fit = ks.shared_fit(slab[members[0]][1])
        d = (ks.mean_coefficients(n, late) - ks.mean_coefficients(n, open_rows))[None, :]
        step = max(1, STACK_BYTES // max(1, 8 * n * n))
        for at in range(0, len(members), step):
            part = members[at:at + step]
            Ks = np.stack([slab[i][0] for i in part])
            rec = _opening_fix_each(Ks, open_rows, st.record_cosines_each(Ks, ks.mean_coefficients(n, open_rows)))
            wcos = st.cosines_each(Ks, W, W[:1])[:, :, 0]
            align = st.cosines_each(Ks, fit.C, d)[:, :, 0] if fit.index.size >= 2 and fit.rank_ok else None
            c_db = _debiased_each(Ks, late, open_rows)
            for j, i in enumerate(part):
                out[i] = (rec[j], wcos[j], None if align is None else align[j], float(c_db[j]))
    return out


def _opening_fix_each(Ks: np.ndarray, open_rows: np.ndarray, cos: np.ndarray) -> np.ndarray:
    """:func:`_opening_fix` of every item of the stack *Ks* and its row of *cos* (``(U, N)``, written in place),
    each row's floats the single call's: the block's row sums and diagonal per item, its total as the 1-d
    pairwise sum of each item's ``r²`` contiguous floats (``sub.sum()`` of the C-ordered block), the rest
    elementwise."""
    if open_rows.size > 1:
        sub = st.blocks_each(Ks, open_rows, open_rows)
        S = sub.sum(axis=2)
        T = sub.reshape(sub.shape[0], -1).sum(axis=1)[:, None]
        d = np.diagonal(sub, axis1=1, axis2=2)
        cos[:, open_rows] = ks.safe_div(S - d, np.sqrt(np.maximum(d * (T - 2 * S + d), 0.0)))
    return cos


def _u_norms_each(Ks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``[kspace.u_statistic_norm2(K, rows) for K in Ks]``: each block's total (its contiguous floats' pairwise
    sum) less its trace (the diagonal's sum), over ``n (n - 1)``."""
    n = rows.size
    if n < 2:
        return np.full(Ks.shape[0], np.nan)
    sub = st.blocks_each(Ks, rows, rows)
    return (sub.reshape(sub.shape[0], -1).sum(axis=1) - np.trace(sub, axis1=1, axis2=2)) / (n * (n - 1))


def _debiased_each(Ks: np.ndarray, rows_a: np.ndarray, rows_b: np.ndarray) -> np.ndarray:
    """``[kspace.debiased_cosine(K, rows_a, rows_b) for K in Ks]``, each item's float the single call's (NaN where
    a U-statistic is not positive, as there)."""
    ua, ub = _u_norms_each(Ks, rows_a), _u_norms_each(Ks, rows_b)
    ok = (ua > 0) & (ub > 0)
    cross = st.blocks_each(Ks, rows_a, rows_b)
    cross = cross.reshape(cross.shape[0], -1).mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        root = np.sqrt(ua * ub)
        if (ok & (root == 0.0)).any():      # U-statistics so small their product underflows: as the single call
            raise ZeroDivisionError("float division by zero")
        c = np.clip(cross / root, -1.0, 1.0)
    return np.where(ok, c, np.nan)


def _late(rows_of: tuple[np.ndarray, ...]) -> np.ndarray:
    """The rows of the last third of the windows after the first (at least one window)."""
    return np.concatenate(rows_of[-max(1, (len(rows_of) - 1) // 3):])


def _drift_start(K: np.ndarray, mixture: np.ndarray, window: int | None,
                 pre: tuple[np.ndarray, np.ndarray, np.ndarray | None, float] | None = None,
                 ) -> tuple[UnitDrift, tuple[np.ndarray, np.ndarray] | None]:
    """A unit's drift statistics but its rank trends (their places in the row held), and the two series they test
    (*pre*: its cosines from :func:`_slab_cosines`, else computed here)."""
    n = K.shape[0]
    w = ks.window_size(n, window)
    W, rows_of = _windows(n, w)
    row: dict[str, Any] = {"n_records": n, "window": w}
    if W.shape[0] < 4:
        return UnitDrift(row, np.full(n, np.nan), np.zeros((0, 2))), None
    open_rows = rows_of[0]
    k = max(1, (W.shape[0] - 1) // 3)
    late = None
    if pre is None:
        late = np.concatenate(rows_of[-k:])
        rec = opening_cosines(K, open_rows)
        wcos = ks.cosines(K, W, W[:1])[:, 0]
        c_db = ks.debiased_cosine(K, late, open_rows)
    else:                   # the slab's stacked cosines (and its sources' cosines to the new direction: no d here)
        rec, wcos, c_db = pre[0].copy(), pre[1].copy(), pre[3]
    wcos[0] = np.nan
    c_early, c_late = finite_mean(wcos[1:1 + k]), finite_mean(wcos[-k:])
    rotation = 1.0 - c_db if np.isfinite(c_db) else (1.0 - c_late / c_early if c_early > 0.1 else math.nan)
    row.update(cos_early=c_early, cos_late=c_late, cos_late_debiased=c_db, rotation=rotation, rho=math.nan,
               p_value=math.nan, rho_windows=math.nan, since_pos=None)
    if pre is None:
        assert late is not None
        d = ks.mean_coefficients(n, late) - ks.mean_coefficients(n, open_rows)
        row.update(_alignment(K, mixture, d))
    else:       # d only where the slab had no sources' cosines (then no alignment either: the same fit says so)
        d = None if pre[2] is not None else ks.mean_coefficients(n, np.concatenate(rows_of[-k:])) - \
            ks.mean_coefficients(n, open_rows)
        row.update(_alignment(K, mixture, d, pre[2]))
    return UnitDrift(row, rec, np.column_stack((_centres(n, w), wcos))), (rec[open_rows.size:], wcos[1:])


@functools.lru_cache(maxsize=32)
def _centres(n: int, w: int) -> np.ndarray:
    """Each window's mean row position (``rows.mean()`` of :func:`_windows`' rows), once per ``(n, w)``."""
    out = np.array([r.mean() for r in _windows(n, w)[1]])
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=32)
def _windows(n: int, w: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The window-mean coefficients (W×n) of *n* records in windows of *w* and each window's rows, built once
    per ``(n, w)`` for every unit (read-only)."""
    W = ks.window_coefficients(n, w) if n else np.zeros((0, 0))
    rows_of = tuple(np.flatnonzero(W[i] > 0) for i in range(W.shape[0]))
    for a in (W, *rows_of):
        a.flags.writeable = False
    return W, rows_of


def _alignment(K: np.ndarray, mixture: np.ndarray, d: np.ndarray | None, c: np.ndarray | None = None,
               ) -> dict[str, Any]:
    """Which source's mean gradient points most along the new direction *d* (*c*: the sources' cosines to it, when
    the caller has them; then *d* may be None)."""
    fit = ks.shared_fit(mixture)          # the same rows for a tensor's heads: fitted once
    if fit.index.size < 2 or not fit.rank_ok:
        return {"align_idx": None, "aligned_cosine": math.nan, "align_margin": math.nan}
    if c is None:
        assert d is not None
        c = ks.cosines(K, fit.C, d[None, :])[:, 0]
    if not np.isfinite(c).any():
        return {"align_idx": None, "aligned_cosine": math.nan, "align_margin": math.nan}
    order = np.argsort(-_nan_to_num(c, -2.0))
    margin = float(c[order[0]] - c[order[1]]) if np.isfinite(c[order[1]]) else math.inf
    return {"align_idx": int(fit.index[order[0]]), "aligned_cosine": float(c[order[0]]), "align_margin": margin}


_BIG = float(np.finfo(np.float64).max)


def _nan_to_num(c: np.ndarray, nan: float) -> np.ndarray:
    """``np.nan_to_num(c, nan=nan)`` of a float64 array (±inf to ± the largest float), the same values, without
    its per-call dispatch."""
    return np.clip(np.where(np.isnan(c), nan, c), -_BIG, _BIG)


# ------------------------------------------------------------------ analysis
def compute(ctx: Context) -> AnalysisResult:
    """The drift table and per-record series of every tensor and head.

    In the long-history regime the same statistics run on the per-window,
    per-source mean gradients (super-records); ``since_record`` is then the first
    record of the window where the fall starts, and the series are per super-record.
    """
    if ctx.long is None:
        return _compute(ctx)
    res = _compute(ctx.super_records())
    first = ctx.long.first_record()
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)))
    t = res.table
    since = [None if un.head_of(v) is None else int(first[int(v)]) for v in t["since_record"]]
    t["since_record"] = pd_int(since)
    t["since_step"] = pd_int([None if v is None else int(step[v]) for v in since])
    # the figure's x axis is records: window means at their windows' centres; no per-record series
    last = ctx.long.last_record()
    win = res.series.get("window_cosine")
    if win is not None:
        idx = win[..., 0]
        ok = np.isfinite(idx)
        j = np.where(ok, idx, 0).astype(int)
        win[..., 0] = np.where(ok, (first[j] + last[j]) / 2.0, np.nan)
    res.series.pop("record_cosine", None)
    res.series.pop("record_cosine_units", None)
    return res


def pd_int(values: list[int | None]) -> Any:
    import pandas as pd

    return pd.array(values, dtype="Int64")


def _drift_of(slab: list[un.Unit], mix: np.ndarray, window: int | None) -> list[UnitDrift]:
    """:func:`drift_slab` of a slab of units (module-level: it runs on dask workers too)."""
    return drift_slab([(u.gram, mix[u.records]) for u in slab], window)


def _compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opts = ctx.options_for("drift", DriftOptions)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)))
    rows = []
    rec_pack, win_pack = un.SeriesPack(), un.SeriesPack()
    units = un.units(ctx)
    done = map_slabs(functools.partial(_drift_of, mix=mix, window=opts.window), units)
    for u, res in zip(map(units.info, range(len(units))), done, strict=True):
        r = res.row
        pos = r.pop("since_pos", None)
        ai = r.pop("align_idx", None)
        margin = r.pop("align_margin", math.nan)
        named = ai is not None and r["aligned_cosine"] >= ALIGN_MIN and margin >= ALIGN_MARGIN
        r.update(tensor=u.tensor, head=u.head, layer=u.layer, n_excluded=u.n_excluded,
                 since_record=None if pos is None else int(u.records[pos]),
                 since_step=None if pos is None else int(step[u.records[pos]]),
                 aligned_source=ctx.sources[ai] if named else None)
        rows.append(r)
        full = np.full(ctx.n_records, np.nan)
        full[u.records] = res.record_cos
        rec_pack.add(u.tensor, u.head, full)
        if res.window_cos.size:
            centre = u.records[np.round(res.window_cos[:, 0]).astype(int)]
            win_pack.add(u.tensor, u.head, np.column_stack((centre, res.window_cos[:, 1])))
    table = pd.DataFrame(rows, columns=COLUMNS)
    for col in ("head", "layer", "since_record", "since_step"):
        table[col] = table[col].astype("Int64")
    n_tests = int(table["p_value"].notna().sum()) if len(table) else 0
    change = loss_change(ctx.batches.get("loss"), step, opts.window)
    table["loss_change"] = change
    weight = LEARNING_WEIGHT if change <= -LEARNING_DROP else 1.0
    table["severity"] = [
        0.0 if ctx.meta.mode == "replay" else weight * fl.significance(p, n_tests) * fl.ramp(rot, EFFECT_FULL)
        for p, rot in zip(table["p_value"], table["rotation"])
    ]
    return AnalysisResult(table=table, series={**rec_pack.to_series("record_cosine"),
                                               **win_pack.to_series("window_cosine")})


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per drifting tensor (or the heads that localise it); none in replay mode."""
    if ctx.meta.mode == "replay":
        return []
    out = []
    last = ctx.n_records - 1
    for r in result.table.itertuples(index=False):
        if r.severity < fl.REPORT_FLOOR:
            continue
        head = un.head_of(r.head)
        since = int(r.since_record) if _ok(r.since_record) else 0
        src = (r.aligned_source,) if isinstance(r.aligned_source, str) else ()
        out.append(Flag(kind="drift", tensor=r.tensor, head=head, sources=src, severity=float(r.severity),
                        records=(since, last), evidence=_evidence(r), summary=_summary(r, head)))
    t = result.table
    involved = fl.involved_heads(t, (t["rotation"] > 0.1) & (t["p_value"] < 0.05))
    return fl.dedupe_heads(out, un.heads_per_tensor(t), involved, by_sources=False)


def _ok(x: Any) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _evidence(r: Any) -> dict[str, Any]:
    return {"rotation": r.rotation, "cos_early": r.cos_early, "cos_late": r.cos_late, "rho": r.rho,
            "p_value": r.p_value, "since_step": r.since_step, "aligned_cosine": r.aligned_cosine,
            "loss_change": r.loss_change}


def _summary(r: Any, head: int | None) -> str:
    where = r.tensor if head is None else f"{r.tensor} head {head}"
    since = f"since record {int(r.since_record)} (step {int(r.since_step)})" if _ok(r.since_record) else ""
    s = (f"{where}: the mean gradient has turned away from its opening direction {since}: "
         f"window-mean cosine to the opening mean fell from {r.cos_early:.2f} to {r.cos_late:.2f} "
         f"(rotation {r.rotation:.2f}, Spearman rho {r.rho:.2f}, {fl.fmt_p(r.p_value)})")
    if isinstance(r.aligned_source, str):
        s += f"; the new direction aligns with source '{r.aligned_source}' (cos {r.aligned_cosine:.2f})"
    if np.isfinite(r.loss_change) and r.loss_change <= -LEARNING_DROP:
        s += (f"; the loss fell {-r.loss_change:.0%} meanwhile, so this is the model learning (context, "
              "not trouble)")
    return s + "."


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Per-record and window-mean cosine to the opening mean, with the change point."""
    rec = un.unit_series(result.series, "record_cosine", flag.tensor, flag.head)
    win = un.unit_series(result.series, "window_cosine", flag.tensor, flag.head)
    if rec is not None:
        x = np.flatnonzero(np.isfinite(rec))
        ax.plot(x, rec[x], ".", ms=3, alpha=0.5, color="0.5", label="record")
    if win is not None and len(win):
        win = win[np.isfinite(win[:, 0])]
        ax.plot(win[:, 0], win[:, 1], "-o", ms=4, color="C0", label="window mean")
    ax.axvline(flag.records[0], color="C3", ls="--", lw=1, label=f"change point (record {flag.records[0]})")
    ax.axhline(0.0, color="0.8", lw=0.8)
    ax.set_xlabel("record")
    ax.set_ylabel("cosine to opening-window mean")
    where = flag.tensor if flag.head is None else f"{flag.tensor} head {flag.head}"
    ax.set_title(f"drift: {where}\ncosine to the opening direction falls after the dashed line", fontsize=9)
    ax.legend(fontsize=7, loc="best")


#: What a ``drift`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Gur-Ari2018] G. Gur-Ari et al., "Gradient Descent Happens in a Tiny Subspace", 2018.
ADVICE = Advice(
    title="Direction drift",
    phrase="the gradient direction drifts away from where it started",
    evidence_keys={"rotation": "rotation", "cos_late": "late cos to the opening mean", "rho": "ρ", "p_value": "p"},
    remedies=(
        "Look for a change in the data stream at the records named (mixture schedule, a new shard, "
        "a tokenizer or packing change) before blaming the optimizer.",
        "If the data is stationary, drift of the dominant direction with a rising loss points at the LR "
        "schedule: try a lower peak LR or a longer decay."),
    references=("Gur-Ari et al. 2018, Gradient Descent Happens in a Tiny Subspace",),
    time_axis=True,
    records_map="a drifting gradient walks away from its first records in the step panel",
    cause="data",
)

ANALYSIS = Analysis(name="drift", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"drift": ADVICE}, options=DriftOptions, long_history=True)
