"""Number formats for the precision analysis: rounding to bf16 / fp16 / FP8, ULPs, swamped updates.

The maths of :mod:`gradforensics.analysis.kinds.precision` (its docstring says what each
count means and why): :func:`round_to` rounds float64 values to a format (ties to even,
subnormals, overflow to ±inf), :func:`swamped` tells the updates that rounding gives back,
:func:`amax_scale` is the per-tensor power-of-two FP8 scale, :func:`exponent_hist` the exact
base-2 exponent histogram of a gradient slab and :func:`pair_counts` one snapshot pair's
update counts.  Pure NumPy on arrays: no store, no context, no flags.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BLOCK", "COUNTS", "EXP_MAX", "EXP_MIN", "FLAG_FORMATS", "FORMATS", "FP8", "ULP_EDGES", "amax_scale",
           "byte_counts", "exponent_hist", "finite_amax", "fp8_gradient_shares", "fp16_gradient_shares", "pair_counts",
           "round_to", "run_counts", "swamped", "ulp"]


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
EXP_MIN = -160                      # base-2 exponent histogram range (frexp convention)
EXP_MAX = 160
ULP_EDGES = np.arange(-30.0, 20.5, 0.5)   # bins of log2(|Δ| / ULP_bf16(w))
BLOCK = 1 << 20                     # elements per block inside a pair task (bounds memory)

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


def finite_amax(x: np.ndarray) -> float:
    """Largest finite ``|x|`` (0 when none), in blocks of ``BLOCK`` elements."""
    flat = np.asarray(x).reshape(-1)
    best = 0.0
    for a in range(0, flat.size, BLOCK):
        b = flat[a:a + BLOCK]
        m = max(float(b.max()), -float(b.min())) if b.size else 0.0     # no |x| temporary
        if not np.isfinite(m):                                         # a NaN or Inf in the block
            c = np.abs(b)
            c = c[np.isfinite(c)]
            m = float(c.max()) if c.size else 0.0
        best = max(best, m)
    return best


def byte_counts(b: np.ndarray) -> np.ndarray:
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
    biased = byte_counts((u >> 23).astype(np.uint8))           # IEEE binary32 biased exponents (the cast drops the sign)
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


def run_counts(w0: np.ndarray, w1: np.ndarray) -> dict[str, int]:
    """How far the whole run moved each weight, first snapshot to last: per flag format, the elements whose
    net change is below half its ULP at ``w0`` (zero included) - what that format would have kept anyway."""
    w0 = np.asarray(w0, dtype=np.float32).ravel()
    w1 = np.asarray(w1, dtype=np.float32).ravel()
    out = {"n": 0, **{f"run_swamped_{f}": 0 for f in FLAG_FORMATS}}
    for a in range(0, w0.size, BLOCK):
        x0, x1 = w0[a:a + BLOCK].astype(np.float64), w1[a:a + BLOCK].astype(np.float64)
        fin = np.isfinite(x0) & np.isfinite(x1)
        d = np.where(fin, x1 - x0, 0.0)
        out["n"] += int(fin.sum())
        for f in FLAG_FORMATS:
            out[f"run_swamped_{f}"] += int((fin & ((d == 0) | swamped(x0, d, f))).sum())
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
    scale = {f: amax_scale(finite_amax(w0), f) for f in FP8}       # per-tensor scale of the snapshot W_t
    for a in range(0, w0.size, BLOCK):
        s = slice(a, a + BLOCK)
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
