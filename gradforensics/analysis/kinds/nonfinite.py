"""Non-finite gradients: which tensors, heads, records and sources hold NaN or Inf.

A NaN or Inf in one batch gradient is enough to corrupt the weights at the next
optimizer step (unless a loss scaler skips the step), so any non-finite value is
a finding with severity >= 0.5 - never an error.  The counts come for free from
the Gram pass (:mod:`gradforensics.analysis.engine.gram` counts non-finite elements per
record while it zeroes them); records holding any are excluded from every
direction statistic, so they cannot turn another table into NaN.

Table ``nonfinite.csv``: a row per tensor (and head) over all sources, plus a
row per source involved for tensors that hold any non-finite value.  For a
tensor kept only as a sketch, counts are of sketch entries, not gradient elements.

Records marked ``batches/skipped`` (an import given the run's logs: iterations a loss
scaler skipped, :mod:`gradforensics.importing.logjoin`) are not findings: their NaN/Inf
never reached the weights.  They are counted apart (``records_skipped``) and left out of
every other column.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need

if TYPE_CHECKING:
    from collections.abc import Mapping

    import pandas as pd
    from matplotlib.axes import Axes

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "compute", "flags", "nonfinite_rows", "nonfinite_table", "plot", "severity"]


COLUMNS = ("tensor", "head", "source", "n_records", "records_nonfinite", "elements_nonfinite", "share",
           "first_record", "first_step", "first_sources", "last_record", "from_sketch", "records_skipped")


def _sources_of(mixture_row: np.ndarray, sources: tuple[str, ...]) -> list[str]:
    return [s for s, w in zip(sources, mixture_row) if w > 0]


def nonfinite_rows(g: GramResult, mixture: np.ndarray, steps: np.ndarray, sources: tuple[str, ...],
                   skipped: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Rows of one tensor (or head): all sources, then each source involved in a bad record.

    *skipped* (bool per record) marks records a loss scaler skipped: counted apart, never bad.
    """
    held = g.nonfinite > 0
    skip = np.zeros(held.size, bool) if skipped is None else np.asarray(skipped, bool)[:held.size]
    bad = held & ~skip
    rows = [_row(g, "", np.ones(bad.size, bool), bad, held & skip, mixture, steps, sources)]
    if bad.any():
        for s, name in enumerate(sources):
            involved = mixture[:, s] > 0
            if (involved & bad).any():
                rows.append(_row(g, name, involved, bad, held & skip, mixture, steps, sources))
    return rows


def _row(g: GramResult, source: str, mask: np.ndarray, bad: np.ndarray, skipped: np.ndarray, mixture: np.ndarray,
         steps: np.ndarray, sources: tuple[str, ...]) -> dict[str, Any]:
    hit = np.flatnonzero(mask & bad)
    n = int(mask.sum())
    first = int(hit[0]) if hit.size else None
    return {
        "tensor": g.tensor, "head": g.head, "source": source, "n_records": n,
        "records_nonfinite": int(hit.size), "elements_nonfinite": int(g.nonfinite[mask & bad].sum()),
        "share": hit.size / n if n else 0.0,
        "first_record": first, "first_step": None if first is None else int(steps[first]),
        "first_sources": "" if first is None else ";".join(_sources_of(mixture[first], sources)),
        "last_record": int(hit[-1]) if hit.size else None, "from_sketch": g.from_sketch,
        "records_skipped": int((mask & skipped).sum()),
    }


def nonfinite_table(grams: Mapping[tuple[str, int | None], GramResult], mixture: np.ndarray, steps: np.ndarray,
                    sources: tuple[str, ...], skipped: np.ndarray | None = None) -> pd.DataFrame:
    """The ``nonfinite.csv`` table (columns ``tensor``, ``head``, ``source`` first)."""
    import pandas as pd

    rows = []
    for key in sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        rows += nonfinite_rows(grams[key], mixture, steps, sources, skipped)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in ("head", "first_record", "first_step", "last_record"):
        table[col] = table[col].astype("Int64")
    return table


def compute(ctx: Context) -> AnalysisResult:
    b = ctx.batches
    # above N0: counts only, each unit's N counts built when it is read (sparse in the pass)
    grams = ctx.long.record_grams() if ctx.long is not None else ctx.grams
    skipped = b["skipped"] > 0 if "skipped" in b else None
    table = nonfinite_table(grams, b["mixture"], b["step"], ctx.sources, skipped)
    series = {f"counts/{g.tensor}": g.nonfinite for (t, h), g in grams.items()
              if h is None and g.nonfinite.any()}
    return AnalysisResult(table=table, series=series)


def severity(records_bad: int, n_records: int) -> float:
    """0.6 for one bad record, rising with the share and count of bad records, up to 1."""
    if records_bad <= 0:
        return 0.0
    share = records_bad / max(n_records, 1)
    return float(min(1.0, 0.6 + 0.3 * share + 0.1 * min(1.0, math.log10(records_bad) / 2)))


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    t = result.table
    if t.empty:
        return []
    every = t[t["source"] == ""]
    out = []
    for _, row in every[every["head"].isna() & (every["records_nonfinite"] > 0)].iterrows():
        tensor = row["tensor"]
        heads = every[(every["tensor"] == tensor) & every["head"].notna() & (every["records_nonfinite"] > 0)]
        per_src = t[(t["tensor"] == tensor) & t["head"].isna() & (t["source"] != "")]
        per_src = per_src.sort_values("records_nonfinite", ascending=False, kind="stable")
        out.append(_flag(row, [int(h) for h in heads["head"]], list(per_src["source"]),
                         dict(zip(per_src["source"], per_src["records_nonfinite"].astype(int)))))
    return out


def _flag(row: Any, heads: list[int], srcs: list[str], per_source: dict[str, int]) -> Flag:
    n_bad, n = int(row["records_nonfinite"]), int(row["n_records"])
    unit = "sketch entries" if row["from_sketch"] else "elements"
    text = (f"{row['tensor']}: {n_bad} of {n} records hold NaN/Inf gradients ({int(row['elements_nonfinite'])} "
            f"{unit}), first at record {int(row['first_record'])} (step {int(row['first_step'])}, source "
            f"{row['first_sources'] or '?'}); one such update corrupts the weights - check that batch's inputs, "
            "loss scale and the layer's activations.")
    if heads:
        text = text[:-1] + f"; heads {heads[:8]}{'...' if len(heads) > 8 else ''}."
    evidence = {"records_nonfinite": n_bad, "elements_nonfinite": int(row["elements_nonfinite"]),
                "first_record": int(row["first_record"]), "first_step": int(row["first_step"]),
                "heads": heads, "per_source": per_source, "from_sketch": bool(row["from_sketch"])}
    return Flag(kind="nonfinite", tensor=row["tensor"], head=None, sources=tuple(srcs),
                severity=severity(n_bad, n), records=(int(row["first_record"]), int(row["last_record"])),
                evidence=evidence, summary=text)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Non-finite elements per record of the flagged tensor."""
    counts = result.series.get(f"counts/{flag.tensor}")
    if counts is None:
        counts = np.zeros(0)
    x = np.arange(counts.size)
    ax.vlines(x, 0, counts, color="tab:red")
    ax.plot(x[counts > 0], counts[counts > 0], "o", color="tab:red", markersize=3)
    ax.set_xlabel("record")
    ax.set_ylabel("non-finite elements")
    ax.set_title(f"NaN/Inf gradients: {flag.tensor}")
    ax.set_xlim(-0.5, max(counts.size, 1) - 0.5)


#: What a ``nonfinite`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Micikevicius2018] P. Micikevicius et al., "Mixed Precision Training", ICLR 2018.
#: .. [Chowdhery2022] A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (skipping
#:    batches).
ADVICE = Advice(
    title="Non-finite gradients",
    phrase="holds non-finite values (NaN/Inf)",
    evidence_keys={"records_nonfinite": "records with non-finite values",
                   "elements_nonfinite": "non-finite values", "first_record": "first at record"},
    remedies=(
        "Find the source: the first record and source named here; re-run that batch in fp32 with anomaly "
        "detection to locate the op.",
        "Use dynamic loss scaling in fp16; skip (do not apply) a step whose gradient is non-finite, and "
        "restart from before a loss spike with the offending batches skipped."),
    references=("Micikevicius et al. 2018, Mixed Precision Training (loss scaling)",
                "Chowdhery et al. 2022, PaLM (restart and skip batches around spikes)"),
)

ANALYSIS = Analysis(name="nonfinite", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"nonfinite": ADVICE}, long_history=True)
