"""The steps of the Gram pass: chunk, combine, aggregate (:mod:`~gradforensics.analysis.engine.gram` builds the graph).

The pass is a dask reduction written as chunk / combine / aggregate over the
feature axis, as dask's own reductions are (``mean_chunk`` / ``mean_combine``
/ ``mean_agg``):

* **chunk** (:func:`chunk_partial`): one slab of the array (all records x a run
  of whole on-disk feature chunks, see ``Store.grad(..., slab_bytes=...)``)
  becomes a partial sum ``{("k", head, a, b): X_a X_bᵀ, ("nf", head, a): counts}``.
  Non-finite elements are zeroed before the product and counted per record.
  Products run in float32 over sub-blocks of ``SUB_BLOCK`` features and are
  accumulated in float64 (``precision="float64"`` makes the products float64
  too; a sub-block that overflows float32 is redone in float64).
* **combine** (:func:`combine_partials`): partial sums add, in a tree of fan-in
  ``split_every``.
* **aggregate** (:func:`aggregate_partial`): the blocks are assembled into K per
  head, the whole-tensor K of a head-split tensor is the sum of its head Ks (no
  extra read), and the rows/columns of records holding any non-finite value are
  zeroed (they are excluded from direction statistics and counted instead).

A split record axis pairs record blocks ``(a, b)``, ``a <= b``, one task per block
(:func:`row_partial`).  Analyses' slab reductions ride the same steps
(:func:`reduce_chunk`, :func:`aggregate_all`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gradforensics.analysis.contract.grams import GramResult, SlabReduction

__all__ = [
    "SUB_BLOCK",
    "Partial",
    "aggregate_all",
    "aggregate_partial",
    "chunk_partial",
    "combine_all",
    "combine_partials",
    "head_blocks",
    "reduce_chunk",
    "row_partial",
]

SUB_BLOCK = 4096
"""Features per float32 product inside a chunk; the products are summed in float64."""

Partial = dict[tuple[Any, ...], Any]


# ------------------------------------------------------------ slab reductions
def reduce_chunk(x: np.ndarray, sel: tuple[slice, ...], reductions: Sequence[SlabReduction]) -> Partial:
    return {("r", j): r.chunk(x, sel) for j, r in enumerate(reductions)}


def combine_all(parts: Sequence[Partial], reductions: Sequence[SlabReduction]) -> Partial:
    """Combine step with reductions: Gram keys add, each reduction's partials go through its ``combine``."""
    out = combine_partials([{k: v for k, v in p.items() if k[0] != "r"} for p in parts])
    for j, r in enumerate(reductions):
        vals = [p[("r", j)] for p in parts if ("r", j) in p]
        if vals:
            out[("r", j)] = r.combine(vals)
    return out


def aggregate_all(part: Partial, reductions: Sequence[SlabReduction], gram: bool,
                   *args: Any) -> tuple[list[GramResult] | None, list[Any]]:
    """Aggregate step with reductions: ``(Gram results or None, [aggregate of each reduction])``."""
    grams = aggregate_partial({k: v for k, v in part.items() if k[0] != "r"}, *args) if gram else None
    values = [part[("r", j)] if r.aggregate is None else r.aggregate(part[("r", j)])
              for j, r in enumerate(reductions)]
    return grams, values


# --------------------------------------------------------------------- kernel
def _finite_product(xa: np.ndarray, xb: np.ndarray | None, precision: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``xa @ xbᵀ`` (``xb`` None: ``xa @ xaᵀ``) in float64 with non-finite elements zeroed.

    Returns the product and, for ``xb is None``, the per-row count of
    non-finite elements of ``xa``.
    """
    na, f = xa.shape
    nb = na if xb is None else xb.shape[0]
    acc = np.zeros((na, nb), dtype=np.float64)
    counts = np.zeros(na, dtype=np.int64) if xb is None else None
    for s in range(0, f, SUB_BLOCK):
        pa = xa[:, s:s + SUB_BLOCK]
        pb = pa if xb is None else xb[:, s:s + SUB_BLOCK]
        if precision == "float64":
            prod = _product(pa.astype(np.float64), None if xb is None else pb.astype(np.float64))
        else:
            prod = _product(pa, None if xb is None else pb)
        if not np.isfinite(prod).all():
            prod, n_bad = _slow_product(pa, None if xb is None else pb)
            if counts is not None:
                counts += n_bad
        acc += prod
    return acc, counts


def _product(pa: np.ndarray, pb: np.ndarray | None) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return pa @ (pa if pb is None else pb).T


def _slow_product(pa: np.ndarray, pb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 product after zeroing non-finite elements; per-row counts of ``pa``'s."""
    fa = np.isfinite(pa)
    n_bad = pa.shape[1] - np.count_nonzero(fa, axis=1)
    a = np.where(fa, pa, 0).astype(np.float64)
    b = None if pb is None else np.where(np.isfinite(pb), pb, 0).astype(np.float64)
    return _product(a, b), n_bad.astype(np.int64)


def head_blocks(block: np.ndarray, head0: int, split: bool) -> Iterable[tuple[int, np.ndarray]]:
    """``(head, (n, features))`` views of one dask block; head -1 for a tensor not split."""
    if not split:
        yield -1, block.reshape(block.shape[0], -1)
        return
    for j in range(block.shape[1]):
        yield head0 + j, block[:, j].reshape(block.shape[0], -1)


def chunk_partial(xa: np.ndarray, xb: np.ndarray | None, a: int, b: int, head0: int, split: bool,
                  precision: str = "float32") -> Partial:
    """Chunk step: the partial Gram sums of one slab (record blocks *a*, *b*).

    ``xb`` is None on the diagonal (``a == b``); only diagonal partials carry
    non-finite counts, so each record block is counted once per slab.
    """
    out: Partial = {}
    heads_b = None if xb is None else dict(head_blocks(xb, head0, split))
    for h, xa2 in head_blocks(xa, head0, split):
        xb2 = None if heads_b is None else heads_b[h]
        prod, counts = _finite_product(np.asarray(xa2), None if xb2 is None else np.asarray(xb2), precision)
        out[("k", h, a, b)] = prod
        if counts is not None:
            out[("nf", h, a)] = counts
    return out


def combine_partials(parts: Sequence[Partial]) -> Partial:
    """Combine step: partial sums add key by key (inputs are not modified)."""
    out: Partial = {}
    for part in parts:
        for key, val in part.items():
            if key in out:
                out[key] = out[key] + val
            else:
                out[key] = val.copy()
    return out


def aggregate_partial(part: Partial, tensor: str, record_chunks: tuple[int, ...], n_heads: int | None,
                      n_features: int, from_sketch: bool) -> list[GramResult]:
    """Aggregate step: assemble K per head, add heads for the whole tensor, zero bad records.

    Returns the whole-tensor result first, then one per head (head-split tensors).
    """
    n = int(sum(record_chunks))
    offsets = np.concatenate([[0], np.cumsum(record_chunks)]).astype(int)
    heads = [-1] if n_heads is None else list(range(n_heads))
    raw: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for h in heads:
        k = np.zeros((n, n), dtype=np.float64)
        nf = np.zeros(n, dtype=np.int64)
        for key, val in part.items():
            if key[1] != h:
                continue
            if key[0] == "nf":
                nf[offsets[key[2]]:offsets[key[2] + 1]] += val
            else:
                _, _, a, b = key
                k[offsets[a]:offsets[a + 1], offsets[b]:offsets[b + 1]] += val
                if a != b:
                    k[offsets[b]:offsets[b + 1], offsets[a]:offsets[a + 1]] += val.T
        raw[h] = (0.5 * (k + k.T), nf)
    if n_heads is None:
        k, nf = raw[-1]
        return [_result(tensor, None, k, nf, n_features, from_sketch)]
    whole_k = sum((raw[h][0] for h in heads), np.zeros((n, n)))
    whole_nf = sum((raw[h][1] for h in heads), np.zeros(n, dtype=np.int64))
    per_head = n_features // n_heads
    out = [_result(tensor, None, whole_k, whole_nf, n_features, from_sketch)]
    out += [_result(tensor, h, raw[h][0], raw[h][1], per_head, from_sketch) for h in heads]
    return out


def _result(tensor: str, head: int | None, k: np.ndarray, nf: np.ndarray, n_features: int,
            from_sketch: bool) -> GramResult:
    bad = nf > 0
    if bad.any():
        k = k.copy()
        k[bad, :] = 0.0
        k[:, bad] = 0.0
    return GramResult(tensor=tensor, head=head, gram=k, nonfinite=nf, n_features=int(n_features),
                      from_sketch=from_sketch)


def row_partial(xa: np.ndarray, later: Sequence[np.ndarray], a: int, head0: int, split: bool,
                precision: str = "float32") -> Partial:
    """Chunk step of record block *a* against itself and every later block ``a + 1, ...`` (*later*).

    The pairs ``(a, b)``, ``b >= a``, of one slab in one task: each product is the
    :func:`chunk_partial` of that pair, and the
    tasks of a split record axis grow with its blocks, not with their pairs.
    """
    out = chunk_partial(xa, None, a, a, head0, split, precision)
    for j, xb in enumerate(later):
        out.update(chunk_partial(xa, xb, a, a + 1 + j, head0, split, precision))
    return out
