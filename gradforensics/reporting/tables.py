"""Tables: one CSV per analysis (``tables/<name>.csv``), and the layer-by-layer table.

CSV contract (design): a row per tensor (and head, and source or source pair),
columns ``tensor``, ``head`` first; ``head`` empty on a whole-tensor row.  The
layer-by-layer table joins every analysis: a row per (tensor, head) seen in any
table or flag, a column per analysis holding the highest flag severity there
(0 = analysed, no flag; empty = not analysed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics._text import csv_cell
from gradforensics.reporting import names
from gradforensics.reporting.figures import flag_analyses
from gradforensics.reporting.paths import under
from gradforensics.store.names import check_analysis_name, layer_of

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.contract.model import Findings

__all__ = ["contract_order", "csv_safe", "layer_table", "write_csv", "write_csvs"]



def contract_order(table: pd.DataFrame) -> pd.DataFrame:
    """``tensor``, ``head`` first; ``head`` as nullable integers (empty on whole-tensor rows)."""
    import pandas as pd

    t = table.copy()
    first = [c for c in ("tensor", "head") if c in t.columns]
    t = t[first + [c for c in t.columns if c not in first]]
    if "head" in t.columns:
        t["head"] = pd.to_numeric(t["head"], errors="coerce").astype("Int64")
    return t


def csv_safe(table: pd.DataFrame) -> pd.DataFrame:
    """*table* with every text cell and column name a spreadsheet would evaluate neutralised.

    Only string cells change (:func:`gradforensics._text.csv_cell`): numeric
    columns - a negative cosine - stay numbers.
    """
    from pandas.api.types import is_object_dtype, is_string_dtype

    t = table.copy()
    for i in range(t.shape[1]):
        col = t.iloc[:, i]
        if is_object_dtype(col.dtype) or is_string_dtype(col.dtype):
            t.isetitem(i, col.map(csv_cell, na_action="ignore"))
    t.columns = [csv_cell(c) for c in t.columns]
    return t


def write_csv(table: pd.DataFrame, path: Path, ordered: bool = False) -> Path:
    """The one way gradforensics writes a CSV: contract column order, formula-safe cells, empty NA.

    *ordered*: *table* is :func:`contract_order`'s already (it is not ordered again).
    """
    csv_safe(table if ordered else contract_order(table)).to_csv(path, index=False, na_rep="")
    return path


def write_csvs(findings: Findings, out_dir: Path, ordered: dict[str, pd.DataFrame] | None = None) -> dict[str, Path]:
    """``out_dir/tables/<name>.csv`` for every analysis result (names checked, paths kept under *out_dir*).

    *ordered*: the results' tables in :func:`contract_order` by analysis name, when made already.
    """
    d = under(out_dir, "tables")
    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name, res in findings.results.items():
        check_analysis_name(name, "report: tables")
        table = ordered.get(name) if ordered is not None else None
        out[f"tables/{name}"] = write_csv(res.table if table is None else table,
                                          under(out_dir, "tables", f"{name}.csv"), ordered=table is not None)
    return out


def layer_table(findings: Findings) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of the layer-by-layer severity table, deepest problems first within a layer."""
    analyses = list(findings.results)
    flag_rows = flag_analyses(findings)
    for n in dict.fromkeys(flag_rows):
        if n not in analyses:
            analyses.append(n)
    rows: dict[tuple[str, int | None], dict[str, Any]] = {}

    def row(tensor: str, head: int | None) -> dict[str, Any]:
        key = (tensor, head)
        if key not in rows:
            lay = layer_of(tensor)
            rows[key] = {"layer": lay, "tensor": tensor, "head": head, **{a: None for a in analyses},
                         "max": 0.0, "flags": []}
        return rows[key]

    for a in analyses:
        for t, h in names.table_units(findings.table(a)):
            r = row(t, h)
            if r[a] is None:
                r[a] = 0.0
    for f, a in zip(findings.flags, flag_rows):
        r = row(f.tensor, f.head)
        r[a] = max(r[a] or 0.0, f.severity)
        r["max"] = max(r["max"], f.severity)
        r["flags"].append(f.kind)
    out = sorted(rows.values(), key=lambda r: (math.inf if r["layer"] is None else r["layer"], r["tensor"],
                                               -1 if r["head"] is None else r["head"]))
    for r in out:
        r["flags"] = ", ".join(dict.fromkeys(r["flags"]))
    return ["layer", "tensor", "head", *analyses, "max", "flags"], out
