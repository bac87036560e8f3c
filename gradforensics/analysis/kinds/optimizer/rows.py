"""Stale rows from the live loop's per-row tails, and whether they coincide with a loss spike.

``Recorder(optimizer=opt)`` marks, per record and per row of each 2-D tensor, the rows whose
gradient the second moment has not seen (``optim_live/<tensor>/stale``: ``Σ_row g² > 1000 ·
Σ_row v̂``; a row whose ``v̂`` is 0 and now gets a gradient, or one back after a long absence).
Adam's next updates on such a row are about ``lr`` per element (``lr·(1-β₁)/√(1-β₂)`` ≈ 3 lr at
the first) whatever its gradient: far beyond the row's usual step.

A language model gets a few such rows all along: rare tokens seen for the first time, a unit
that wakes up.  That is the run's own base rate, and it is the **run's**, not one tensor's: the
tensor with the most such rows (the input embedding) sets it (:func:`base_rate`: the largest
90th percentile of a tensor's counts over the measured records, at least :data:`MIN_BASE`), so
a quiet tensor's handful of waking rows does not stand out against a base of zero.  A record
**stands out** in a tensor when its count of stale rows is at least :data:`EXCESS` times the
larger of that and the tensor's own 90th percentile at its other records.

A **loss spike** at a record is its loss above the median of the :data:`WINDOW` records before,
in units of the run's own record-to-record noise (1.4826 MAD of the first differences of the
previous :data:`HISTORY` records, over √2): ``z >=`` :data:`Z_SPIKE` (the loss of small batches is
heavy-tailed: healthy runs reach z 5).  The spike counts at the stale record or within
:data:`LAG` records after it (the large updates land at the next steps).  Both: cause "optimizer
state", severity 0.5 at the thresholds, +0.1 per doubling of the spike and of the excess.
Stale rows that stand out without a spike are context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["EXCESS", "HISTORY", "LAG", "MIN_BASE", "WINDOW", "Z_SPIKE", "StaleEvent", "base_rate", "loss_spike_z",
           "severity", "stale_event"]

WINDOW = 10        # records whose median is the level before a record
HISTORY = 30       # records whose first differences give the noise
Z_SPIKE = 6.0      # a loss this many noise units above the level is a spike
LAG = 2            # records after the stale record in which the spike may come
EXCESS = 3.0       # stale rows this many times the run's base rate stand out
MIN_BASE = 1.0     # the base rate is at least one row


def loss_spike_z(loss: np.ndarray, groups: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """Per record, the loss above its own earlier level in noise units (NaN without ``WINDOW`` records before).

    *groups*: index arrays of the records of each source (a record is compared with the earlier
    records of its own source); default one series.  Non-finite losses are skipped as history.
    """
    loss = np.asarray(loss, dtype=np.float64)
    out = np.full(loss.shape, np.nan)
    for idx in groups if groups is not None else [np.arange(loss.size)]:
        idx = np.asarray(idx)
        y = loss[idx]
        for j in range(idx.size):
            prev = y[max(0, j - HISTORY):j]
            prev = prev[np.isfinite(prev)]
            if prev.size < WINDOW or not np.isfinite(y[j]):
                continue
            d = np.diff(prev)
            noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
            jump = float(y[j] - np.median(prev[-WINDOW:]))
            if noise > 0:
                out[idx[j]] = jump / noise
            elif jump > 0:
                out[idx[j]] = math.inf
    return out


@dataclass(frozen=True)
class StaleEvent:
    """The record of a tensor whose stale rows stand out most (with the loss spike there, if any)."""

    record: int
    rows: np.ndarray           # indices of the stale rows at that record
    n_rows: int                # the tensor's rows
    base: float                # the run's base rate of stale rows (90th pct at the other live records, >= 1)
    excess: float              # len(rows) / base
    loss_z: float              # the loss spike there in noise units (NaN: too early to tell)
    live_records: int          # records with a live optimizer summary

    @property
    def spike(self) -> bool:
        return bool(self.loss_z >= Z_SPIKE)


def base_rate(masks: Sequence[np.ndarray], measured: Sequence[np.ndarray]) -> float:
    """The run's base rate of stale rows: the largest 90th percentile over tensors of the counts per measured
    record (at least :data:`MIN_BASE`)."""
    q = [float(np.quantile(np.asarray(m, dtype=bool).sum(axis=1)[np.asarray(on, dtype=bool)], 0.9))
         for m, on in zip(masks, measured, strict=True) if np.asarray(on, dtype=bool).any()]
    return max([MIN_BASE, *q])


def stale_event(stale: np.ndarray, live: np.ndarray, z: np.ndarray, floor: float = MIN_BASE) -> StaleEvent | None:
    """The most telling record of one tensor: *stale* (N, R) masks, *live* (N,) bool, *z* (N,) spike z.

    *floor*: the run's base rate (:func:`base_rate`).  Among the measured records whose stale rows
    stand out (``>= EXCESS`` x the larger of *floor* and the tensor's own 90th percentile at its
    other records) and whose loss can be judged (``WINDOW`` records before it: at the start of a
    run every row is seen for the first time), the one with a loss spike (at it or ``LAG``
    records after) and the largest excess, else the largest excess; None when none stands out.
    """
    counts = np.asarray(stale, dtype=bool).sum(axis=1)
    on = np.flatnonzero(np.asarray(live, dtype=bool))
    if on.size == 0 or not counts[on].any():
        return None
    zlag = np.full(z.shape, np.nan)
    for i in range(z.size):
        zlag[i] = np.nan if np.isnan(z[i]) else float(np.nanmax(z[i:i + LAG + 1]))

    def base_of(at: int) -> float:
        others = counts[on[on != at]]
        return max(floor, MIN_BASE, float(np.quantile(others, 0.9)) if others.size else 0.0)

    best: tuple[bool, float, int] | None = None
    for r in on:
        if counts[r] == 0 or np.isnan(zlag[r]):
            continue
        excess = counts[r] / base_of(int(r))
        if excess < EXCESS:
            continue
        key = (bool(zlag[r] >= Z_SPIKE), float(excess), int(r))
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    rec = best[2]
    base = base_of(rec)
    return StaleEvent(record=rec, rows=np.flatnonzero(stale[rec]), n_rows=int(stale.shape[1]), base=base,
                      excess=float(counts[rec] / base), loss_z=float(zlag[rec]), live_records=int(on.size))


def severity(ev: StaleEvent) -> float:
    """0.5 at a spike of ``Z_SPIKE`` with rows at ``EXCESS`` x the base rate, +0.1 per doubling of either
    (at most 0.95); stale rows that stand out without a spike: context, 0.3."""
    if not ev.spike:
        return 0.3
    z = ev.loss_z if math.isfinite(ev.loss_z) else 100 * Z_SPIKE
    return float(min(0.95, 0.5 + 0.1 * math.log2(z / Z_SPIKE) + 0.1 * math.log2(ev.excess / EXCESS)))
