"""Helpers for an analysis's slab reductions (:class:`~gradforensics.analysis.contract.grams.SlabReduction`).

The usual per-feature result: :func:`feature_blocks` keys a slab's value by its
feature range, :func:`merge_feature_blocks` is the combine step, and
:func:`assemble_feature_blocks` puts the blocks back into one array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["assemble_feature_blocks", "feature_blocks", "merge_feature_blocks"]


def feature_blocks(sel: tuple[slice, ...], value: np.ndarray) -> dict[tuple[tuple[int, int], ...], np.ndarray]:
    """A per-feature partial: *value* (``(lead, *slab features)``) keyed by the slab's feature slices."""
    return {tuple((int(s.start), int(s.stop)) for s in sel[1:]): value}


def merge_feature_blocks(parts: Sequence[Mapping[Any, np.ndarray]],
                         op: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.add) -> dict[Any, np.ndarray]:
    """Combine per-feature partials: disjoint blocks are kept, blocks met twice (record-split slabs) meet by *op*."""
    out: dict[Any, np.ndarray] = {}
    for part in parts:
        for key, val in part.items():
            out[key] = op(out[key], val) if key in out else val
    return out


def assemble_feature_blocks(part: Mapping[Any, np.ndarray], lead: int, shape: tuple[int, ...],
                            dtype: Any) -> np.ndarray:
    """The ``(lead, *shape)`` array the per-feature blocks of *part* tile (*shape*: the array without its record axis)."""
    out = np.zeros((lead, *shape), dtype=dtype)
    for key, val in part.items():
        out[(slice(None), *(slice(a, b) for a, b in key))] = val
    return out
