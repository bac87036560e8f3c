"""Precision floor: weight updates the number format rounds away, and fp16 gradient range.

Without fp32 master weights an optimizer step stores ``w ← round_f(w + Δ)`` in the
training format ``f``.  When ``|Δ|`` is below half the spacing of ``f`` at ``w``
(half an ULP), round-to-nearest gives ``w`` back: the update is *swamped* and that
weight stops learning (Micikevicius et al. 2018, §3.1; Kalamkar et al. 2019 for
bfloat16).  From consecutive weight snapshots ``W_t, W_{t+1}`` this analysis
measures, per tensor:

* ``swamped_bf16`` / ``swamped_fp16``: the share of non-zero per-step updates
  ``Δ = (W_{t+1} - W_t) / steps`` with ``round_f(round_f(w) + Δ) == round_f(w)``,
  i.e. updates that would be lost if the weights were kept in bfloat16 (8
  significant bits, ULP ``2^(e-7)``) or float16 (11 bits, ULP ``2^(e-10)``,
  subnormal spacing ``2^-24``).  This is the exact rounding rule, not only
  ``|Δ| < ULP/2``: at a power of two the spacing below ``w`` is half the spacing
  above it, and ties go to even.
* ``swamped_fp8_e4m3`` / ``swamped_fp8_e5m2``: the same for FP8 (OCP/NVIDIA FP8
  formats: E4M3 with 4 significant bits, normal range ``[2^-6, 448]``, subnormal
  spacing ``2^-9``; E5M2 with 3 bits, ``[2^-14, 57344]``, spacing ``2^-16``), after
  a per-tensor *power-of-two amax scale*: the snapshot ``W_t`` and its update are
  multiplied by ``s = 2^floor(log2(max_f / amax|W_t|))`` (the largest power of two
  that keeps ``amax`` finite), as FP8 recipes scale every tensor before the cast.
  A power of two scales exactly, so in the normal range only the mantissa bits decide.
* ``lost_share``: among elements whose gradient was non-zero on a record between
  the two snapshots, the share whose stored weight did not change at all - updates
  *already* being lost, when the snapshots themselves are low precision.
* ``grad_underflow_fp16`` / ``grad_subnormal_fp16`` / ``grad_overflow_fp16``: the
  share of non-zero gradient values that, multiplied by the loss scale ``s``,
  fall below ``2^-24`` (flushed to zero in fp16), in ``[2^-24, 2^-14)`` (fp16
  subnormal: fewer significant bits), or reach ``2^16`` (overflow to inf; fp16's
  largest finite value is 65504).  They come from an exact histogram of base-2
  exponents, so they are exact for power-of-two scales (what dynamic loss scaling
  uses) and within one binade otherwise.
* ``grad_underflow_fp8_e4m3`` / ``grad_subnormal_fp8_e4m3`` (and ``_e5m2``): the
  share of non-zero gradient values below the smallest FP8 subnormal, or in the
  subnormal range, after the power-of-two amax scale of the tensor's gradients
  (amax over all the stored records: delayed scaling with a history that spans the
  capture).  That scale cannot overflow, so there is no FP8 overflow column.  Exact:
  a power-of-two scale moves the thresholds onto powers of two.

Snapshots are assumed taken at ``record()`` time, before that record's optimizer
step: the gradients of records ``r_t .. r_{t+1}-1`` drive ``W_t → W_{t+1}``.

References
----------
Micikevicius, P. et al. (2018). Mixed precision training. ICLR.
Micikevicius, P. et al. (2022). FP8 formats for deep learning. arXiv:2209.05433.
Kalamkar, D. et al. (2019). A study of BFLOAT16 for deep learning training. arXiv:1905.12322.
IEEE 754-2008, §4.3.1 (round to nearest, ties to even).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.model import (
    Advice,
    Analysis,
    AnalysisResult,
    Constraints,
    Flag,
    Interval,
    Need,
    Options,
)
from gradforensics.errors import SpecError
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.store.reader import Store

__all__ = [
    "ADVICE",
    "ANALYSIS",
    "COUNTS",
    "FLAG_FORMATS",
    "FORMATS",
    "FP8",
    "MAX_PAIRS",
    "NAME",
    "ULP_EDGES",
    "PrecisionOptions",
    "amax_scale",
    "compute",
    "exponent_hist",
    "flags",
    "fp8_gradient_shares",
    "fp16_gradient_shares",
    "lazy",
    "nonzero_masks",
    "pair_counts",
    "plot",
    "round_to",
    "run_format",
    "slab_reductions",
    "swamped",
    "swamped_share",
    "tensor_row",
    "ulp",
    "underflow_severity",
]


NAME = "precision"
#: name -> (explicit mantissa bits, smallest normal exponent, largest finite value)
FORMATS: dict[str, tuple[int, int, float]] = {
    "bf16": (7, -126, float(np.finfo(np.float32).max) * (1 - 2.0 ** -8)),
    "fp16": (10, -14, 65504.0),
    "fp8_e4m3": (3, -6, 448.0),
    "fp8_e5m2": (2, -14, 57344.0),
}
FLAG_FORMATS = ("bf16", "fp16")     # formats option ``format`` may flag (FP8 is reported, never flagged)
FP8 = ("fp8_e4m3", "fp8_e5m2")      # formats analysed after a per-tensor power-of-two amax scale
COUNTS = ("n", "updated", "grad_nonzero", "lost", *(f"swamped_{f}" for f in FORMATS),
          *(f"net_swamped_{f}" for f in FLAG_FORMATS))
#: The ``dtypes`` root attribute's names -> the formats here (``fp32``/``fp64``: nothing is swamped).
DTYPE_FORMATS = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}
#: Severity weight of swamping in a format the run does not keep its weights in: a what-if, context below 0.5.
WHATIF_WEIGHT = 0.45
#: Share of the gradient energy (sum of g^2) carried by fp16-flushed values at which underflow counts in full.
UNDERFLOW_ENERGY_FULL = 0.01
MAX_PAIRS = 32                      # snapshot pairs analysed per tensor (evenly spaced)
EXP_MIN, EXP_MAX = -160, 160        # base-2 exponent histogram range (frexp convention)
ULP_EDGES = np.arange(-30.0, 20.5, 0.5)   # bins of log2(|Δ| / ULP_bf16(w))
_BLOCK = 1 << 20                    # elements per block inside a pair task (bounds memory)


@dataclass(frozen=True)
class PrecisionOptions(Options):
    """Options of the precision analysis.

    Parameters
    ----------
    loss_scale
        Scale the gradients are multiplied by before the fp16 cast (the run's
        recorded loss scale).  Default: ``extra["loss_scale"]`` of the store, else 1.
    format
        ``"bf16"`` or ``"fp16"``: the format whose swamped share is checked.  Default:
        the run's own (the store's ``dtypes`` root attribute: the master weights'
        dtype, else the parameters'); bf16 when the store records none (the summary
        says so).  A format the run does not keep its weights in (an fp32 run checked
        for bf16) is a what-if: its severity is weighted by :data:`WHATIF_WEIGHT`,
        context below 0.5.  With ``"fp16"`` the gradient underflow is flagged too,
        weighted by the flushed values' share of the gradient energy.
    min_severity
        Flags below this severity are not emitted.
    """

    loss_scale: float | None = None
    format: str | None = None
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"loss_scale": [Interval(float, 0, None, "neither"), None]}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format is not None and self.format not in FLAG_FORMATS:         # the message tests and users match: "format must be one of"
            raise SpecError(f"precision: format must be one of {FLAG_FORMATS}; got {self.format!r}.")



# ------------------------------------------------------------------ number formats
def round_to(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round float64 values to the nearest value of *fmt* (ties to even), as float64.

    The spacing at ``x`` is ``2^(max(e, e_min) - p)`` with ``e = floor(log2|x|)`` and
    ``p`` explicit mantissa bits; values past the largest finite one become ±inf.
    """
    p, emin, vmax = FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)                                  # |x| = m 2^e, m in [0.5, 1)
    q = np.ldexp(1.0, np.maximum(e - 1, emin) - p)
    r = np.rint(x / q) * q
    return np.where(np.abs(r) > vmax, np.copysign(np.inf, x), r)


def ulp(x: np.ndarray, fmt: str) -> np.ndarray:
    """Spacing of *fmt* at ``round_to(x)`` (upward spacing at a power of two; the subnormal spacing at 0)."""
    p, emin, _ = FORMATS[fmt]
    r = round_to(x, fmt)
    _, e = np.frexp(r)
    return np.ldexp(1.0, np.where(r == 0, emin, np.maximum(e - 1, emin)) - p)


def swamped(w: np.ndarray, delta: np.ndarray, fmt: str) -> np.ndarray:
    """True where the non-zero update *delta* leaves ``round_to(w, fmt)`` unchanged."""
    wf = round_to(w, fmt)
    d = np.asarray(delta, dtype=np.float64)
    return (d != 0) & (round_to(wf + d, fmt) == wf)


def amax_scale(amax: float, fmt: str) -> float:
    """The per-tensor scale of *fmt*: the largest power of two ``s`` with ``amax * s <= max_f`` (1 when amax is 0).

    Power-of-two scaling is exact, so it moves values without rounding them; it is
    within a factor 2 of the ``max_f / amax`` scale of FP8 recipes (Micikevicius et al. 2022).
    """
    if not (np.isfinite(amax) and amax > 0):
        return 1.0
    vmax = FORMATS[fmt][2]
    _, e = np.frexp(vmax / amax)                   # vmax/amax = m 2^e, m in [0.5, 1)
    s = float(np.ldexp(1.0, int(e) - 1))
    while amax * s > vmax:                         # the division may round across a power of two
        s /= 2
    while amax * s * 2 <= vmax:
        s *= 2
    return s


def _amax(x: np.ndarray) -> float:
    """Largest finite ``|x|`` (0 when none), in blocks of ``_BLOCK`` elements."""
    flat = np.asarray(x).reshape(-1)
    best = 0.0
    for a in range(0, flat.size, _BLOCK):
        b = flat[a:a + _BLOCK]
        m = max(float(b.max()), -float(b.min())) if b.size else 0.0     # no |x| temporary
        if not np.isfinite(m):                                         # a NaN or Inf in the block
            c = np.abs(b)
            c = c[np.isfinite(c)]
            m = float(c.max()) if c.size else 0.0
        best = max(best, m)
    return best


def _byte_counts(b: np.ndarray) -> np.ndarray:
    """``np.bincount(b, minlength=256)`` of a contiguous uint8 array, about 1.7x faster.

    Consecutive bytes are counted in pairs (one ``uint16`` view, a 65,536-bin count over
    half as many elements: ``bincount``'s cost is per element), then the pair table is
    summed along each axis (each byte is the row of one pair and the column of none, or
    the reverse: every byte counts once whatever the byte order).
    """
    b = np.ascontiguousarray(b, dtype=np.uint8).ravel()
    odd = b.size % 2
    pairs = np.bincount(b[: b.size - odd].view(np.uint16), minlength=1 << 16).reshape(256, 256)
    out = pairs.sum(axis=0) + pairs.sum(axis=1)
    if odd:
        out[b[-1]] += 1
    return out


def exponent_hist(g: np.ndarray) -> np.ndarray:
    """Counts of non-zero finite ``|g|`` by frexp exponent ``e`` (``|g| ∈ [2^(e-1), 2^e)``).

    Returns ``EXP_MAX - EXP_MIN + 3`` counts: one per exponent, then zeros, then non-finite.
    """
    g = np.ascontiguousarray(g, dtype=np.float32).ravel()
    u = g.view(np.uint32)
    biased = _byte_counts((u >> 23).astype(np.uint8))           # IEEE binary32 biased exponents (the cast drops the sign)
    counts = np.zeros(EXP_MAX - EXP_MIN + 1, dtype=np.int64)
    counts[np.arange(1, 255) - 126 - EXP_MIN] = biased[1:255]  # normal: |g| = 1.m 2^(b-127), frexp e = b - 126
    zeros = int(np.count_nonzero(g == 0)) if biased[0] else 0  # +0 and -0 (NaN is not 0); both have b = 0
    if biased[0] > zeros:                                      # subnormals (rare): frexp on those alone
        sub = g[((u >> 23) & 0xFF == 0) & ((u & 0x7FFFFFFF) != 0)]
        counts += np.bincount(np.clip(np.frexp(sub)[1], EXP_MIN, EXP_MAX) - EXP_MIN,
                              minlength=EXP_MAX - EXP_MIN + 1)
    return np.concatenate([counts, [zeros, int(biased[255])]]).astype(np.int64)


def fp16_gradient_shares(hist: np.ndarray, loss_scale: float = 1.0) -> dict[str, float]:
    """Underflow / subnormal / overflow shares of the non-zero gradients at *loss_scale*."""
    counts = hist[: EXP_MAX - EXP_MIN + 1].astype(np.float64)
    n = counts.sum()
    e = np.arange(EXP_MIN, EXP_MAX + 1) + np.log2(loss_scale)     # scaled |g| in [2^(e-1), 2^e)
    if n == 0:
        return {"grad_underflow_fp16": np.nan, "grad_subnormal_fp16": np.nan, "grad_overflow_fp16": np.nan,
                "grad_underflow_fp16_energy": np.nan}
    energy = counts * 4.0 ** (e - 0.5)                              # |g| ~ 2^(e-1/2) in its binade
    return {"grad_underflow_fp16": counts[e <= -24].sum() / n,
            "grad_subnormal_fp16": counts[(e > -24) & (e <= -14)].sum() / n,
            "grad_overflow_fp16": counts[e - 1 >= 16].sum() / n,
            "grad_underflow_fp16_energy": float(energy[e <= -24].sum() / energy.sum()) if energy.sum() > 0 else 0.0}


def fp8_gradient_shares(hist: np.ndarray, amax: float | None) -> dict[str, float]:
    """Underflow / subnormal shares of the non-zero gradients in each FP8 format after its amax scale.

    With ``s`` a power of two, scaled ``|g| s`` lies in ``[2^(e-1), 2^e) s``: below the
    smallest subnormal ``2^(emin-p)`` exactly when ``2^e s <= 2^(emin-p)``.
    """
    counts = hist[: EXP_MAX - EXP_MIN + 1].astype(np.float64)
    n = counts.sum()
    out: dict[str, float] = {}
    for fmt in FP8:
        p, emin, _ = FORMATS[fmt]
        if n == 0 or amax is None:
            out[f"grad_underflow_{fmt}"] = out[f"grad_subnormal_{fmt}"] = float("nan")
            continue
        e = np.arange(EXP_MIN, EXP_MAX + 1) + np.log2(amax_scale(amax, fmt))
        out[f"grad_underflow_{fmt}"] = counts[e <= emin - p].sum() / n
        out[f"grad_subnormal_{fmt}"] = counts[(e > emin - p) & (e <= emin)].sum() / n
    return out


def pair_counts(w0: np.ndarray, w1: np.ndarray, grad_nonzero: np.ndarray | None, steps: float) -> dict[str, Any]:
    """Update statistics of one snapshot pair (see the module docstring).

    ``grad_nonzero``: where some gradient between the snapshots was non-zero
    (``None`` when the store has no whole gradient for the tensor).
    """
    w0 = np.asarray(w0, dtype=np.float32).ravel()
    w1 = np.asarray(w1, dtype=np.float32).ravel()
    gnz = None if grad_nonzero is None else np.asarray(grad_nonzero, dtype=bool).ravel()
    out: dict[str, Any] = {k: 0 for k in COUNTS}
    hist = np.zeros(ULP_EDGES.size - 1, dtype=np.int64)
    scale = {f: amax_scale(_amax(w0), f) for f in FP8}       # per-tensor scale of the snapshot W_t
    for a in range(0, w0.size, _BLOCK):
        s = slice(a, a + _BLOCK)
        x0, x1 = w0[s].astype(np.float64), w1[s].astype(np.float64)
        fin = np.isfinite(x0) & np.isfinite(x1)
        d = np.where(fin, x1 - x0, 0.0)
        step = d / max(steps, 1.0)
        out["n"] += int(fin.sum())
        out["updated"] += int((d != 0).sum())
        out["swamped_bf16"] += int(swamped(x0, step, "bf16").sum())
        out["swamped_fp16"] += int(swamped(x0, step, "fp16").sum())
        for f in FLAG_FORMATS:           # the whole gap's update: what no cancellation inside the gap explains
            out[f"net_swamped_{f}"] += int(swamped(x0, d, f).sum())
        for f in FP8:
            out[f"swamped_{f}"] += int(swamped(x0 * scale[f], step * scale[f], f).sum())
        nz = d != 0
        with np.errstate(divide="ignore"):
            ratio = np.log2(np.abs(step[nz]) / ulp(x0[nz], "bf16"))
        hist += np.histogram(np.clip(ratio, ULP_EDGES[0], ULP_EDGES[-1]), bins=ULP_EDGES)[0]
        if gnz is not None:
            g = gnz[s] & fin
            out["grad_nonzero"] += int(g.sum())
            out["lost"] += int((g & (d == 0)).sum())
    out["ulp_hist"] = hist
    out["has_grad"] = gnz is not None
    return out


# ---------------------------------------------------------------------- lazy pass
def _pair_task(w0: np.ndarray, w1: np.ndarray, gnz: np.ndarray | None, steps: float, spec: Any,
               records: tuple[int, int]) -> dict[str, Any]:
    if gnz is not None and spec is not None:
        gnz = spec.merge(gnz)
    out = pair_counts(w0, w1, gnz, steps)
    out["records"] = records
    out["steps"] = steps
    return out


def _pairs(n_snapshots: int) -> list[int]:
    """Indices ``t`` of the pairs ``(t, t+1)`` analysed: all, or MAX_PAIRS evenly spaced."""
    if n_snapshots < 2:
        return []
    t = np.arange(n_snapshots - 1)
    if t.size > MAX_PAIRS:
        t = np.unique(np.linspace(0, n_snapshots - 2, MAX_PAIRS).round().astype(int))
    return [int(i) for i in t]


def _pair_specs(store: Store) -> list[tuple[int, int, int, float]]:
    """``(t, r0, r1, steps)`` of every snapshot pair analysed."""
    rec = store.weight_records()
    step = store.read("batches/step").astype(np.float64) if store.n_records else np.zeros(0)
    out = []
    for t in _pairs(len(rec)):
        r0, r1 = int(rec[t]), int(rec[t + 1])
        steps = float(step[r1] - step[r0]) if r1 < step.size and r0 < step.size else float(r1 - r0)
        out.append((t, r0, r1, max(steps, 1.0)))
    return out


def _pair_tasks(store: Store, tensor: str, pairs: list[tuple[int, int, int, float]], gnz: Any = None) -> Any:
    """One task per snapshot pair; *gnz* (a Delayed list of masks, one per pair with ``r1 > r0``) or None."""
    import dask

    w = store.weight(tensor)
    spec = None if gnz is None else HeadSpec.from_attrs(store.grads[tensor].attrs)
    tasks, i = [], 0
    for t, r0, r1, steps in pairs:
        g = None
        if gnz is not None and r1 > r0:
            g, i = gnz[i], i + 1
        tasks.append(dask.delayed(_pair_task)(w[t], w[t + 1], g, steps, None if g is None else spec, (r0, r1)))
    return dask.delayed(list)(tasks)


def lazy(store: Store) -> dict[str, Any]:
    """Snapshot-pair update counts of tensors with weights but no stored gradient (the rest: :func:`slab_reductions`)."""
    pairs = _pair_specs(store)
    if not pairs:
        return {}
    return {f"pairs|{t}": _pair_tasks(store, t, pairs) for t in sorted(store.weights) if t not in store.grads}


def nonzero_masks(x: np.ndarray, sel: tuple[slice, ...], spans: list[tuple[int, int]]) -> dict[Any, np.ndarray]:
    """Chunk step: per record span ``[r0, r1)``, where some gradient of the slab's records in it is non-zero."""
    from gradforensics.analysis.toolkit.slabs import feature_blocks

    a = int(sel[0].start)
    out = np.zeros((len(spans), *x.shape[1:]), dtype=bool)
    for j, (r0, r1) in enumerate(spans):
        lo, hi = max(r0 - a, 0), min(r1 - a, x.shape[0])
        if hi > lo:
            out[j] = (x[lo:hi] != 0).any(axis=0)
    return feature_blocks(sel, out)


def _masks(part: dict[Any, np.ndarray], n: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    from gradforensics.analysis.toolkit.slabs import assemble_feature_blocks

    return list(assemble_feature_blocks(part, n, shape, bool))


def _hist_chunk(x: np.ndarray, sel: tuple[slice, ...]) -> np.ndarray:
    """Chunk step: :func:`exponent_hist` of a slab, in blocks of ``_BLOCK`` elements (bounds its temporaries)."""
    flat = np.asarray(x).reshape(-1)
    return np.sum([exponent_hist(flat[a:a + _BLOCK]) for a in range(0, max(flat.size, 1), _BLOCK)], axis=0)


def _amax_chunk(x: np.ndarray, sel: tuple[slice, ...]) -> float:
    """Chunk step: the largest finite ``|g|`` of a slab (the FP8 gradient scale)."""
    return _amax(x)


def slab_reductions(store: Store) -> dict[str, Any]:
    """Per stored gradient, inside the engine's one read of each slab: the exponent histogram and,
    for tensors with weight snapshots, the non-zero masks between snapshots that the pair counts need."""
    from functools import partial

    from gradforensics.analysis.contract.grams import SlabReduction
    from gradforensics.analysis.toolkit.slabs import merge_feature_blocks

    out: dict[str, Any] = {}
    pairs = _pair_specs(store)
    spans = [(r0, r1) for _, r0, r1, _ in pairs if r1 > r0]
    for tensor, info in sorted(store.grads.items()):
        if tensor in store.weights and pairs:
            shape = tuple(info.shape[1:])
            out[f"pairs|{tensor}"] = SlabReduction(
                tensor=tensor, chunk=partial(nonzero_masks, spans=spans),
                combine=partial(merge_feature_blocks, op=np.logical_or),
                aggregate=partial(_masks, n=len(spans), shape=shape),
                finish=partial(_pair_tasks, store, tensor, pairs))
        out[f"grad_exp|{tensor}"] = SlabReduction(tensor=tensor, chunk=_hist_chunk, combine=sum)
        out[f"grad_amax|{tensor}"] = SlabReduction(tensor=tensor, chunk=_amax_chunk, combine=max)
    return out


# ------------------------------------------------------------------------ compute
def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")


def tensor_row(tensor: str, pairs: list[dict[str, Any]] | None, grad_hist: np.ndarray | None,
               loss_scale: float, grad_amax: float | None = None) -> dict[str, Any]:
    """One table row from the pair counts, the gradient exponent histogram and the gradient amax."""
    tot = {k: sum(int(p[k]) for p in pairs or []) for k in COUNTS}
    has_grad = any(p["has_grad"] for p in pairs or [])
    row: dict[str, Any] = {
        "tensor": tensor, "head": None, "n_pairs": len(pairs or []),
        "record_first": pairs[0]["records"][0] if pairs else None,
        "record_last": pairs[-1]["records"][1] if pairs else None,
        "updated_share": _ratio(tot["updated"], tot["n"]),
        "swamped_bf16": _ratio(tot["swamped_bf16"], tot["updated"]),
        "swamped_fp16": _ratio(tot["swamped_fp16"], tot["updated"]),
        **{f"swamped_{f}": _ratio(tot[f"swamped_{f}"], tot["updated"]) for f in FP8},
        **{f"net_swamped_{f}": _ratio(tot[f"net_swamped_{f}"], tot["updated"]) for f in FLAG_FORMATS},
        "snapshot_gap": float(np.median([p["steps"] for p in pairs])) if pairs and "steps" in pairs[0] else 1.0,
        "lost_share": _ratio(tot["lost"], tot["grad_nonzero"]) if has_grad else float("nan"),
        "median_update_ulps_bf16": _median_ulps(pairs),
        "loss_scale": loss_scale,
    }
    hist = grad_hist if grad_hist is not None else np.zeros(EXP_MAX - EXP_MIN + 3, np.int64)
    row.update(fp16_gradient_shares(hist, loss_scale))
    row.update(fp8_gradient_shares(hist, grad_amax if grad_hist is not None else None))
    row["grad_zero_share"] = _ratio(hist[-2], hist[:-1].sum()) if grad_hist is not None else float("nan")
    return row


def _median_ulps(pairs: list[dict[str, Any]] | None) -> float:
    """Median of ``|Δ| / ULP_bf16(w)`` from the pooled histogram (bin centre, as a ratio)."""
    if not pairs:
        return float("nan")
    h = np.sum([p["ulp_hist"] for p in pairs], axis=0)
    if h.sum() == 0:
        return float("nan")
    i = int(np.searchsorted(np.cumsum(h), h.sum() / 2))
    return float(2.0 ** ((ULP_EDGES[i] + ULP_EDGES[i + 1]) / 2))


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, PrecisionOptions)
    scale = opt.loss_scale or float(ctx.meta.extra.get("loss_scale", 1.0) or 1.0)
    lz = ctx.computed.get(NAME, {})
    tensors = sorted({k.split("|", 1)[1] for k in lz})
    rows, series = [], {}
    for t in tensors:
        pairs = lz.get(f"pairs|{t}")
        rows.append(tensor_row(t, pairs, lz.get(f"grad_exp|{t}"), scale, lz.get(f"grad_amax|{t}")))
        if pairs:
            series[f"ulp_hist/{t}"] = np.sum([p["ulp_hist"] for p in pairs], axis=0)
            for f in ("bf16", *FP8):
                series[f"swamped_{f}/{t}"] = np.array([_ratio(p[f"swamped_{f}"], p["updated"]) for p in pairs])
            series[f"pair_records/{t}"] = np.array([p["records"] for p in pairs], dtype=np.int64)
    series["ulp_edges"] = ULP_EDGES
    cols = ["tensor", "head", "n_pairs", "record_first", "record_last", "updated_share", "swamped_bf16",
            "swamped_fp16", "swamped_fp8_e4m3", "swamped_fp8_e5m2", "lost_share", "median_update_ulps_bf16",
            "grad_underflow_fp16", "grad_subnormal_fp16", "grad_overflow_fp16", "grad_underflow_fp8_e4m3",
            "grad_subnormal_fp8_e4m3", "grad_underflow_fp8_e5m2", "grad_subnormal_fp8_e5m2", "grad_zero_share",
            "loss_scale", "net_swamped_bf16", "net_swamped_fp16", "snapshot_gap", "grad_underflow_fp16_energy"]
    return AnalysisResult(table=pd.DataFrame(rows, columns=cols), series=series)


# -------------------------------------------------------------------------- flags
def run_format(meta: Any) -> str | None:
    """The format the run keeps its weights in (``dtypes``: master, else parameters), or None when not recorded."""
    d = getattr(meta, "dtypes", None) or {}
    name = d.get("master") or d.get("parameters")
    return DTYPE_FORMATS.get(name, name) if name else None


def swamped_share(row: dict[str, Any], fmt: str) -> float:
    """The swamped share severity reads: per step when snapshots are a step apart; between snapshots K steps
    apart, the share whose whole K-step update is swamped (the per-step average ``Δ/K`` counts updates that
    cancel inside the gap as swamped and over-counts; the table keeps both, and ``snapshot_gap``)."""
    gap = _num(row.get("snapshot_gap", 1.0)) or 1.0
    return _num(row[f"swamped_{fmt}"]) if gap <= 1.0 else _num(row.get(f"net_swamped_{fmt}"))


def underflow_severity(row: dict[str, Any]) -> float:
    """fp16 underflow share weighted by the flushed values' share of the gradient energy."""
    share = _num(row["grad_underflow_fp16"])
    energy = _num(row.get("grad_underflow_fp16_energy", 1.0))
    return share * min(1.0, energy / UNDERFLOW_ENERGY_FULL)


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """A flag per tensor whose updates are swamped in the run's format (a what-if format: context), or lost."""
    opt = ctx.options_for(NAME, PrecisionOptions)
    own = run_format(ctx.meta)
    fmt = opt.format or (own if own in FLAG_FORMATS else "bf16")
    whatif = own is not None and own != fmt
    out = []
    for row in result.table.to_dict("records"):
        sw = swamped_share(row, fmt)
        lost = _num(row["lost_share"])
        under = underflow_severity(row) if fmt == "fp16" else 0.0
        sev = max(sw * (WHATIF_WEIGHT if whatif else 1.0), lost, under * (WHATIF_WEIGHT if whatif else 1.0))
        if sev < opt.min_severity:
            continue
        first = int(row["record_first"]) if row["n_pairs"] else 0
        last = int(row["record_last"]) if row["n_pairs"] else max(ctx.n_records - 1, 0)
        text = _summary(row, fmt, sw, lost, under, first, last) + _format_note(own, fmt, row)
        out.append(Flag(
            kind="precision", tensor=row["tensor"], head=None, sources=(), severity=float(min(sev, 1.0)),
            records=(first, last),
            evidence={k: row.get(k) for k in ("swamped_bf16", "swamped_fp16", "lost_share", "median_update_ulps_bf16",
                                              "grad_underflow_fp16", "grad_overflow_fp16", "loss_scale",
                                              "snapshot_gap", "grad_underflow_fp16_energy")}
            | {"format": fmt, "run_format": own or "unknown", "whatif": whatif},
            summary=text))
    return out


def _format_note(own: str | None, fmt: str, row: dict[str, Any]) -> str:
    gap = _num(row.get("snapshot_gap", 1.0)) or 1.0
    note = (f" (snapshots {gap:g} steps apart: the share is of updates swamped over the whole gap; per step "
            f"{_num(row[f'swamped_{fmt}']):.0%} at most)") if gap > 1 else ""
    if own is None:
        return note + f" The store records no dtypes (root attribute 'dtypes'): {fmt} weights assumed."
    if own != fmt:
        return note + (f" The run keeps its weights in {own}, so {fmt} is a what-if: context, not a "
                       f"problem of this run.")
    return note


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return 0.0
    return v if np.isfinite(v) else 0.0


def _summary(row: dict[str, Any], fmt: str, sw: float, lost: float, under: float, first: int, last: int) -> str:
    t = row["tensor"]
    if lost >= max(sw, under):
        return (f"{t}: {lost:.0%} of the weights that had a non-zero gradient between records {first} and {last} "
                f"did not change at all in the stored snapshots: updates are already rounded away; keep fp32 "
                f"master weights or raise the learning rate for this tensor.")
    if under > sw:
        return (f"{t}: {_num(row['grad_underflow_fp16']):.0%} of its gradient values, "
                f"{_num(row.get('grad_underflow_fp16_energy')):.2g} of its gradient energy, fall below fp16's "
                f"smallest subnormal (2^-24) at loss scale {row['loss_scale']:g}: raise the loss scale or train in bf16.")
    return (f"{t}: {sw:.0%} of its weight updates between records {first} and {last} are smaller than half a "
            f"{fmt} ULP of the weight (median update {row['median_update_ulps_bf16']:.2g} bf16 ULP): without fp32 "
            f"master weights this tensor stops learning.")


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Histogram of per-step update size in bf16 ULPs of the weight, with the half-ULP lines."""
    edges = np.asarray(result.series["ulp_edges"])
    h = np.asarray(result.series.get(f"ulp_hist/{flag.tensor}", np.zeros(edges.size - 1)), dtype=float)
    share = h / h.sum() if h.sum() else h
    ax.bar(edges[:-1], share, width=np.diff(edges), align="edge", color="0.6", edgecolor="0.3")
    ax.axvline(-1.0, color="C3", lw=2, label="bf16: half an ULP")
    ax.axvline(-4.0, color="C0", lw=2, ls="--", label="fp16: half an ULP")
    ax.set_xlabel("log2( |per-step update| / bf16 ULP of the weight )")
    ax.set_ylabel("share of updated elements")
    sw = flag.evidence.get("swamped_bf16")
    ax.set_title(f"{flag.tensor}: updates left of the red line are rounded away in bf16"
                 + (f" ({sw:.0%})" if isinstance(sw, float) and np.isfinite(sw) else ""), fontsize=9)
    ax.legend(fontsize=8)


#: What a ``precision`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Micikevicius2018] P. Micikevicius et al., "Mixed Precision Training", ICLR 2018.
#: .. [Zamirai2020] P. Zamirai et al., "Revisiting BFloat16 Training", 2020.
ADVICE = Advice(
    title="Precision floor",
    phrase="updates fall below the weights' precision floor",
    evidence_keys={"swamped_bf16": "swamped in bf16", "lost_share": "unchanged share",
                   "swamped_fp16": "swamped in fp16", "grad_underflow_fp16": "fp16 gradient underflow",
                   "grad_overflow_fp16": "fp16 gradient overflow",
                   "median_update_ulps_bf16": "median update (bf16 ULPs)"},
    remedies=(
        "Keep fp32 master weights (mixed precision) so small updates accumulate instead of rounding away.",
        "Or use stochastic rounding / Kahan-compensated summation for bf16 weight updates.",
        "For fp16 gradient underflow/overflow: dynamic loss scaling."),
    references=("Micikevicius et al. 2018, Mixed Precision Training",
                "Zamirai et al. 2020, Revisiting BFloat16 Training"),
    cause="precision",
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRADS, Need.WEIGHTS), compute=compute, flags=flags, plot=plot,
                    kinds={"precision": ADVICE}, options=PrecisionOptions, lazy=lazy, long_history=True,
                    slab_reductions=slab_reductions)
