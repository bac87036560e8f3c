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

The statistics are :mod:`gradforensics.analysis.kinds.drift.stats`; this module tabulates,
weighs, flags and draws them.
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
from gradforensics.analysis.kinds.drift.stats import UnitDrift, drift_slab
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.batches import LEARNING_DROP, loss_change
from gradforensics.analysis.toolkit.parallel import map_slabs

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "EFFECT_FULL", "MIN_RECORDS", "DriftOptions", "compute", "flags", "pd_int", "plot"]


COLUMNS = [
    "tensor", "head", "layer", "n_records", "n_excluded", "window", "cos_early", "cos_late",
    "cos_late_debiased", "rotation", "rho", "p_value", "rho_windows", "since_record", "since_step",
    "aligned_source", "aligned_cosine", "loss_change", "severity",
]
EFFECT_FULL = 0.5  # rotation at which the effect score saturates
LEARNING_WEIGHT = 0.45  # severity weight of drift while the loss falls: context, never an alarm
ALIGN_MIN, ALIGN_MARGIN = 0.3, 0.15
#: Steps of history below which no drift can reach 0.5 (the opening window of 4 leaves too few records
#: for the trend's p-value): a planted 90° turn at SNR 200 stays at 0 with 13 (``tests/test_not_judged.py``).
MIN_RECORDS = 14


@dataclass(frozen=True)
class DriftOptions(Options):
    """``window``: records per window (default ``max(4, ceil(N/16))``)."""

    window: int | None = None

    analysis_name = "drift"
    constraints: ClassVar[Constraints] = {"window": [Interval(int, 2, None), None]}


# ------------------------------------------------------------------ analysis
def compute(ctx: Context) -> AnalysisResult:
    """The drift table and per-record series of every tensor and head.

    In the long-history regime the same statistics run on the per-window,
    per-source mean gradients (super-records); ``since_record`` is then the first
    record of the window where the fall starts, and the series are per super-record.
    """
    res = _compute(ctx) if ctx.long is None else _compute_long(ctx)
    res.not_judged = fl.short_history(ctx, "drift", MIN_RECORDS)
    return res


def _compute_long(ctx: Context) -> AnalysisResult:
    assert ctx.long is not None
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
        experts = un.is_experts(ctx, r.tensor)
        ev = _evidence(r) | ({"expert": head} if experts and head is not None else {})
        out.append(Flag(kind="drift", tensor=r.tensor, head=head, sources=src, severity=float(r.severity),
                        records=(since, last), evidence=ev, summary=_summary(r, head, experts)))
    t = result.table
    involved = fl.involved_heads(t, (t["rotation"] > 0.1) & (t["p_value"] < 0.05))
    return fl.dedupe_heads(out, un.heads_per_tensor(t), involved, by_sources=False)


def _ok(x: Any) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _evidence(r: Any) -> dict[str, Any]:
    return {"rotation": r.rotation, "cos_early": r.cos_early, "cos_late": r.cos_late, "rho": r.rho,
            "p_value": r.p_value, "since_step": r.since_step, "aligned_cosine": r.aligned_cosine,
            "loss_change": r.loss_change}


def _summary(r: Any, head: int | None, experts: bool = False) -> str:
    where = un.where(r.tensor, head, experts)
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
    where = un.where(flag.tensor, flag.head, "expert" in flag.evidence)
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
