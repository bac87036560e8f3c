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

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import LogReadError, SpecError

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.engine.model import AnalysisResult, Context

#: Columns never treated as value series when ``columns`` is not given.
META_COLUMNS = frozenset({
    "step", "_step", "global_step", "iteration", "iter", "epoch", "time", "_time", "timestamp", "_timestamp",
    "wall_time", "walltime", "_runtime", "runtime", "rank", "lr", "learning_rate",
})
STEP_CANDIDATES = ("step", "_step", "global_step", "iteration", "iter", "Step")
MAX_GRID_FACTOR = 20


@dataclass(frozen=True)
class Quality:
    """What had to be repaired to make a series uniform and finite."""

    n_rows: int = 0
    n_nonfinite: int = 0
    n_bad_axis: int = 0
    n_duplicates: int = 0
    n_filled: int = 0
    longest_gap: float = 0.0
    spacing: float = float("nan")

    def __add__(self, other: Quality) -> Quality:
        return Quality(self.n_rows + other.n_rows, self.n_nonfinite + other.n_nonfinite,
                       self.n_bad_axis + other.n_bad_axis, self.n_duplicates + other.n_duplicates,
                       self.n_filled + other.n_filled, max(self.longest_gap, other.longest_gap),
                       self.spacing if math.isfinite(self.spacing) else other.spacing)

    def notes(self) -> list[str]:
        """Human-readable repairs, e.g. ``["3 NaN/Inf values dropped"]``."""
        out = []
        if self.n_bad_axis:
            out.append(f"{self.n_bad_axis} rows without a usable step/time dropped")
        if self.n_nonfinite:
            out.append(f"{self.n_nonfinite} NaN/Inf/empty values dropped")
        if self.n_duplicates:
            out.append(f"{self.n_duplicates} duplicate steps averaged")
        if self.n_filled:
            out.append(f"{self.n_filled} missing samples interpolated (longest gap {self.longest_gap:g})")
        return out

    def as_row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Series:
    """A uniformly sampled, finite series.

    ``x`` is the grid (``unit`` = ``"step"``, ``"s"`` or ``"record"``) with spacing
    ``dt``; ``steps_per_unit`` converts a period in ``unit`` to optimizer steps
    (NaN when unknown).  ``records`` is the (first, last) record index (stores)
    or step (logs) the series covers; ``rank`` is None for the all-ranks series.
    """

    name: str
    tensor: str
    x: np.ndarray
    y: np.ndarray
    unit: str = "step"
    steps_per_unit: float = 1.0
    rank: str | None = None
    quality: Quality = field(default_factory=Quality)
    records: tuple[int, int] = (0, 0)

    @property
    def n(self) -> int:
        return int(self.y.size)

    @property
    def dt(self) -> float:
        return float(self.x[1] - self.x[0]) if self.x.size > 1 else 1.0


@dataclass(frozen=True)
class SeriesGroup:
    """One quantity: its all-ranks series and, with several ranks, one per rank."""

    combined: Series
    ranks: tuple[Series, ...] = ()

    @property
    def name(self) -> str:
        return self.combined.name


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
        above N₀ records); the norm of record i is ``sqrt(K_ii)`` of the whole
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
    for (tensor, head), g in sorted(grams.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        # K_ii: the Gram matrix's diagonal, or lag 0 of the banded Gram (long histories)
        d = (np.asarray(g.band[0], dtype=float).copy() if hasattr(g, "band")
             else np.diag(np.asarray(g.gram, dtype=float)).copy())
        d[~np.asarray(g.finite)] = np.nan
        if head is None:
            sq[tensor] = d
            whole.add(tensor)
        elif tensor not in whole:
            sq[tensor] = sq.get(tensor, 0.0) + d
    return {t: np.sqrt(np.clip(v, 0.0, None)) for t, v in sq.items()}


def from_context(ctx: Context, axis: str = "step") -> list[SeriesGroup]:
    """:func:`from_batches` on an engine :class:`~gradforensics.analysis.engine.model.Context`.

    Gradient norms are included when the pass computed Gram matrices (any
    selected analysis needs ``"gram"``).
    """
    grams: Mapping[tuple[str, int | None], Any] = ctx.grams if ctx.long is None else ctx.long.grams
    return from_batches(ctx.batches, grams, mode=str(ctx.meta.mode), axis=axis)


def series_compute(name: str, analyze: Callable[[Sequence[SeriesGroup], Any], AnalysisResult]
                   ) -> Callable[[Context], AnalysisResult]:
    """The ``compute`` of a series analysis: its options, the store's series, then *analyze*.

    The loss-curve analyses differ only in *analyze*; each declares
    ``compute=series_compute(NAME, analyze_series)``.
    """
    from gradforensics.analysis.signal.spectrum import SpectrumOptions

    def compute(ctx: Context) -> AnalysisResult:
        opt = ctx.options_for(name, SpectrumOptions)
        return analyze(from_context(ctx, opt.axis), opt)

    return compute


# -------------------------------------------------------------------------- logs
def read_table(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A CSV / TSV or JSON Lines log as a DataFrame; one-line :class:`LogReadError` if unreadable."""
    import pandas as pd

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise LogReadError(f"{p}: no such file; expected a CSV or JSON Lines training log.")
    kind = _log_kind(p)
    try:
        if kind == "jsonl":
            df = _read_json(p)
        else:
            df = pd.read_csv(p, sep=None, engine="python") if kind == "tsv" else pd.read_csv(p)
    except (ValueError, OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise LogReadError(f"{p}: cannot read as {kind.upper()} ({type(exc).__name__}: {msg}).") from exc
    if df.empty:
        raise LogReadError(f"{p}: holds no rows.")
    return df


def _read_json(p: str) -> pd.DataFrame:
    """JSON Lines, or one JSON array of records (a ``.json`` export)."""
    import pandas as pd

    with open(p, "rb") as fh:
        head = fh.read(64).lstrip()
    return pd.read_json(p) if head.startswith(b"[") else pd.read_json(p, lines=True)


def _log_kind(p: str) -> str:
    low = p.lower()
    if low.endswith((".jsonl", ".ndjson", ".json", ".jsonl.gz")):
        return "jsonl"
    if low.endswith((".tsv", ".tab")):
        return "tsv"
    if low.endswith(".csv"):
        return "csv"
    try:
        with open(p, "rb") as fh:
            head = fh.read(256).lstrip()
    except OSError as exc:
        raise LogReadError(f"{p}: cannot open ({exc.strerror or exc}).") from exc
    return "jsonl" if head.startswith(b"{") else "csv"


@dataclass(frozen=True)
class LogSpec:
    """Which columns of a log hold what (validated against each file)."""

    step_col: str | None = None
    time_col: str | None = None
    rank_col: str | None = None
    columns: tuple[str, ...] = ()


def read_logs(paths: Sequence[str | os.PathLike[str]], spec: LogSpec | None = None) -> list[SeriesGroup]:
    """Series of one or several logs.  Several files are several ranks (labelled by
    file name) of the same value columns.

    Raises
    ------
    LogReadError
        A file is unreadable, a named column is missing, or no numeric value column exists.
    """
    spec = spec or LogSpec()
    frames = []
    for i, path in enumerate(paths):
        df = read_table(path)
        frames.append(_samples(df, os.fspath(path), spec, label=None if len(paths) == 1 else _label(paths, i)))
    names: list[str] = []
    for f in frames:
        names += [c for c in f["values"] if c not in names]
    out = []
    for col in names:
        parts = [f for f in frames if col in f["values"]]
        cat = {k: np.concatenate([np.asarray(f[k]) for f in parts]) for k in ("x", "steps", "rank")}
        ys = np.concatenate([f["values"][col] for f in parts])
        ranks = cat["rank"] if any(f["has_rank"] for f in parts) else None
        out.append(group(cat["x"], ys, name=col, unit=parts[0]["unit"], ranks=ranks, records=cat["steps"],
                         steps=cat["steps"] if parts[0]["unit"] == "s" else None))
    return out


def _label(paths: Sequence[Any], i: int) -> str:
    stems = [os.path.basename(os.fspath(p)) for p in paths]
    return stems[i] if len(set(stems)) == len(stems) else f"{i}:{stems[i]}"


def _samples(df: pd.DataFrame, path: str, spec: LogSpec, label: str | None) -> dict[str, Any]:
    import pandas as pd

    def col(name: str | None, what: str) -> np.ndarray | None:
        if name is None:
            return None
        if name not in df.columns:
            raise LogReadError(f"{path}: no {what} column {name!r}; columns are {list(map(str, df.columns))[:20]}.")
        return pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=float)

    step_name = spec.step_col or next((c for c in STEP_CANDIDATES if c in df.columns), None)
    steps = col(step_name, "step")
    if steps is None:
        steps = np.arange(len(df), dtype=float)
    t = col(spec.time_col, "time")
    col(spec.rank_col, "rank")  # validates the name
    rank = df[spec.rank_col].astype(str).to_numpy() if spec.rank_col else None
    used = {c for c in (step_name, spec.time_col, spec.rank_col) if c}
    values = _value_columns(df, path, spec, used)
    has_rank = rank is not None or label is not None
    if rank is None:
        rank = np.full(len(df), label if label is not None else "0", dtype=object)
    elif label is not None:
        rank = np.array([f"{label}/{r}" for r in rank], dtype=object)
    return {"x": steps if t is None else t, "steps": steps, "rank": rank, "has_rank": has_rank,
            "unit": "step" if t is None else "s", "values": values}


def _value_columns(df: pd.DataFrame, path: str, spec: LogSpec, used: set[str]) -> dict[str, np.ndarray]:
    import pandas as pd

    by_name = {str(c): c for c in df.columns}
    if spec.columns:
        missing = [c for c in spec.columns if c not in by_name]
        if missing:
            raise LogReadError(f"{path}: no column(s) {missing}; columns are {list(by_name)[:20]}.")
        names = list(spec.columns)
    else:
        names = [c for c in by_name if c not in used and c.lower() not in META_COLUMNS]
    out = {}
    for c in names:
        v = pd.to_numeric(df[by_name[c]], errors="coerce").to_numpy(dtype=float)
        if spec.columns or np.isfinite(v).any():
            out[c] = v
    if not out:
        raise LogReadError(f"{path}: no numeric value column (columns: {list(map(str, df.columns))[:20]}); "
                           "name them with --columns.")
    return out

