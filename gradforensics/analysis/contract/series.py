"""The per-step series an analysis with a ``series`` hook reads (contract types).

A :class:`SeriesGroup` is one quantity (``loss``, a tensor's gradient norm, a log
column) as uniformly sampled, finite :class:`Series` (one per rank, plus their mean),
each with the :class:`Quality` of what had to be repaired.  Built by
:mod:`gradforensics.analysis.toolkit.series` from a store and by
:mod:`gradforensics.logs` from training logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["Quality", "Series", "SeriesGroup"]


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
