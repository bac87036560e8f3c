"""Conflict's table at many source pairs: cut to ``table_rows`` rows, flags, units and figures unchanged."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit.units import heads_per_tensor
from gradforensics.testing import planted_directions as P

SIX = ("zh", "en", "code", "math", "web", "wiki")


def _run(table_rows: int | None) -> tuple[pd.DataFrame, dict[str, np.ndarray], list]:
    ctx = P.planted_conflict(seed=4, sources=SIX, n=96).context({"conflict": {"table_rows": table_rows}})
    res = cf.compute(ctx)
    return res.table, res.series, cf.flags(res, ctx)


def test_a_cut_table_keeps_the_flags_every_unit_and_the_figures() -> None:
    full, full_series, full_flags = _run(None)
    n_units = full.groupby(["tensor", "head"], dropna=False).ngroups
    assert len(full) == n_units * 15                          # 6 sources: 15 pairs a unit
    flagged = full[full["severity"] >= fl.REPORT_FLOOR]
    assert 0 < len(flagged) < 40
    budget = 40
    cut, cut_series, cut_flags = _run(budget)
    assert len(cut) == budget                                  # the flagged rows and one a unit fit the budget
    # the flagged rows, whole, in the table's order; every unit still there (its heads counted)
    key = ["tensor", "head", "source_a", "source_b"]
    pd.testing.assert_frame_equal(cut[cut["severity"] >= fl.REPORT_FLOOR].reset_index(drop=True),
                                  flagged.reset_index(drop=True))
    assert cut.groupby(["tensor", "head"], dropna=False).ngroups == n_units
    assert heads_per_tensor(cut) == heads_per_tensor(full)
    # the kept rows are rows of the full table, unchanged, in its order
    merged = cut.merge(full.reset_index(), on=key, suffixes=("", "_full"))
    assert len(merged) == len(cut) and merged["index"].is_monotonic_increasing
    for c in ("cosine", "p_value", "severity", "standing"):
        np.testing.assert_array_equal(merged[c].to_numpy(float), merged[f"{c}_full"].to_numpy(float))
    # beyond the flags, the budget went to the most severe, then nominally involved rows
    dropped = full.reset_index().merge(cut[key], on=key, how="left", indicator=True)
    dropped = dropped[dropped["_merge"] == "left_only"]
    assert len(dropped) == len(full) - budget
    ranked = np.sort(cut["severity"].to_numpy(float))[::-1][budget - n_units - 1]   # rows chosen by rank alone
    assert dropped["severity"].max() <= ranked
    assert [f.to_dict() for f in cut_flags] == [f.to_dict() for f in full_flags]
    assert cut_series.keys() == full_series.keys()
    for k in full_series:
        np.testing.assert_array_equal(cut_series[k], full_series[k])


def test_below_the_budget_every_row_stays_and_the_budget_floor_holds() -> None:
    full, _, full_flags = _run(None)
    same, _, _ = _run(len(full))
    pd.testing.assert_frame_equal(same, full)
    tiny, _, flags = _run(0)           # the flagged rows, the involved heads of a flagged tensor, one row a unit
    n_units = full.groupby(["tensor", "head"], dropna=False).ngroups
    heads = int(full["head"].notna().sum())
    assert len(tiny) <= n_units + int((full["severity"] >= fl.REPORT_FLOOR).sum()) + heads
    assert len(tiny) < len(full) / 2
    assert [f.to_dict() for f in flags] == [f.to_dict() for f in full_flags]
