"""Output-logit divergence: growth of log Z of the output logits (``logits/<module>/<stat>``).

Capture keeps, per record, ``log Z = logsumexp`` of the output logits over the vocabulary,
its mean and max over the record's positions, and the largest and the mean logit
(:mod:`gradforensics.recording.logits`).  Per logit module, over windows of records:

* the **opening level** of log Z (the first window's mean) and the **opening spread**
  ``s0 = mean(log Z) - mean(logit)`` of that window.  The spread is the run's own scale:
  for every position ``logsumexp(z) - mean(z) >= log V`` (Jensen; equal for uniform logits),
  so at initialisation ``s0 ~ log V``, and for a run captured later it is larger (a
  conservative scale);
* the **growth** ``close - open`` in nats (``close``: the last window's mean log Z) and
  ``rel_growth = growth / s0``: how many "vocabularies" Z grew by (``rel_growth = 1``: Z
  grew V-fold over its opening);
* the **onset** (``since_record``): the first window from which every later window stays
  above ``open + s0``, at least two windows before the end: a sustained rise, not a spike;
* the **slope** (nats per record and per step): Theil-Sen over the windows from the onset on.

Severity (training mode, with an onset): ``log(rel_growth) / log 4``, clipped to [0, 1]:
0.5 when log Z grew by twice the opening spread, 1 from four times.  A model that learns grows
confident, and a confident softmax has a large spread: when the loss *fell* meanwhile (from the
onset window to the last, by :data:`~gradforensics.analysis.toolkit.batches.LEARNING_DROP` or more),
the growth of the spread is that learning, and only the common shift counts
(``log(max(shift, 0) / s0) / log 4``: the logits drifting, which learning does not need).  A healthy language
model's log Z starts near ``log V`` and stays within a few nats of it, or falls; a growth of
tens of nats (``rel_growth`` of several) is the output-logit divergence of Wortsman et al.
(2023): the logits blow up, the softmax saturates, and the loss follows.  A fall of log Z
is reported in the table (negative growth) and not flagged.  In a replay store (one
checkpoint) the records are not a history: the table is filled, no flag is raised.

The evidence splits the growth into the logits' common shift (``mean(logit)``, which the
softmax ignores but bf16 does not) and their spread (``log Z - mean(logit)``: the softmax
saturating).  The remedies are the standard ones: the z-loss ``1e-4 * log^2 Z`` (PaLM,
Chowdhery et al. 2022; Wortsman et al. 2023), a lower peak learning rate or a longer
warm-up, and a separate, lower learning rate (or weight decay) for the output layer.

References
----------
Wortsman, M. et al. (2023). Small-scale proxies for large-scale Transformer training instabilities.
Chowdhery, A. et al. (2022). PaLM: scaling language modeling with pathways (z-loss, section 5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.batches import LEARNING_DROP
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.analysis.toolkit.stats import rank_trend

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "NAME", "WINDOWS", "LogitsOptions", "compute", "flags", "logit_row",
           "onset_window", "plot", "row_severity", "severity", "windowed"]

NAME = "logits"
WINDOWS = 32
MIN_AFTER = 2          # windows an onset must hold for (a sustained rise, not the last window's spike)


@dataclass(frozen=True)
class LogitsOptions(Options):
    """Options of the logits flags.

    Parameters
    ----------
    min_severity
        Flags below this severity are not emitted.
    """

    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"min_severity": Interval(float, 0, 1, "both")}


# --------------------------------------------------------------------- statistics
def windowed(x: Any, edges: np.ndarray, how: str = "mean") -> np.ndarray:
    """Per window of records (``edges``): the mean (or max) of the values of *x* that are not NaN (an
    overflowed +inf log Z counts: the window is +inf); NaN where every value is NaN."""
    x = np.asarray(x, float)
    out = np.full(len(edges) - 1, np.nan)
    for w, (a, b) in enumerate(itertools.pairwise(edges)):
        v = x[a:b][~np.isnan(x[a:b])]
        if v.size:
            out[w] = v.max() if how == "max" else v.mean()
    return out


def onset_window(level: np.ndarray, threshold: float, min_after: int = MIN_AFTER) -> int | None:
    """First window from which every later window of *level* is above *threshold* (at least *min_after* of them)."""
    s = np.asarray(level, float)
    below = np.flatnonzero(~(s > threshold))
    start = int(below[-1]) + 1 if below.size else 0
    return start if s.size - start >= min_after else None


def severity(rel_growth: float) -> float:
    """``log(rel_growth) / log 4`` in [0, 1]: 0 up to 1, 0.5 at 2, 1 from 4 (growth over the opening spread)."""
    if rel_growth == np.inf:
        return 1.0                    # log Z overflowed
    if not np.isfinite(rel_growth) or rel_growth <= 1.0:
        return 0.0
    return float(min(1.0, np.log(rel_growth) / np.log(4.0)))


def row_severity(row: dict[str, Any]) -> tuple[float, bool]:
    """``(severity, learning)`` of a table row: of the whole growth, or of the shift alone while the loss fell."""
    change = float(row["loss_change"])
    learning = bool(np.isfinite(change) and change <= -LEARNING_DROP)
    s0 = float(row["spread_first"])
    if learning:
        return (severity(max(float(row["logit_shift"]), 0.0) / s0) if s0 > 0 else 0.0), True
    return severity(float(row["rel_growth"])), False


def _theil_sen(x: np.ndarray, y: np.ndarray) -> float:
    """Median of the pairwise slopes (Theil-Sen); NaN with fewer than two finite points."""
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size < 2:
        return np.nan
    i, j = np.triu_indices(x.size, 1)
    dx = x[j] - x[i]
    keep = dx != 0
    return float(np.median((y[j] - y[i])[keep] / dx[keep])) if keep.any() else np.nan


def _first_last(x: np.ndarray) -> tuple[float, float]:
    ok = np.flatnonzero(np.isfinite(x))
    return (float(x[ok[0]]), float(x[ok[-1]])) if ok.size else (np.nan, np.nan)


def logit_row(module: str, stats: dict[str, np.ndarray], loss: np.ndarray, steps: np.ndarray,
              edges: np.ndarray) -> dict[str, Any]:
    """The table row of one logit module from its per-record ``stats`` (``LOGIT_FIELDS``), the loss and the steps."""
    lz = windowed(stats["logz_mean"], edges)
    with np.errstate(invalid="ignore"):       # an overflowed record: inf - inf is no spread
        spread = windowed(np.asarray(stats["logz_mean"], float) - np.asarray(stats["logit_mean"], float), edges)
    lzmax = windowed(stats["logz_max"], edges, "max")
    open_, close = float(lz[0]), float(lz[-1])
    s0 = float(spread[0])
    growth = close - open_
    rel = growth / s0 if s0 > 0 else np.nan
    start = onset_window(lz, open_ + s0) if np.isfinite(open_) and s0 > 0 and lz.size > MIN_AFTER else None
    centres = (edges[:-1] + edges[1:] - 1) / 2.0
    tail = slice(start or 0, None)
    slope = _theil_sen(centres[tail], lz[tail])
    span_steps = float(steps[-1] - steps[0]) if steps.size > 1 else np.nan
    per_record = span_steps / (steps.size - 1) if steps.size > 1 and span_steps > 0 else np.nan
    rho, p = rank_trend(lz, min_n=6, skip_nonfinite=True)
    since = int(edges[start]) if start is not None else None
    lw = windowed(loss, edges)
    norm_first, norm_last = _first_last(np.asarray(stats["row_norm_ratio"], float))
    return {
        "tensor": module, "head": None, "logz_first": open_, "logz_last": close, "growth": growth,
        "rel_growth": rel, "spread_first": s0, "spread_last": float(spread[-1]),
        "logit_shift": growth - (float(spread[-1]) - s0), "logz_max_first": float(lzmax[0]),
        "logz_max_last": float(lzmax[-1]), "logit_max_last": float(windowed(stats["logit_max"], edges, "max")[-1]),
        "slope": slope, "slope_step": slope / per_record if np.isfinite(per_record) else np.nan,
        "trend_rho": rho, "trend_p": p, "since_record": since,
        "since_step": int(steps[since]) if since is not None and since < steps.size else None,
        "loss_first": float(lw[0]), "loss_last": float(lw[-1]),
        "loss_change": float(lw[-1] / lw[start or 0] - 1.0) if lw[start or 0] > 0 else np.nan,
        "row_norm_first": norm_first, "row_norm_last": norm_last,
    }


COLUMNS = ["tensor", "head", "logz_first", "logz_last", "growth", "rel_growth", "since_record", "since_step",
           "slope", "slope_step", "spread_first", "spread_last", "logit_shift", "logz_max_first", "logz_max_last",
           "logit_max_last", "trend_rho", "trend_p", "loss_first", "loss_last", "loss_change", "row_norm_first",
           "row_norm_last"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    from gradforensics.store.schema import LOGIT_FIELDS

    store = ctx.store
    modules = store.logit_modules if store is not None else []
    n = ctx.n_records
    edges = window_edges(n, WINDOWS)
    loss = np.asarray(ctx.batches.get("loss", np.full(n, np.nan)), float)
    steps = np.asarray(ctx.batches.get("step", np.arange(n)), float)
    rows, series = [], {}
    for m in modules:
        stats = {k: np.asarray(store.logits(m, k), float) for k in LOGIT_FIELDS} if store is not None else {}
        if n < 2:
            continue
        rows.append(logit_row(m, stats, loss, steps, edges))
        series.update({f"logz_mean/{m}": windowed(stats["logz_mean"], edges),
                       f"logz_max/{m}": windowed(stats["logz_max"], edges, "max"),
                       f"loss/{m}": windowed(loss, edges), f"window_edges/{m}": edges})
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["head"] = table["head"].astype("Int64")
    return AnalysisResult(table=table, series=series)


# ---------------------------------------------------------------------------- flags
def _fmt(x: Any, spec: str = ".3g") -> str:
    try:
        return format(float(x), spec) if np.isfinite(float(x)) or np.isinf(float(x)) else "n/a"
    except (TypeError, ValueError):
        return "n/a"


def _summary(row: dict[str, Any], learning: bool) -> str:
    since = int(row["since_record"])
    step = row["since_step"]
    at = f"record {since}" + (f" (step {int(step)})" if step is not None and np.isfinite(step) else "")
    spread_part = float(row["spread_last"]) - float(row["spread_first"])
    return (f"{row['tensor']}: log Z of the output logits grew {_fmt(row['logz_first'])} -> {_fmt(row['logz_last'])} "
            f"nats (+{_fmt(row['growth'])}, {_fmt(row['rel_growth'], '.1f')}x the opening spread "
            f"{_fmt(row['spread_first'])} ~ log V) since {at}, {_fmt(row['slope'])} nats a record; max log Z "
            f"{_fmt(row['logz_max_last'])}, largest logit {_fmt(row['logit_max_last'])}; the loss went "
            f"{_fmt(row['loss_first'])} -> {_fmt(row['loss_last'])}. Of the growth, {_fmt(spread_part)} nats is the "
            f"logits' spread (the softmax saturating) and {_fmt(row['logit_shift'])} their common shift"
            + (f"; the loss fell {-float(row['loss_change']):.0%} meanwhile, so the spread is the model growing "
               "confident (context): only the shift counts." if learning else "."))


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Per logit module, in training mode: a ``logits`` flag where log Z grew (sustained) past the opening spread."""
    opt = ctx.options_for(NAME, LogitsOptions)
    if ctx.meta.mode != "training":
        return []
    last = ctx.n_records - 1
    out: list[Flag] = []
    for row in result.table.to_dict("records"):
        since = row["since_record"]
        if since is None or not np.isfinite(since):
            continue
        sev, learning = row_severity(row)
        if sev < opt.min_severity:
            continue
        keys = ("logz_first", "logz_last", "growth", "rel_growth", "spread_first", "spread_last", "logit_shift",
                "logz_max_last", "logit_max_last", "slope", "slope_step", "loss_first", "loss_last",
                "loss_change", "row_norm_last")
        evidence: dict[str, Any] = {k: float(row[k]) for k in keys} | {"since_record": int(since)}
        if learning:
            evidence["context"] = "learning"
        out.append(Flag(NAME, row["tensor"], None, (), sev, (int(since), last), evidence, _summary(row, learning)))
    return out


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """The module's windowed mean and max log Z, the opening level + spread, the onset; the loss on a twin axis."""
    m = flag.tensor
    lz = np.asarray(result.series[f"logz_mean/{m}"], float)
    lzmax = np.asarray(result.series[f"logz_max/{m}"], float)
    loss = np.asarray(result.series[f"loss/{m}"], float)
    edges = np.asarray(result.series[f"window_edges/{m}"], float)
    x = (edges[:-1] + edges[1:]) / 2
    ax.plot(x, lz, color="C3", lw=1.5, label="mean log Z")
    ax.plot(x, lzmax, color="C3", lw=0.8, ls=":", label="max log Z")
    ev = flag.evidence
    ax.axhline(ev["logz_first"] + ev["spread_first"], color="0.5", lw=0.8, ls="--",
               label="opening log Z + opening spread (~log V)")
    ax.axvline(ev["since_record"], color="0.3", lw=0.8)
    ax.set_xlabel("record")
    ax.set_ylabel("log Z (nats)")
    twin = ax.twinx()
    twin.plot(x, loss, color="C0", ls="--", label="loss")
    twin.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{m}: log Z of the output logits", fontsize=9)


#: Log Z of the output logits grows without bound.
ADVICE = Advice(
    title="Output-logit divergence",
    phrase="the output logits diverge (log Z grows)",
    evidence_keys={"logz_last": "log Z", "growth": "growth in nats", "rel_growth": "x opening spread",
                   "slope": "nats a record", "loss_last": "loss"},
    remedies=(
        "Add the z-loss, 1e-4 * log^2 Z averaged over positions, to the loss: it pulls log Z to 0 and keeps the "
        "logits from drifting (PaLM; Wortsman et al. 2023).",
        "Lower the peak learning rate or lengthen the warm-up: the divergence starts at the record named "
        "(since_record), at the learning rate of that step.",
        "Give the output layer (lm_head / the output embedding) its own, lower learning rate, or weight decay: its "
        "rows are what grow the logits.",
    ),
    references=("Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
                "Chowdhery et al. 2022, PaLM (z-loss)"),
    time_axis=True)

ANALYSIS = Analysis(name=NAME, needs=(), compute=compute, flags=flags, plot=plot, kinds={NAME: ADVICE},
                    options=LogitsOptions, long_history=True)
