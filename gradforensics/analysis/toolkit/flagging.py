"""From statistics to flags: what the analyses share to turn a number into a severity and a sentence.

* :func:`significance` - the significance part of a severity, Bonferroni-adjusted over
  the store, so a healthy run raises no flag above 0.5; :func:`ramp` - the effect part;
  :data:`REPORT_FLOOR` - below it, no flag (the table keeps the row);
* :func:`fmt_p` - a p-value for a summary sentence;
* :func:`dedupe_heads` - one story per tensor: the flags of its heads *or* the
  whole-tensor flag, not both;
* :func:`short_history` - the ``not_judged`` entry of a time-axis analysis on a history too
  short for it to reach 0.5.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.toolkit.units import head_of

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Context, Flag, NotJudged

__all__ = ["REPORT_FLOOR", "InvolvedHeads", "dedupe_heads", "fmt_p", "involved_heads", "ramp", "short_history",
           "significance"]

#: Flags below this severity are not emitted (the table still has the row).
REPORT_FLOOR = 0.25


def significance(p: float, n_tests: int) -> float:
    """Significance part of a severity, in [0, 1], Bonferroni-adjusted over the store.

    ``p_adj = min(1, p · n_tests)``; 0 at ``p_adj ≥ 0.01``, 0.5 at ``1e-3``, 1 at
    ``≤ 1e-4`` (linear in ``-log10 p_adj``).  Since a severity is this times an
    effect score ≤ 1, a severity above 0.5 needs ``p_adj < 1e-3``: on a healthy
    store the chance of any such flag from one analysis is below 0.1 %.
    """
    if not np.isfinite(p):
        return 0.0
    padj = min(1.0, max(float(p), 1e-300) * max(int(n_tests), 1))
    return float(np.clip((-math.log10(padj) - 2.0) / 2.0, 0.0, 1.0))


def ramp(x: float, full: float) -> float:
    """``clip(x / full, 0, 1)``; NaN -> 0."""
    return 0.0 if not np.isfinite(x) else float(np.clip(x / full, 0.0, 1.0))


def fmt_p(p: float, floor: float | None = None) -> str:
    """``p < 0.001`` / ``p = 0.012`` for summaries."""
    if not np.isfinite(p):
        return "p n/a"
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"p < {floor * 1.0001:.2g}" if floor >= 1e-3 else f"p < {floor:.1e}"
    return f"p = {p:.2g}" if p >= 1e-3 else f"p = {p:.1e}"


# ------------------------------------------------------------- flag dedupe
InvolvedHeads = Mapping[tuple[str, tuple[str, ...]], set[int]]


def involved_heads(table: Any, involved: Iterable[bool],
                   by_sources: bool = False) -> dict[tuple[str, tuple[str, ...]], set[int]]:
    """``{(tensor, sources): heads}`` of the head rows of *table* where *involved* is true.

    *involved* (one bool per row) says the head shows the trouble at least
    nominally (an effect in the flagged direction and a raw p-value below 0.05).
    """
    out: dict[tuple[str, tuple[str, ...]], set[int]] = {}
    cols = ("source_a", "source_b") if by_sources else ()
    for (_, r), ok in zip(table.iterrows(), involved):
        h = head_of(r["head"])
        if h is not None and ok:
            key = (r["tensor"], tuple(sorted(str(r[c]) for c in cols)))
            out.setdefault(key, set()).add(h)
    return out


def dedupe_heads(flags: Iterable[Flag], n_heads: Mapping[str, int], involved: InvolvedHeads | None = None,
                 by_sources: bool = True) -> list[Flag]:
    """One story per tensor: head flags *or* the whole-tensor flag, not both.

    For each tensor (and source set, with *by_sources*) of a head-split tensor
    whose whole tensor is flagged: if every head shows the trouble (flagged, or
    *involved* at least nominally), it is tensor-wide and only the whole-tensor
    flag is kept; otherwise the flagged heads localise it and the whole-tensor
    flag, which only dilutes them, is dropped (its severity is quoted in the
    heads' summaries).
    """
    groups: dict[tuple[str, tuple[str, ...]], list[Flag]] = {}
    for f in flags:
        groups.setdefault((f.tensor, tuple(sorted(f.sources)) if by_sources else ()), []).append(f)
    out: list[Flag] = []
    for key, fs in groups.items():
        tensor = key[0]
        heads = [f for f in fs if f.head is not None]
        whole = [f for f in fs if f.head is None]
        if not heads or not whole or tensor not in n_heads:
            out.extend(fs)
            continue
        shown = {int(f.head) for f in heads if f.head is not None} | set((involved or {}).get(key, set()))
        if len(shown) >= n_heads[tensor]:
            out.extend(whole)
        else:
            word = "experts" if any("expert" in f.evidence for f in heads) else "heads"
            note = f" (whole tensor: severity {whole[0].severity:.2f}, diluted by its other {word})"
            out.extend(dataclasses.replace(f, summary=f.summary.rstrip(".") + note + ".") for f in heads)
    return out


def short_history(ctx: Context, kind: str, minimum: int) -> list[NotJudged]:
    """``[NotJudged]`` when a ``training`` store's history (its distinct steps) is shorter than *minimum*.

    For an analysis that reads the record axis as time (flags of *kind*): below *minimum*
    steps no flag of *kind* can reach 0.5, so its silence is no all-clear.  A ``replay`` store
    has no history to judge (such kinds never flag there): ``[]``.
    """
    from gradforensics.analysis.contract.model import NotJudged

    if ctx.meta.mode != "training":
        return []
    step = ctx.batches.get("step")
    n = int(np.unique(np.asarray(step)).size) if step is not None and len(step) else ctx.n_records
    if n >= minimum:
        return []
    return [NotJudged(kind, f"too short a history: {n} steps",
                      f"≥ {minimum} recorded steps")]
