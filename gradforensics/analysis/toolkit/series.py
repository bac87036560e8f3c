"""Per-step series for the loss-curve analyses: from a store or from a training log.

The loss-curve analyses (:mod:`~gradforensics.analysis.kinds.loss_spectrum`,
:mod:`~gradforensics.analysis.kinds.fractal`, :mod:`~gradforensics.analysis.kinds.coherence`)
need uniformly sampled, finite 1-D series.  This module turns what a store or
an experiment tracker holds into exactly that, and says what it had to repair:

- rows whose step (or time) is missing are dropped;
- NaN / Inf / empty values are dropped (counted in ``n_nonfinite``);
- duplicate steps are averaged (``n_duplicates``: micro-batches, restarts);
- the samples are put on a uniform grid of the median spacing, missing grid
  points filled by linear interpolation (``n_filled``, ``longest_gap``).

A store gives ``batches/loss`` and, when the engine computed Gram matrices, the
gradient norm of every tensor (``sqrt(diag K)``).  A log (CSV or JSON Lines) gives
one series per value column.  Several ranks (a rank column, or several files)
give one series per rank plus their per-step mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.series import Quality, Series, SeriesGroup
from gradforensics.errors import SpecError

if TYPE_CHECKING:

    from gradforensics.analysis.contract.model import AnalysisResult, Context
    from gradforensics.analysis.toolkit.signal.detrending import DetrendCache

__all__ = ["MAX_GRID_FACTOR", "from_batches", "from_context", "group", "regularize", "series_compute", "shared_detrending",
           "shared_series"]


MAX_GRID_FACTOR = 20


# ------------------------------------------------------------------ uniform grid
def regularize(x: Any, y: Any, *, name: str, tensor: str | None = None, unit: str = "step",
               steps: Any = None, rank: str | None = None, records: Any = None) -> Series:
    """Put samples ``(x, y)`` on a uniform grid; see the module docstring.

    Parameters
    ----------
    x, y
        Sampling coordinate (step, seconds or record) and values, any order.
    steps
        Optimizer steps of the samples when ``x`` is time: sets ``steps_per_unit``.
    records
        Record index (or step) of each sample, for :attr:`Series.records`.
    """
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if x.shape != y.shape:
        raise SpecError(f"{name}: {x.size} axis values for {y.size} values.")
    rec = np.arange(x.size) if records is None else np.asarray(records, dtype=float).ravel()
    bad_axis = ~np.isfinite(x)
    bad_val = ~bad_axis & ~np.isfinite(y)
    keep = ~(bad_axis | bad_val)
    q = Quality(n_rows=int(x.size), n_nonfinite=int(bad_val.sum()), n_bad_axis=int(bad_axis.sum()))
    xs, ys, rs = x[keep], y[keep], rec[keep]
    spu = _steps_per_unit(x, steps, keep) if unit == "s" else 1.0
    if xs.size == 0:
        return Series(name, tensor or name, np.zeros(0), np.zeros(0), unit, spu, rank, q, (0, 0))
    ux, inv, counts = np.unique(xs, return_inverse=True, return_counts=True)
    uy = np.bincount(inv, weights=ys) / counts
    q = replace(q, n_duplicates=int(xs.size - ux.size))
    grid, filled, gap, dt = _grid(ux, unit)
    gy = np.interp(grid, ux, uy) if ux.size > 1 else uy.copy()
    q = replace(q, n_filled=filled, longest_gap=gap, spacing=dt)
    span = (int(np.nanmin(rs)), int(np.nanmax(rs))) if rs.size else (0, 0)
    return Series(name, tensor or name, grid, gy, unit, spu, rank, q, span)


def _grid(ux: np.ndarray, unit: str) -> tuple[np.ndarray, int, float, float]:
    """Uniform grid over sorted unique *ux*: (grid, filled points, longest gap, spacing).

    The spacing is the most common step between samples (a logging interval), or
    for a time axis, whose spacings jitter, the median one.
    """
    if ux.size < 2:
        return ux.copy(), 0, 0.0, float("nan")
    d = np.diff(ux)
    if unit == "s":
        dt = float(np.median(d))
    else:
        vals, counts = np.unique(d, return_counts=True)
        dt = float(vals[np.argmax(counts)])
    n = int(np.rint((ux[-1] - ux[0]) / dt)) + 1
    if n > MAX_GRID_FACTOR * ux.size:  # a few absurd steps would blow the grid up: coarsen it
        n = MAX_GRID_FACTOR * ux.size
        dt = float(ux[-1] - ux[0]) / (n - 1)
    grid = ux[0] + dt * np.arange(n)
    j = np.clip(np.searchsorted(ux, grid), 1, ux.size - 1)
    near = np.minimum(np.abs(grid - ux[j - 1]), np.abs(ux[j] - grid))
    filled = int(np.count_nonzero(near > 0.5 * dt * (1 + 1e-9)))
    return grid, filled, float(d.max()), dt


def _steps_per_unit(t: np.ndarray, steps: Any, keep: np.ndarray) -> float:
    """Optimizer steps per second: least-squares slope of step on time (robust to
    several ranks logging the same step at interleaved times)."""
    if steps is None:
        return float("nan")
    s = np.asarray(steps, dtype=float)[keep]
    tt = t[keep]
    ok = np.isfinite(s) & np.isfinite(tt)
    if ok.sum() < 2 or not np.ptp(tt[ok]) > 0:
        return float("nan")
    return float(np.polyfit(tt[ok], s[ok], 1)[0])


def group(x: Any, y: Any, *, name: str, tensor: str | None = None, unit: str = "step", steps: Any = None,
          ranks: Any = None, records: Any = None) -> SeriesGroup:
    """A :class:`SeriesGroup` from flat samples with an optional rank label per sample."""
    x, y = np.asarray(x), np.asarray(y)
    rec = np.arange(x.size) if records is None else np.asarray(records)
    st = None if steps is None else np.asarray(steps)
    labels = None if ranks is None else np.asarray(ranks).astype(str)
    if labels is None or np.unique(labels).size < 2:
        return SeriesGroup(regularize(x, y, name=name, tensor=tensor, unit=unit, steps=st, records=rec))
    per = []
    for lab in _sorted_labels(np.unique(labels)):
        m = labels == lab
        per.append(regularize(x[m], y[m], name=name, tensor=tensor, unit=unit, rank=str(lab), records=rec[m],
                              steps=None if st is None else st[m]))
    combined = regularize(x, y, name=name, tensor=tensor, unit=unit, steps=st, records=rec)
    within = sum((p.quality for p in per), Quality())
    q = replace(combined.quality, n_duplicates=within.n_duplicates)
    return SeriesGroup(replace(combined, quality=q), tuple(per))


def _sorted_labels(labels: Iterable[str]) -> list[str]:
    def key(s: str) -> tuple[int, float, str]:
        try:
            return (0, float(s), s)
        except ValueError:
            return (1, 0.0, s)

    return sorted(labels, key=key)


# ------------------------------------------------------------------------ stores
def from_batches(batches: Mapping[str, np.ndarray], grams: Mapping[tuple[str, int | None], Any] | None = None,
                 *, mode: str = "training", axis: str = "step") -> list[SeriesGroup]:
    """Series of a store: ``batches/loss`` and, from *grams*, ``grad_norm/<tensor>``.

    Parameters
    ----------
    batches
        The store's ``batches/*`` arrays (``loss`` and ``step`` at least).
    grams
        ``Context.grams`` (or ``Context.long.grams``: lag 0 of the banded Gram
        above N₀ records, kept per record for whole tensors); the norm of record i is ``sqrt(K_ii)`` of the whole
        tensor (the sum over heads when only heads were computed); records with
        a non-finite gradient are missing values.
    mode
        ``"replay"`` stores hold one checkpoint: the axis is then the record order.
    axis
        ``"step"`` (default) or ``"time"`` (``batches/time``, seconds).
    """
    n = int(np.asarray(batches["loss"]).size)
    rec = np.arange(n)
    ranks = batches.get("rank")
    steps = np.asarray(batches.get("step", rec), dtype=float)
    if mode == "replay":
        x, unit, st = _replay_axis(ranks, n), "record", None
    elif axis == "time" and "time" in batches:
        x, unit, st = np.asarray(batches["time"], dtype=float), "s", steps
    else:
        x, unit, st = steps, "step", None
    out = [group(x, batches["loss"], name="batches/loss", unit=unit, steps=st, ranks=ranks, records=rec)]
    for tensor, norm in _grad_norms(grams or {}).items():
        out.append(group(x, norm, name=f"grad_norm/{tensor}", tensor=tensor, unit=unit, steps=st, ranks=ranks,
                         records=rec))
    return out


def _replay_axis(ranks: Any, n: int) -> np.ndarray:
    """Record order; with several ranks, the ordinal of each record within its rank."""
    if ranks is None:
        return np.arange(n, dtype=float)
    r = np.asarray(ranks)
    x = np.zeros(n)
    for lab in np.unique(r):
        m = r == lab
        x[m] = np.arange(int(m.sum()))
    return x


def _grad_norms(grams: Mapping[tuple[str, int | None], Any]) -> dict[str, np.ndarray]:
    sq: dict[str, np.ndarray] = {}
    whole: set[str] = set()
    for tensor, head in sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        if head is not None and tensor in whole:
            continue                        # the whole tensor's norms are there: no head is read
        g = grams[(tensor, head)]           # one at a time: a spilled pass reads each from disk
        # K_ii: the Gram matrix's diagonal, or lag 0 of the banded Gram (long histories: whole tensors only)
        if hasattr(g, "norms2"):
            if head is not None:
                continue
            d = np.asarray(g.norms2(), dtype=float)
        else:
            d = np.diag(np.asarray(g.gram, dtype=float)).copy()
            d[~np.asarray(g.finite)] = np.nan
        if head is None:
            sq[tensor] = d
            whole.add(tensor)
        elif tensor not in whole:
            sq[tensor] = sq.get(tensor, 0.0) + d
    return {t: np.sqrt(np.clip(v, 0.0, None)) for t, v in sq.items()}


def from_context(ctx: Context, axis: str = "step") -> list[SeriesGroup]:
    """:func:`from_batches` on an engine :class:`~gradforensics.analysis.contract.model.Context`.

    Gradient norms are included when the pass computed Gram matrices (any
    selected analysis needs ``"gram"``).
    """
    grams: Mapping[tuple[str, int | None], Any] = ctx.grams if ctx.long is None else ctx.long.grams
    return from_batches(ctx.batches, grams, mode=str(ctx.meta.mode), axis=axis)


def series_compute(name: str, analyze: Callable[..., AnalysisResult], shares_detrending: bool = False
                   ) -> Callable[[Context], AnalysisResult]:
    """The ``compute`` of a series analysis: its options, the store's series, then *analyze*.

    The loss-curve analyses differ only in *analyze*; each declares
    ``compute=series_compute(NAME, analyze_series)``.  With *shares_detrending*,
    *analyze* takes a third argument, the run's
    :class:`~gradforensics.analysis.toolkit.signal.detrending.DetrendCache`
    (:func:`shared_detrending`).
    """
    from gradforensics.analysis.toolkit.signal.spectrum import SpectrumOptions

    def compute(ctx: Context) -> AnalysisResult:
        opt = ctx.options_for(name, SpectrumOptions)
        if shares_detrending:
            return analyze(shared_series(ctx, opt.axis), opt, shared_detrending(ctx))
        return analyze(shared_series(ctx, opt.axis), opt)

    return compute


def shared_detrending(ctx: Context) -> DetrendCache:
    """The run's :class:`~gradforensics.analysis.toolkit.signal.detrending.DetrendCache`, one per context.

    ``loss_spectrum`` and ``fractal`` detrend and winsorise the same shared series alike
    (at N = 32 both windows are 31): the second reads what the first computed.
    """
    from gradforensics.analysis.toolkit.signal.detrending import DetrendCache

    got = ctx.shared.get("detrending")
    if got is None:
        got = ctx.shared["detrending"] = DetrendCache()
    return got


def shared_series(ctx: Context, axis: str = "step") -> list[SeriesGroup]:
    """:func:`from_context`, built once per context and axis for every loss-curve analysis.

    The three series analyses used to build the same series each (a store of 2,000
    tensors: 2,000 gradient-norm series read and regularised three times).  The
    arrays of the shared series are read-only, so no analysis can change what the
    next one reads.
    """
    key = ("series", axis)
    got = ctx.shared.get(key)
    if got is None:
        got = ctx.shared[key] = [_frozen(g) for g in from_context(ctx, axis)]
    return list(got)


def _frozen(g: SeriesGroup) -> SeriesGroup:
    for s in (g.combined, *g.ranks):
        for v in vars(s).values():
            if isinstance(v, np.ndarray):
                v.setflags(write=False)
    return g
