"""Per-batch, per-unit activation statistics.

For a module's output ``A`` of shape ``(tokens, units)`` in one batch (the units
on the module kind's feature axis, every other axis a "position": see
:mod:`gradforensics.recording.units`) we keep, per unit: the share of tokens
*near zero*, the share *at the top of the range*, the mean and the standard
deviation; and, for the module, a histogram over fixed
edges and the excess kurtosis of all its finite outputs (``kurtosis``, shape ``(1,)``:
``m4/m2² - 3`` with biased central moments, SciPy's ``kurtosis(fisher=True, bias=True)``;
NaN when the outputs are constant).  Outlier features (a few units far larger than the rest,
He et al. 2024) raise it long before they saturate anything.  The thresholds are fixed per module at its first record, so shares are
comparable across records:

* bounded activations (tanh, sigmoid, hardtanh; bounds ``(lo, hi)`` known):
  the scale is ``S = max(|lo|, |hi|)``;
* unbounded ones (ReLU, GELU, SiLU, ...): ``S`` is the 99th percentile of
  ``|A|`` over the first recorded batch (the module's healthy working range).

*Near zero* means ``|a| <= 0.05 S``; *top of range* means ``|a| >= 0.9 S``
(``a >= 0.9 hi`` or ``a <= 0.9 lo`` for bounded ones).  A unit that is near
zero on almost every token is dead; one at the top on almost every token is
saturated; one near zero (at the top) on *every* position of the batch is stored
as such (``dead`` / ``saturated``, 0 or 1).  See ``docs/capture.md`` and
``docs/saturation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradforensics.recording.units import AxisFinder

__all__ = [
    "BOUNDED",
    "HIGH_FRACTION",
    "LOW_FRACTION",
    "N_BINS",
    "PARTS",
    "REFERENCE_QUANTILE",
    "ActHook",
    "ActRange",
    "act_stats",
    "combine",
    "excess_kurtosis",
    "finish",
    "make_range",
    "make_range_torch",
    "partial_stats",
    "with_scale",
]


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
    #: the unit axis of the module's output, its length, and the rule that chose it (:mod:`.units`)
    unit_axis: int | None = None
    units: int | None = None
    unit_axis_from: str | None = None

    def attrs(self) -> dict[str, Any]:
        out = {"scale": self.scale, "low": self.low, "high": self.high, "edges": list(self.edges),
               "bounds": list(self.bounds) if self.bounds else None,
               "low_fraction": LOW_FRACTION, "high_fraction": HIGH_FRACTION}
        if self.units is not None:
            out.update(unit_axis=self.unit_axis, units=self.units, unit_axis_from=self.unit_axis_from)
        return out


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
    """Statistics of one batch: ``hist`` (B,), (U,) ``frac_low/frac_high/mean/std``, ``dead/saturated`` and
    ``kurtosis`` (1,), the excess kurtosis of every finite output (:func:`excess_kurtosis`).

    The units are on the last axis of *a*.  ``dead`` (``saturated``) is 1 for a unit
    near zero (at the top of the range) on every finite position of the batch.

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
    z2 = z * z
    sums = [finite.sum(), z.sum(), z2.sum(), (z2 * z).sum(), (z2 * z2).sum()]
    return {
        "hist": hist.astype(np.int64),
        "frac_low": (low.sum(axis=0) / n).astype(np.float32),
        "frac_high": (high.sum(axis=0) / n).astype(np.float32),
        "mean": mean.astype(np.float32),
        "std": np.sqrt(var).astype(np.float32),
        **_everywhere(finite.sum(axis=0), low.sum(axis=0), high.sum(axis=0)),
        "kurtosis": excess_kurtosis(*sums),
    }


def excess_kurtosis(n: Any, s1: Any, s2: Any, s3: Any, s4: Any) -> np.ndarray:
    """``(1,)`` float32: the excess kurtosis ``m4/m2² - 3`` of values with count *n* and raw power sums
    ``s1..s4`` (float64); biased central moments (SciPy's default), NaN for fewer than 2 values or ``m2 = 0``.

    The central moments come from the raw ones about the mean (float64): exact for activations whose
    mean is within a few standard deviations of zero, as every recorded activation is.
    """
    n = float(n)
    if n < 2:
        return np.full(1, np.nan, np.float32)
    mu = float(s1) / n
    e2, e3, e4 = float(s2) / n, float(s3) / n, float(s4) / n
    m2 = e2 - mu * mu
    m4 = e4 - 4 * mu * e3 + 6 * mu * mu * e2 - 3 * mu ** 4
    if not m2 > 0:
        return np.full(1, np.nan, np.float32)
    return np.array([m4 / (m2 * m2) - 3.0], np.float32)


def _everywhere(n: np.ndarray, low: np.ndarray, high: np.ndarray) -> dict[str, np.ndarray]:
    """``dead`` / ``saturated`` (U,) uint8: every finite position near zero / at the top (and at least one)."""
    return {"dead": ((low == n) & (n > 0)).astype(np.uint8), "saturated": ((high == n) & (n > 0)).astype(np.uint8)}


# ------------------------------------------------------------------ on the device (torch)
#: The per-unit partial sums of :func:`partial_stats`; added up over micro-batches, then :func:`finish`.
PARTS = ("n", "low", "high", "s1", "s2", "s3", "s4", "hist")


def make_range_torch(first: Any, bounds: tuple[float, float] | None = None) -> ActRange:
    """:func:`make_range` of a torch tensor, on its device: only the scale (one float) crosses to the host.

    The 99th percentile of ``|a|`` is NumPy's (linear interpolation between the
    two order statistics around ``(n - 1) q``), from ``kthvalue`` on the device.
    """
    if bounds is not None:
        return make_range(np.zeros(0, np.float32), bounds)
    import torch

    a = first.detach().reshape(-1).abs().to(torch.float64)
    a = a[torch.isfinite(a)]
    if not a.numel():
        return make_range(np.zeros(0, np.float32))
    h = (a.numel() - 1) * REFERENCE_QUANTILE / 100.0
    lo = int(np.floor(h))
    v_lo = float(torch.kthvalue(a, lo + 1).values)
    v_hi = float(torch.kthvalue(a, min(lo + 2, a.numel())).values)
    scale = v_lo + (h - lo) * (v_hi - v_lo)
    return _range_of_scale(scale if scale > 0 else 1.0)


def _range_of_scale(scale: float) -> ActRange:
    inner = np.linspace(-2 * scale, 4 * scale, N_BINS - 1)
    return ActRange(scale, LOW_FRACTION * scale, HIGH_FRACTION * scale, (-_BIG, *map(float, inner), _BIG), None)


def with_scale(rng: ActRange, scale: float) -> ActRange:
    """*rng* with another scale (every rank's thresholds from one agreed scale); bounded ranges are kept."""
    return rng if rng.bounds is not None else _range_of_scale(scale)


def partial_stats(a: Any, rng: ActRange) -> dict[str, Any]:
    """Sums over one micro-batch's ``(tokens, units)`` outputs, on their device: see :data:`PARTS`."""
    import torch

    a = a.detach().reshape(-1, a.shape[-1]).to(torch.float32)
    finite = torch.isfinite(a)
    absval = a.abs()
    low = (absval <= rng.low) & finite
    if rng.bounds is not None:
        lo, hi = rng.bounds
        high = torch.zeros_like(finite)
        if hi > 0:
            high |= a >= HIGH_FRACTION * hi
        if lo < 0:
            high |= a <= HIGH_FRACTION * lo
    else:
        high = absval >= rng.high
    high &= finite
    z = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device)).to(torch.float64)
    vals = a[~torch.isnan(a)].clamp(-_BIG, _BIG).to(torch.float64)
    edges = torch.tensor(rng.edges, dtype=torch.float64, device=a.device)
    idx = (torch.bucketize(vals, edges, right=True) - 1).clamp_(0, len(rng.edges) - 2)
    z2 = z * z
    return {"n": finite.sum(0), "low": low.sum(0), "high": high.sum(0), "s1": z.sum(0), "s2": z2.sum(0),
            "s3": (z2 * z).sum(0), "s4": (z2 * z2).sum(0), "hist": torch.bincount(idx, minlength=len(rng.edges) - 1)}


def combine(parts: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    return more if parts is None else {k: parts[k] + more[k] for k in PARTS}


def finish(parts: dict[str, Any]) -> dict[str, np.ndarray]:
    """The statistics of :func:`act_stats` from the summed parts (the small arrays cross to the host here)."""
    host = {k: v.cpu().numpy() for k, v in parts.items()}
    n = np.maximum(host["n"], 1)
    mean = host["s1"] / n
    var = np.maximum(host["s2"] / n - mean * mean, 0.0)
    return {
        "hist": host["hist"].astype(np.int64),
        "frac_low": (host["low"] / n).astype(np.float32),
        "frac_high": (host["high"] / n).astype(np.float32),
        "mean": mean.astype(np.float32),
        "std": np.sqrt(var).astype(np.float32),
        **_everywhere(host["n"], host["low"], host["high"]),
        "kurtosis": excess_kurtosis(*(host[k].sum() for k in ("n", "s1", "s2", "s3", "s4"))),
    }


class ActHook:
    """Forward hook summarising a module's outputs on their own device.

    The output's units are on the axis *axes* finds (:mod:`gradforensics.recording.units`;
    without it, the last axis).  Until the module's range is fixed (its first record) the outputs are kept,
    ``(tokens, units)`` float32 on their device; after that every micro-batch is
    reduced at once to per-unit partial sums (:func:`partial_stats`),
    so nothing is kept and only the summed statistics cross to the host, at ``record()``.
    """

    def __init__(self, name: str, axes: AxisFinder | None = None) -> None:
        self.name = name
        self.axes = axes
        self.parts: list[torch.Tensor] = []
        self.units: int | None = None
        #: the unit axis of the first output and the rule that chose it (:mod:`gradforensics.recording.units`)
        self.unit_axis: int | None = None
        self.unit_axis_from: str | None = None
        self.rng: ActRange | None = None
        self.sums: dict[str, Any] | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        import torch

        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"activations: module {self.name} returned {type(output).__name__}, not a tensor; "
                            "hook a module whose output is the activation (e.g. '*.mlp.act_fn').")
        if not out.ndim:
            a = out.detach().reshape(1, 1)
            axis, rule = 0, "scalar output"
        elif self.axes is not None:
            axis, rule = self.axes.axis(self.name, module, args, out)
            a = out.detach().movedim(axis, -1)
            a = a.reshape(-1, a.shape[-1])
        else:
            axis, rule = out.ndim - 1, "last axis"
            a = out.detach().reshape(-1, out.shape[-1])
        if self.units is not None and int(a.shape[-1]) != self.units:
            raise SpecError(f"activations: module {self.name} returned {int(a.shape[-1])} units on axis {axis} "
                            f"({rule}); it had {self.units} before. Pass unit_axes={{{self.name!r}: AXIS}}.")
        if self.units is None:
            self.unit_axis, self.unit_axis_from = axis, rule
        self.units = int(a.shape[-1])
        if self.rng is None:
            self.parts.append(a.to(torch.float32, copy=True))
        else:
            self.sums = combine(self.sums, partial_stats(a, self.rng))

    def take(self) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
        """The kept outputs (before the range is fixed) or the summed parts since the last call."""
        import torch

        parts, self.parts = self.parts, []
        sums, self.sums = self.sums, None
        if not parts:
            return None, sums
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), sums
