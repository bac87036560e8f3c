"""Long histories: what the Gram pass computes when N×N would not fit.

Above ``N₀`` records (:func:`threshold`: at most :data:`N0`, fewer when one tensor's
Gram matrices - its whole K and one per head - would exceed :data:`GRAM_BUDGET`; engine
option ``long_history``) the per-record
Gram matrix ``K`` (N×N) is never formed.  The same single streaming read of each
slab computes, per tensor and head:

* the **banded Gram** ``B[l, i] = <g_i, g_{i-l}>`` for lags ``0 ≤ l ≤ L``
  (``L`` = :data:`BAND`): the per-record squared norms (``l = 0``), consecutive
  cosines (``l = 1``) and every lag an oscillation of period up to ``L`` needs;
* the **Gram of window-source sums**: the records are cut into ``n_w``
  contiguous windows (:func:`window_edges_for`, ``W ≈ N / n_w`` records each) and
  each window's records are summed per source with their mixture shares as
  weights, ``Y_{(w,s)} = Σ_{i∈w} A_is g_i``; ``Y Yᵀ`` (``m × m``, ``m = n_w S``) is
  summed over slabs.  Divided by the (finite) weights these are the Gram matrix
  of *super-records*: the per-window, per-source mean gradients;
* the per-record non-finite counts.

Drift, conflict and noise then run their exact K-space statistics on the
super-records (means of disjoint record sets are independent, so the
U-statistics stay unbiased; a super-record of ``n`` batches of ``b`` samples is
one batch of ``n·b``); oscillation reads the band
(:mod:`gradforensics.analysis.kinds.oscillation`).  Memory is
``O(N·L + m²)`` per tensor and head instead of ``O(N²)``.

The record axis is read in store order (for a training store: capture order,
i.e. step order).

An analysis declares that it runs in this regime (``Analysis(long_history=True)``: its
``compute`` reads ``ctx.long`` when ``ctx.grams`` is empty); the pass refuses one that
does not, in one line (:func:`check_supported`), rather than hand it an empty ``ctx.grams``.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import Design, LongGram, LongHistory
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gradforensics.analysis.contract.model import Analysis

__all__ = ["BAND", "GRAM_BUDGET", "N0", "N_WINDOWS", "Design", "LongGram", "LongHistory", "band_products",
           "check_supported", "design", "threshold", "window_edges_for", "window_sums"]

N0 = 4096
"""Most records the exact regime takes (engine option ``long_history``; see :func:`threshold`)."""
GRAM_BUDGET = 512 * 2**20
"""Bytes one tensor's exact Gram matrices (whole + heads) may take: ``N₀`` shrinks below :data:`N0` for many heads."""
BAND = 32
"""Lags of the banded Gram (engine option ``band``): oscillation periods up to ``BAND`` records."""
N_WINDOWS = 128
"""Windows of the window-source sums (engine option ``windows``); ``W = ceil(N / N_WINDOWS)`` records each."""
_ROW_BLOCK = 64


def threshold(units: int, requested: int | None = None) -> int:
    """``N₀``: *requested*, or ``min(N0, ⌊√(GRAM_BUDGET / (8 · units))⌋)``, *units* the Gram matrices held at once.

    The exact regime's Gram matrices are spilled to disk as the pass computes them
    (:mod:`~gradforensics.analysis.engine.spill`), so what is in memory at once is
    one tensor's (its whole-tensor K and one per head) per thread, never the
    whole store's: *units* is the largest tensor's, ``1 + heads``.  A plain tensor
    keeps 4,096 records exact, a tensor of 8 heads 2,730, of 32 heads (a 7B-shaped
    store) 1,426, whatever the number of tensors.  The core count does not enter:
    the same store gets the same regime on every machine (memory is about
    ``GRAM_BUDGET`` per thread, as it is ``slab_bytes`` per thread for the reads).
    """
    if requested is not None:
        return int(requested)
    return int(min(N0, math.isqrt(GRAM_BUDGET // (8 * max(1, int(units))))))


def check_supported(selected: Iterable[Analysis], n_records: int, n0: int) -> None:
    """Refuse a pass over *n_records* > *n0* records that selects an analysis without long-history support.

    Raises
    ------
    SpecError
        One of *selected* does not declare ``long_history=True``: one line naming it,
        the record count, ``N₀`` and what to do (leave it out, or raise ``N₀``).
    """
    bad = [a.name for a in selected if not a.long_history]
    if bad:
        names = ", ".join(bad)
        raise SpecError(f"{names}: the store holds {int(n_records):,} records, above N₀ = {int(n0):,} (the long-history "
                        "regime: no per-record Gram matrix, ctx.grams is empty), and this analysis does not declare "
                        "long-history support (Analysis(long_history=True)); leave it out (only=...) or raise N₀ with "
                        f"options={{'engine': {{'long_history': {int(n_records)}}}}}.")


def window_edges_for(n: int, n_windows: int = N_WINDOWS) -> np.ndarray:
    """Boundaries ``[0, ..., n]`` of ``min(n_windows, n)`` contiguous windows of ``ceil(n / n_windows)`` records.

    The last window holds the remainder.
    """
    w = max(1, math.ceil(n / max(1, n_windows)))
    return np.unique(np.r_[np.arange(0, n, w), n]).astype(np.int64)


def design(mixture: np.ndarray, band: int = BAND, n_windows: int = N_WINDOWS) -> Design:
    """The super-record design of a store with these mixture rows (``batches/mixture``)."""
    mix = np.asarray(mixture, dtype=np.float64)
    return Design(n=int(mix.shape[0]), edges=window_edges_for(mix.shape[0], n_windows), mixture=mix, band=int(band))


# --------------------------------------------------------------------- kernels
def band_products(x: np.ndarray, prev: np.ndarray | None, band: int) -> np.ndarray:
    """``B[l, j] = <x_j, x_{j-l}>`` (``0 ≤ l ≤ band``) in float64; rows before ``x`` come from *prev*.

    *x* is ``(n, f)``; *prev* the ``p ≤ band`` records just before it (or None);
    entries whose partner precedes both are 0.  Narrow rows use shifted products;
    wide rows BLAS products of ``_ROW_BLOCK`` rows against the band before them.
    """
    n = x.shape[0]
    z = x if prev is None or prev.shape[0] == 0 else np.concatenate([prev, x])
    p = z.shape[0] - n
    out = np.zeros((band + 1, n))
    if z.shape[1] <= 64:
        zz = z.astype(np.float64)
        for lag in range(band + 1):
            lo = max(0, lag - p)            # first j whose partner j - lag is in z
            if lo < n:
                out[lag, lo:] = np.einsum("ij,ij->i", zz[p + lo:], zz[p + lo - lag:p + n - lag])
        return out
    for j0 in range(0, n, _ROW_BLOCK):
        j1 = min(n, j0 + _ROW_BLOCK)
        c0 = max(0, p + j0 - band)
        P = _product(z[p + j0:p + j1], z[c0:p + j1])        # rows j0..j1 against z[c0 : p+j1]
        rows = np.arange(j0, j1)
        for lag in range(band + 1):
            cols = rows + p - lag - c0
            ok = cols >= 0
            out[lag, rows[ok]] = P[rows[ok] - j0, cols[ok]]
    return out


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ bᵀ`` in float32 over feature blocks, accumulated in float64."""
    from gradforensics.analysis.engine.gram import SUB_BLOCK

    acc = np.zeros((a.shape[0], b.shape[0]))
    for s in range(0, a.shape[1], SUB_BLOCK):
        acc += a[:, s:s + SUB_BLOCK] @ b[:, s:s + SUB_BLOCK].T
    return acc


def window_sums(x: np.ndarray, r0: int, d: Design) -> np.ndarray:
    """``Y`` (m × f, float64): the rows of *x* (records ``r0 ..``) summed per window and source."""
    n, f = x.shape
    y = np.zeros((d.m, f))
    S = d.n_sources
    first = int(np.searchsorted(d.edges, r0, side="right")) - 1
    for w in range(first, d.n_windows):
        a, b = max(int(d.edges[w]), r0), min(int(d.edges[w + 1]), r0 + n)
        if a >= b:
            break
        A = d.mixture[a:b].T.astype(np.float32)
        y[w * S:(w + 1) * S] += A @ x[a - r0:b - r0]
    return y


def finite_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """*x* with non-finite elements zeroed (a copy only when there are any) and per-row counts."""
    ok = np.isfinite(x)
    if ok.all():
        return x, np.zeros(x.shape[0], dtype=np.int64)
    counts = (x.shape[1] - np.count_nonzero(ok, axis=1)).astype(np.int64)
    return np.where(ok, x, 0).astype(np.float32), counts


# --------------------------------------------------------------------- results
# ----------------------------------------------------------------------- graph
Partial = dict[tuple[Any, ...], Any]


def long_chunk(x: np.ndarray, prev: np.ndarray | None, r0: int, head0: int, split: bool, d: Design,
               close: bool) -> Partial:
    """Chunk step of the long-history pass: band, window-source sums (or their Gram) and non-finite counts.

    *x* holds records ``r0 ..`` of one slab, *prev* the ``≤ band`` records before
    them (a split record axis).  With *close* (the slab holds every record) the
    window-source sums become their Gram matrix at once.
    """
    from gradforensics.analysis.engine.gram import head_blocks

    out: Partial = {}
    before = dict(head_blocks(prev, head0, split)) if prev is not None and prev.shape[0] else {}
    for h, xh in head_blocks(x, head0, split):
        xf, nf = finite_rows(np.asarray(xh, dtype=np.float32))
        pv = before.get(h)
        if pv is not None:
            pv = finite_rows(np.asarray(pv, dtype=np.float32))[0]
        out[("band", h, r0)] = band_products(xf, pv, d.band)
        out[("nf", h, r0)] = nf
        y = window_sums(xf, r0, d)
        if close:
            out[("g", h)] = y @ y.T
        else:
            out[("y", h)] = y
    return out


def close_sums(part: Partial) -> Partial:
    """Turn the window-source sums ``Y`` of one feature column (all record blocks added) into ``Y Yᵀ``."""
    out: Partial = {}
    for key, val in part.items():
        if key[0] == "y":
            out[("g", key[1])] = val @ val.T
        else:
            out[key] = val
    return out


def aggregate_long(part: Partial, tensor: str, n: int, n_heads: int | None, n_features: int,
                   from_sketch: bool, band: int) -> list[LongGram]:
    """Aggregate step: per head, the band (NaN-masked), the sums' Gram and the counts; whole tensor first."""
    heads = [-1] if n_heads is None else list(range(n_heads))
    raw: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for h in heads:
        b = np.zeros((band + 1, n))
        nf = np.zeros(n, dtype=np.int64)
        g: np.ndarray | float = 0.0
        for key, val in part.items():
            if key[1] != h:
                continue
            if key[0] == "band":
                b[:, key[2]:key[2] + val.shape[1]] += val
            elif key[0] == "nf":
                nf[key[2]:key[2] + val.size] += val
            elif key[0] == "g":
                g = g + val
        raw[h] = (b, np.asarray(g, dtype=np.float64), nf)
    if n_heads is None:
        b, g, nf = raw[-1]
        return [_long_result(tensor, None, b, g, nf, n_features, from_sketch)]
    out = [_long_result(tensor, None, sum(raw[h][0] for h in heads), sum(raw[h][1] for h in heads),
                        sum(raw[h][2] for h in heads), n_features, from_sketch)]
    out += [_long_result(tensor, h, *raw[h], n_features // n_heads, from_sketch) for h in heads]
    return out


def _long_result(tensor: str, head: int | None, band: Any, sums: Any, nf: Any, n_features: int,
                 from_sketch: bool) -> LongGram:
    band = np.array(band, dtype=np.float64)
    bad = np.asarray(nf) > 0
    for lag in range(band.shape[0]):
        band[lag, :lag] = np.nan
        if bad.any():
            band[lag, lag:][bad[lag:] | bad[:bad.size - lag]] = np.nan
    return LongGram(tensor, head, band, np.asarray(sums, dtype=np.float64), np.asarray(nf, dtype=np.int64),
                    int(n_features), from_sketch)


def long_graph(store: Any, tensor: str, d: Design, reductions: tuple[Any, ...] = (), *,
               slab_bytes: int, split_every: int) -> Any:
    """Lazy long-history results of one stored tensor, with its slab reductions folded into the same read.

    Computes to ``(list[LongGram], [aggregate of each reduction])``.  Where a slab
    holds every record, read and reduction are one task; with a split record axis
    each record block is one task that also reads the ``band`` records before it,
    and each feature column's blocks meet in a task that takes the sums' Gram.
    """
    from dask.base import tokenize
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    from gradforensics.analysis.engine.gram import reduction_tree

    if tensor in store.grads:
        info, from_sketch = store.grads[tensor], False
    else:
        info, from_sketch = store.sketches[tensor], True
    handle = store.handle(info)
    chunks = store.lazy(info.name, slab_bytes).chunks
    heads = info.heads is not None
    name = f"longgram-{tokenize(handle, chunks, tensor, d.band, d.edges, d.mixture, reductions)}"
    starts = [np.concatenate([[0], np.cumsum(c)]).astype(int) for c in chunks]
    layer: dict[Any, Any] = {}
    parts: list[Any] = []
    blocks = len(chunks[0])
    for col in itertools.product(*[range(len(c)) for c in chunks[1:]]):
        fsel = tuple(slice(int(starts[ax + 1][i]), int(starts[ax + 1][i + 1])) for ax, i in enumerate(col))
        head0 = int(starts[1][col[0]]) if heads else 0
        col_parts = []
        for a in range(blocks):
            r0, r1 = int(starts[0][a]), int(starts[0][a + 1])
            key = (name, "chunk", len(parts), a)
            layer[key] = (_read_long, handle, r0, r1, fsel, head0, heads, d, blocks == 1, reductions)
            col_parts.append(key)
        if blocks == 1:
            parts.append(col_parts[0])
            continue
        top = reduction_tree(layer, f"{name}-col{len(parts)}", col_parts, split_every, reductions)
        closed = (name, "close", len(parts))
        layer[closed] = (close_sums, top)
        parts.append(closed)
    top = reduction_tree(layer, name, parts, split_every, reductions)
    final = (name, "agg")
    layer[final] = (_aggregate_long_all, top, reductions, tensor, int(info.shape[0]),
                    int(info.shape[1]) if heads else None, int(np.prod(info.shape[1:], dtype=np.int64)),
                    from_sketch, d.band)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[])
    return Delayed(final, graph, layer=name)


def _read_long(handle: Any, r0: int, r1: int, fsel: tuple[slice, ...], head0: int, split: bool, d: Design,
               close: bool, reductions: tuple[Any, ...]) -> Partial:
    """Read records ``r0:r1`` of one feature column (and the band before them) and reduce them in one task."""
    from gradforensics.analysis.engine.gram import reduce_chunk

    sel = (slice(r0, r1), *fsel)
    x = handle[sel]
    prev = handle[(slice(max(0, r0 - d.band), r0), *fsel)] if r0 > 0 else None
    out = long_chunk(x, prev, r0, head0, split, d, close)
    if reductions:
        out.update(reduce_chunk(x, sel, reductions))
    return out


def _aggregate_long_all(part: Partial, reductions: tuple[Any, ...], *args: Any) -> tuple[list[LongGram], list[Any]]:
    grams = aggregate_long({k: v for k, v in part.items() if k[0] != "r"}, *args)
    values = [part[("r", j)] if r.aggregate is None else r.aggregate(part[("r", j)])
              for j, r in enumerate(reductions)]
    return grams, values
