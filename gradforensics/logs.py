"""Training logs (CSV / TSV, JSON Lines, a JSON array of records) read into per-step series.

``gradforensics loss LOG ...`` reads an experiment tracker's export with
:func:`read_logs`: one :class:`~gradforensics.analysis.contract.series.SeriesGroup`
per value column (per rank where a rank column, or several files, say so), on a
uniform grid (:func:`gradforensics.analysis.toolkit.series.group`).  A log is data
from outside: unreadable, empty or mis-specified files are one
:class:`~gradforensics.errors.LogReadError` line.  This is input reading, not an
analysis, so it lives beside the store readers rather than in ``analysis/``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.toolkit.series import group
from gradforensics.errors import LogReadError

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.contract.series import SeriesGroup

__all__ = ["MAX_JSON_ROWS", "META_COLUMNS", "STEP_CANDIDATES", "LogSpec", "read_logs", "read_table"]

#: Columns never treated as value series when ``columns`` is not given.
META_COLUMNS = frozenset({
    "step", "_step", "global_step", "iteration", "iter", "epoch", "time", "_time", "timestamp", "_timestamp",
    "wall_time", "walltime", "_runtime", "runtime", "rank", "lr", "learning_rate",
})
STEP_CANDIDATES = ("step", "_step", "global_step", "iteration", "iter", "Step")
#: the most objects and arrays (rows) a JSON / JSON Lines log may hold; CSV logs have no such cap
MAX_JSON_ROWS = 2_000_000


def read_table(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A CSV / TSV or JSON Lines log as a DataFrame; one-line :class:`LogReadError` if unreadable."""
    import pandas as pd

    from gradforensics.replay.untrusted import check_regular

    p = os.fspath(path)
    if not os.path.exists(p):
        raise LogReadError(f"{p}: no such file; expected a CSV or JSON Lines training log.")
    check_regular(p, LogReadError)              # a FIFO or device would block or never end
    kind = _log_kind(p)
    if kind == "jsonl" and not p.lower().endswith(".gz"):
        _check_rows(p)
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


def _check_rows(p: str) -> None:
    """Refuse a JSON log of more than :data:`MAX_JSON_ROWS` objects and arrays, counted before pandas parses it.

    pandas builds a Python dict per row first: a 95 MB file of ``{},`` cost 2.6 GB (a JSON
    array) and 4.9 GB (JSON Lines) to say it holds no rows.  The count (every ``{`` and ``[``
    byte, an upper bound) streams the file in blocks.
    """
    n = 0
    try:
        with open(p, "rb") as fh:
            while block := fh.read(1 << 23):
                n += block.count(b"{") + block.count(b"[")
    except OSError as exc:
        raise LogReadError(f"{p}: cannot open ({exc.strerror or exc}).") from exc
    if n > MAX_JSON_ROWS:
        raise LogReadError(f"{p}: up to {n:,} JSON objects and arrays; a JSON log is read up to {MAX_JSON_ROWS:,} "
                           "rows (pandas holds each as a dict): export a longer log as CSV.")


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

