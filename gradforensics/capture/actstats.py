"""Per-batch, per-unit activation statistics.

For a module's output ``A`` of shape ``(tokens, units)`` in one batch we keep, per
unit: the share of tokens *near zero*, the share *at the top of the range*, the
mean and the standard deviation; and, for the module, a histogram over fixed
edges.  The thresholds are fixed per module at its first record, so shares are
comparable across records:

* bounded activations (tanh, sigmoid, hardtanh; bounds ``(lo, hi)`` known):
  the scale is ``S = max(|lo|, |hi|)``;
* unbounded ones (ReLU, GELU, SiLU, ...): ``S`` is the 99th percentile of
  ``|A|`` over the first recorded batch (the module's healthy working range).

*Near zero* means ``|a| <= 0.05 S``; *top of range* means ``|a| >= 0.9 S``
(``a >= 0.9 hi`` or ``a <= 0.9 lo`` for bounded ones).  A unit that is near
zero on almost every token is dead; one at the top on almost every token is
saturated.  See ``docs/capture.md`` and ``docs/saturation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

LOW_FRACTION = 0.05
HIGH_FRACTION = 0.9
N_BINS = 64
REFERENCE_QUANTILE = 99.0
_BIG = float(np.finfo(np.float32).max)

#: Known bounded activations by (lower-cased) class name.
BOUNDED: dict[str, tuple[float, float]] = {
    "tanh": (-1.0, 1.0), "sigmoid": (0.0, 1.0), "hardtanh": (-1.0, 1.0),
    "hardsigmoid": (0.0, 1.0), "softsign": (-1.0, 1.0), "relu6": (0.0, 6.0),
}


@dataclass(frozen=True)
class ActRange:
    """The fixed thresholds and histogram edges of one module."""

    scale: float
    low: float
    high: float
    edges: tuple[float, ...]
    bounds: tuple[float, float] | None = None

    def attrs(self) -> dict[str, Any]:
        return {"scale": self.scale, "low": self.low, "high": self.high, "edges": list(self.edges),
                "bounds": list(self.bounds) if self.bounds else None,
                "low_fraction": LOW_FRACTION, "high_fraction": HIGH_FRACTION}


def make_range(first: np.ndarray, bounds: tuple[float, float] | None = None) -> ActRange:
    """Thresholds for a module, from its bounds or from its first recorded batch."""
    if bounds is not None:
        lo, hi = float(bounds[0]), float(bounds[1])
        scale = max(abs(lo), abs(hi))
        inner = np.linspace(lo, hi, N_BINS - 1)
    else:
        a = np.abs(np.asarray(first, dtype=np.float64))
        a = a[np.isfinite(a)]
        scale = float(np.percentile(a, REFERENCE_QUANTILE)) if a.size else 1.0
        scale = scale if scale > 0 else 1.0
        inner = np.linspace(-2 * scale, 4 * scale, N_BINS - 1)
    edges = (-_BIG, *map(float, inner), _BIG)
    return ActRange(scale, LOW_FRACTION * scale, HIGH_FRACTION * scale, edges,
                    (float(bounds[0]), float(bounds[1])) if bounds else None)


def act_stats(a: np.ndarray, rng: ActRange) -> dict[str, np.ndarray]:
    """Statistics of one batch: ``hist`` (B,), and (U,) ``frac_low/frac_high/mean/std``.

    Non-finite values count in no share and no moment; they land in the
    histogram's outer bins (±inf) or nowhere (NaN).
    """
    a = np.asarray(a, dtype=np.float32)
    a = a.reshape(-1, a.shape[-1])
    finite = np.isfinite(a)
    n = np.maximum(finite.sum(axis=0), 1)
    absval = np.abs(a)
    low = (absval <= rng.low) & finite
    if rng.bounds is not None:
        lo, hi = rng.bounds
        high = ((a >= HIGH_FRACTION * hi) if hi > 0 else np.zeros_like(finite)) | (
            (a <= HIGH_FRACTION * lo) if lo < 0 else np.zeros_like(finite))
    else:
        high = absval >= rng.high
    high &= finite
    z = np.where(finite, a, 0.0).astype(np.float64)
    mean = z.sum(axis=0) / n
    var = np.maximum((z * z).sum(axis=0) / n - mean * mean, 0.0)
    clipped = np.clip(a[~np.isnan(a)], -_BIG, _BIG)
    hist, _ = np.histogram(clipped, bins=np.asarray(rng.edges))
    return {
        "hist": hist.astype(np.int64),
        "frac_low": (low.sum(axis=0) / n).astype(np.float32),
        "frac_high": (high.sum(axis=0) / n).astype(np.float32),
        "mean": mean.astype(np.float32),
        "std": np.sqrt(var).astype(np.float32),
    }
