"""Long histories: what the Gram pass computes when N×N would not fit.

Above ``N₀`` records (:func:`threshold`: at most :data:`N0`, fewer when one tensor's
Gram matrices - its whole K and one per head - would exceed :data:`GRAM_BUDGET`; engine
option ``long_history``) the per-record
Gram matrix ``K`` (N×N) is never formed.  The same single streaming read of each
slab computes, per tensor and head:

* the **banded Gram** ``B[l, i] = <g_i, g_{i-l}>`` for lags ``0 ≤ l ≤ L``
  (``L`` = :data:`BAND`), formed :data:`SUB_RECORDS` records at a time inside the
  task that read them and reduced there to what its readers need, per window of
  the band test (:func:`oscillation_edges`): the count, mean and centred sum of
  squares of the lag statistics ``z = h_P · B[1:]`` of every period, ``Σ B[0]``,
  and the sum and count of the consecutive-record cosines
  (:class:`~gradforensics.analysis.contract.grams.WindowMoments`; windows split
  between record blocks combine with Chan's pairwise update).  Only a whole
  tensor's per-record squared norms ``B[0]`` are kept (its gradient-norm series);
* the **Gram of window-source sums**: the records are cut into ``n_w``
  contiguous windows (:func:`window_edges_for`, ``W ≈ N / n_w`` records each) and
  each window's records are summed per source with their mixture shares as
  weights, ``Y_{(w,s)} = Σ_{i∈w} A_is g_i``; ``Y Yᵀ`` (``m × m``, ``m = n_w S``) is
  summed over slabs.  Divided by the (finite) weights these are the Gram matrix
  of *super-records*: the per-window, per-source mean gradients;
* the records holding non-finite values and their counts (sparse: the others hold none).

Drift, conflict and noise then run their exact K-space statistics on the
super-records (means of disjoint record sets are independent, so the
U-statistics stay unbiased; a super-record of ``n`` batches of ``b`` samples is
one batch of ``n·b``); oscillation reads the window moments
(:mod:`gradforensics.analysis.kinds.oscillation`).  What a tensor or head keeps is
``O(m² + n_w L)``, independent of N (a whole tensor adds its N norms); the band
itself lives only in the task that read the records (``SUB_RECORDS × (L+1)``
float64 per unit at a time); with a feature axis split into columns, a unit's
band blocks of one record block meet in one task (:func:`band_partials`).

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

from gradforensics.analysis.contract.grams import Design, LongGram, WindowMoments
from gradforensics.analysis.engine.bandstats import SUB_RECORDS, BandBlock, band_block, block_moments, oscillation_edges
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gradforensics.analysis.contract.model import Analysis

__all__ = ["BAND", "GRAM_BUDGET", "N0", "N_WINDOWS", "band_partials", "check_supported", "design", "only_bands", "threshold",
           "window_edges_for",
           "window_sums", "without_bands"]

N0 = 4096
"""Most records the exact regime takes (engine option ``long_history``; see :func:`threshold`)."""
GRAM_BUDGET = 512 * 2**20
"""Bytes one tensor's exact Gram matrices (whole + heads) may take: ``N₀`` shrinks below :data:`N0` for many heads."""
BAND = 32
"""Lags of the banded Gram (engine option ``band``): oscillation periods up to ``BAND`` records."""
N_WINDOWS = 128
"""Windows of the window-source sums (engine option ``windows``); ``W = ceil(N / N_WINDOWS)`` records each."""


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


# ----------------------------------------------------------------------- graph
Partial = dict[tuple[Any, ...], Any]


def long_chunk(x: np.ndarray, prev: np.ndarray | None, r0: int, head0: int, split: bool, d: Design,
               close: bool, complete: tuple[bool, bool] = (True, True)) -> Partial:
    """Chunk step of the long-history pass: band-test moments, window-source sums (or their Gram), norms, counts.

    *x* holds records ``r0 ..`` of one slab, *prev* the ``≤ band`` records before
    them (a split record axis).  With *close* (the slab holds every record) the
    window-source sums become their Gram matrix at once.  The banded Gram is
    formed :data:`SUB_RECORDS` records at a time and reduced at once to the
    moments of every unit the slab holds whole (*complete*: the heads, the whole
    tensor); a unit split between feature columns leaves its band block
    (``("bp", head, record)``) for :func:`band_partials`.  The whole tensor is head
    ``-1``; its per-record squared norms are ``("n2", r0)``.
    """
    from gradforensics.analysis.engine.gramkernel import head_blocks

    out: Partial = {}
    L = d.band
    before = dict(head_blocks(prev, head0, split)) if prev is not None and prev.shape[0] else {}
    units = []
    for h, xh in head_blocks(x, head0, split):
        xf, nf = finite_rows(np.asarray(xh, dtype=np.float32))
        pv = before.get(h)
        pvf, pnf = finite_rows(np.asarray(pv, dtype=np.float32)) if pv is not None else (xf[:0], nf[:0])
        units.append((h, xf, nf, pvf, pnf))
        if nf.any():
            out[("nf", h, r0)] = nf
        y = window_sums(xf, r0, d)
        out[("g", h) if close else ("y", h)] = y @ y.T if close else y
    n = x.shape[0]
    norms = np.zeros(n)
    last: dict[int, float] = {}
    for s0 in range(0, n, SUB_RECORDS):
        s1 = min(n, s0 + SUB_RECORDS)
        blocks = []
        for h, xf, nf, pvf, pnf in units:
            blk = band_block(xf, nf, pvf, pnf, s0, s1, L, last.get(h))
            last[h] = float(blk.band[0, -1])
            if split:
                _emit(out, h, r0 + s0, blk, d, complete[0])
            blocks.append(blk)
        total = blocks[0] if len(blocks) == 1 else _sum_blocks(blocks)
        norms[s0:s1] = total.band[0]
        _emit(out, -1, r0 + s0, total, d, complete[1])
    out[("n2", r0)] = norms
    return out


def _sum_blocks(blocks: list[BandBlock]) -> BandBlock:
    """The whole tensor's block: its heads' blocks added in place, in head order."""
    band, nf, nf_prev = blocks[0].band.copy(), blocks[0].nf.copy(), blocks[0].nf_prev.copy()
    b0 = blocks[0].b0_prev
    for b in blocks[1:]:
        band += b.band
        nf += b.nf
        nf_prev += b.nf_prev
        b0 += b.b0_prev
    return BandBlock(band, nf, nf_prev, b0)


def _emit(out: Partial, h: int, r: int, blk: BandBlock, d: Design, complete: bool) -> None:
    if not complete:
        out[("bp", h, r)] = blk
        return
    m = block_moments(blk, r, d)
    out[("os", h)] = m if ("os", h) not in out else out[("os", h)] + m


def band_partials(parts: list[Partial], d: Design) -> Partial:
    """One record block's band blocks of every feature column, added per unit and reduced to moments."""
    from gradforensics.analysis.engine.gramkernel import combine_partials

    out: Partial = {}
    summed = combine_partials(parts)
    for (_, h, r), blk in sorted(summed.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        m = block_moments(blk, r, d)
        out[("os", h)] = m if ("os", h) not in out else out[("os", h)] + m
    return out


def only_bands(part: Partial) -> Partial:
    """A chunk's band blocks (units split between feature columns)."""
    return {k: v for k, v in part.items() if k[0] == "bp"}


def without_bands(part: Partial) -> Partial:
    """A chunk's result less its band blocks (they go to :func:`band_partials`)."""
    return {k: v for k, v in part.items() if k[0] != "bp"}


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
                   from_sketch: bool, d: Design) -> list[LongGram]:
    """Aggregate step: per unit its moments, its super-records' Gram and its non-finite records; whole tensor first."""
    heads = [] if n_heads is None else list(range(n_heads))
    empty = WindowMoments.zeros(oscillation_edges(d.n, d.band, d.edges).size - 1, d.band - 1)
    bad: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    norms = np.zeros(n)
    for key, val in part.items():
        if key[0] == "nf":
            idx = np.flatnonzero(val)
            prev = bad.get(key[1], (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            bad[key[1]] = (np.r_[prev[0], key[2] + idx], np.r_[prev[1], val[idx]])
        elif key[0] == "n2":
            norms[key[1]:key[1] + val.size] = val
    if heads:
        bad[-1] = (np.concatenate([bad[h][0] for h in heads if h in bad] + [np.zeros(0, np.int64)]),
                   np.concatenate([bad[h][1] for h in heads if h in bad] + [np.zeros(0, np.int64)]))
        sums = np.asarray(sum(np.asarray(part.get(("g", h), 0.0), dtype=np.float64) for h in heads), dtype=np.float64)
    else:
        sums = np.asarray(part.get(("g", -1), 0.0), dtype=np.float64)
    out = []
    for h in [-1, *heads]:
        idx, cnt = bad.get(h, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        rec, inv = np.unique(idx.astype(np.int64), return_inverse=True)
        counts = np.bincount(inv, weights=cnt, minlength=rec.size).astype(np.int64) if rec.size else rec
        s = sums if h == -1 else np.asarray(part.get(("g", h), 0.0), dtype=np.float64)
        finite = None
        if rec.size:
            finite = np.ones(n, dtype=bool)
            finite[rec] = False
        K, K_bad = d.super_gram(s, finite)
        out.append(LongGram(tensor, None if h == -1 else h, K, K_bad, part.get(("os", h), empty), int(n), rec, counts,
                            int(n_features if h == -1 else n_features // max(1, len(heads))), from_sketch,
                            norms if h == -1 else None))
    return out


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
    heads = info.split is not None
    name = f"longgram-{tokenize(handle, chunks, tensor, d.band, d.edges, d.mixture, reductions)}"
    layer, parts = _long_layer(name, handle, chunks, heads, d, reductions, split_every)
    top = reduction_tree(layer, name, parts, split_every, reductions)
    final = (name, "agg")
    layer[final] = (_aggregate_long_all, top, reductions, tensor, int(info.shape[0]),
                    int(info.shape[1]) if heads else None, int(np.prod(info.shape[1:], dtype=np.int64)),
                    from_sketch, d)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[])
    return Delayed(final, graph, layer=name)


def _long_layer(name: str, handle: Any, chunks: tuple[tuple[int, ...], ...], heads: bool, d: Design,
                reductions: tuple[Any, ...], split_every: int) -> tuple[dict[Any, Any], list[Any]]:
    """The read-and-reduce tasks of every record block and feature column, and the keys the tree combines.

    A unit split between feature columns (*complete* False for it) leaves its band blocks,
    which meet per record block in :func:`band_partials`; with a split record axis each
    feature column's blocks are combined and their sums closed (:func:`close_sums`) first.
    """
    from gradforensics.analysis.engine.gram import reduction_tree

    whole_features = all(len(c) == 1 for c in chunks[2 if heads else 1:])
    complete = (whole_features, whole_features and (not heads or len(chunks[1]) == 1))
    starts = [np.concatenate([[0], np.cumsum(c)]).astype(int) for c in chunks]
    layer: dict[Any, Any] = {}
    parts: list[Any] = []
    blocks = len(chunks[0])
    by_block: list[list[Any]] = [[] for _ in range(blocks)]
    for col in itertools.product(*[range(len(c)) for c in chunks[1:]]):
        fsel = tuple(slice(int(starts[ax + 1][i]), int(starts[ax + 1][i + 1])) for ax, i in enumerate(col))
        head0 = int(starts[1][col[0]]) if heads else 0
        col_parts = []
        for a in range(blocks):
            r0, r1 = int(starts[0][a]), int(starts[0][a + 1])
            key = (name, "chunk", len(parts), a)
            layer[key] = (_read_long, handle, r0, r1, fsel, head0, heads, d, blocks == 1, reductions, complete)
            if not all(complete):              # the band blocks leave by band_partials, the rest by the tree
                layer[(name, "bp", len(parts), a)] = (only_bands, key)
                layer[(name, "rest", len(parts), a)] = (without_bands, key)
                by_block[a].append((name, "bp", len(parts), a))
                key = (name, "rest", len(parts), a)
            col_parts.append(key)
        if blocks == 1:
            parts.append(col_parts[0])
            continue
        top = reduction_tree(layer, f"{name}-col{len(parts)}", col_parts, split_every, reductions)
        layer[(name, "close", len(parts))] = (close_sums, top)
        parts.append((name, "close", len(parts)))
    if not all(complete):                      # units split between feature columns: their bands meet per block
        for a, keys in enumerate(by_block):
            layer[(name, "bands", a)] = (band_partials, keys, d)
            parts.append((name, "bands", a))
    return layer, parts


def _read_long(handle: Any, r0: int, r1: int, fsel: tuple[slice, ...], head0: int, split: bool, d: Design,
               close: bool, reductions: tuple[Any, ...], complete: tuple[bool, bool]) -> Partial:
    """Read records ``r0:r1`` of one feature column (and the band before them) and reduce them in one task."""
    from gradforensics.analysis.engine.gramkernel import reduce_chunk

    sel = (slice(r0, r1), *fsel)
    x = handle[sel]
    prev = handle[(slice(max(0, r0 - d.band), r0), *fsel)] if r0 > 0 else None
    out = long_chunk(x, prev, r0, head0, split, d, close, complete)
    if reductions:
        out.update(reduce_chunk(x, sel, reductions))
    return out


def _aggregate_long_all(part: Partial, reductions: tuple[Any, ...], *args: Any) -> tuple[list[LongGram], list[Any]]:
    grams = aggregate_long({k: v for k, v in part.items() if k[0] != "r"}, *args)
    values = [part[("r", j)] if r.aggregate is None else r.aggregate(part[("r", j)])
              for j, r in enumerate(reductions)]
    return grams, values
