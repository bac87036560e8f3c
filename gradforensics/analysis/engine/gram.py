"""Per-tensor, per-head Gram matrices ``K = X Xᵀ`` in one streaming pass.

``X`` is the (N, d) matrix of the N flattened per-record gradients of one
tensor (or one head).  Every direction statistic of gradforensics (cosines,
drift, principal directions, per-source means, noise scale) is a function of
``K`` and the batch metadata, so the store is read once and ``K`` (N x N,
small) carries everything onwards.

The pass is a dask reduction written as chunk / combine / aggregate over the
feature axis (the steps: :mod:`~gradforensics.analysis.engine.gramkernel`).

When all records of one on-disk feature chunk exceed ``slab_bytes`` (many records) but
not the Gram matrices they feed, a task reads them whole (:func:`slab_chunks`).  Beyond
that the record axis is split in blocks, and the chunk step works on pairs of record
blocks ``(a, b)``, ``a <= b``: one task per block ``a`` computes its whole row of pairs
(:func:`row_partial`), so the tasks grow with the blocks (bytes / slab size), linearly in
N, not with their pairs.

Analyses fold their own per-slab gradient reductions into the same read
(:class:`SlabReduction`, :func:`slab_graph`): the task that reads a slab also
runs each reduction's ``chunk`` on it, and the partials ride the same combine
tree, so every gradient byte is read once per pass.

Where the store keeps only a sketch of a tensor (``sketch/<tensor>``, no
``grads/<tensor>``), K is computed the same way from the sketch; its inner
products are then unbiased estimates (``GramResult.from_sketch``).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import GramResult, SlabReduction
from gradforensics.analysis.engine.gramkernel import (
    Partial,
    aggregate_all,
    aggregate_partial,
    chunk_partial,
    combine_all,
    combine_partials,
    reduce_chunk,
    row_partial,
)
from gradforensics.errors import MissingArrayError, SpecError
from gradforensics.store.layout import MiB

if TYPE_CHECKING:
    import dask.array as da
    from dask.delayed import Delayed

    from gradforensics.store.backends import ArrayHandle
    from gradforensics.store.reader import Store

__all__ = ["DEFAULT_SLAB_BYTES", "DEFAULT_SPLIT_EVERY", "PRECISIONS", "flatten_grams", "gram_graph", "gram_graphs",
           "gram_of_array", "gram_of_handle", "gram_sources", "reduction_tree", "slab_chunks", "slab_graph",
           "slab_outputs"]


DEFAULT_SLAB_BYTES = 128 * MiB
DEFAULT_SPLIT_EVERY = 8
PRECISIONS = ("float32", "float64")

# ---------------------------------------------------------------------- graph
def gram_of_array(x: da.Array, tensor: str, *, heads: bool = False, from_sketch: bool = False,
                  split_every: int = DEFAULT_SPLIT_EVERY, precision: str = "float32") -> Delayed:
    """Lazy Gram matrices of a dask array ``x`` of shape (N, ...) or (N, H, ...).

    Parameters
    ----------
    x
        Per-record arrays, record axis first.  With ``heads=True`` axis 1 is the
        head axis; the result then holds the whole tensor and every head.
    tensor
        Name carried into each :class:`GramResult`.
    split_every
        Fan-in of the combine tree (>= 2).
    precision
        ``"float32"``: products over sub-blocks of ``SUB_BLOCK`` features in
        float32, summed in float64 (default; about twice as fast);
        ``"float64"``: products in float64 as well.

    Returns
    -------
    dask.delayed.Delayed
        Computes to ``list[GramResult]``: the whole tensor first, then each head.
    """
    return _gram_graph(x.shape, x.chunks, tensor, heads, from_sketch, split_every, precision, dep=x)


def gram_of_handle(handle: ArrayHandle, chunks: tuple[tuple[int, ...], ...], tensor: str, **kwargs: Any) -> Delayed:
    """As :func:`gram_of_array`, reading a stored array through *handle* inside each task.

    Where a slab spans all records (the usual case) the read and the chunk step
    are one task, so a slab never outlives its product and never crosses
    between worker processes; with a split record axis, blocks are read once
    into their own tasks and paired.
    """
    return _gram_graph(handle.shape, chunks, tensor, kwargs.pop("heads", False), kwargs.pop("from_sketch", False),
                       kwargs.pop("split_every", DEFAULT_SPLIT_EVERY), kwargs.pop("precision", "float32"),
                       handle=handle, reductions=tuple(kwargs.pop("reductions", ())), gram=kwargs.pop("gram", True),
                       outputs=kwargs.pop("outputs", False))


def _gram_graph(shape: tuple[int, ...], chunks: tuple[tuple[int, ...], ...], tensor: str, heads: bool,
                from_sketch: bool, split_every: int, precision: str, dep: Any = None,
                handle: ArrayHandle | None = None, reductions: tuple[SlabReduction, ...] = (),
                gram: bool = True, outputs: bool = False) -> Delayed:
    from dask.base import tokenize
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    if split_every < 2:
        raise SpecError(f"split_every must be >= 2; got {split_every}.")
    if precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {PRECISIONS}; got {precision!r}.")
    if heads and len(shape) < 2:
        raise SpecError(f"{tensor}: a head-split array needs a head axis; got shape {shape}.")
    # the handle by what it reads; reductions (closures over stores, arrays) by a fresh token: tokenizing
    # them cost milliseconds a tensor, and no two slab passes of one compute may share a name anyway
    source: Any = dep.name if dep is not None else None
    if handle is not None:
        source = (handle.location.path, handle.location.kind, handle.name, handle.shape, handle.encoding,
                  handle.chunks)
    if not gram and not reductions:
        raise SpecError(f"{tensor}: a slab pass needs the Gram matrix or at least one slab reduction.")
    once = uuid.uuid4().hex if reductions else None
    name = f"gram-{tokenize(source, chunks, tensor, heads, from_sketch, split_every, precision, gram, once)}"
    layer, parts = _chunk_layer(name, chunks, heads, precision, xname=None if dep is None else dep.name,
                                handle=handle, reductions=reductions, gram=gram)
    top = reduction_tree(layer, name, parts, split_every, reductions)
    n_heads = int(shape[1]) if heads else None
    n_features = int(np.prod(shape[1:], dtype=np.int64))
    final = (name, "agg")
    args = (tensor, tuple(int(c) for c in chunks[0]), n_heads, n_features, from_sketch)
    if reductions or not gram:
        layer[final] = (aggregate_all, top, reductions, gram, *args)
    else:
        layer[final] = (aggregate_partial, top, *args)
    if outputs:         # one key per output: no Delayed indexing (a tokenized task each) afterwards
        layer[(name, "out", "gram")] = (_pick, final, 0, None)
        for j in range(len(reductions)):
            layer[(name, "out", j)] = (_pick, final, 1, j)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[] if dep is None else [dep])
    return Delayed(final, graph, layer=name)


def _pick(value: Any, i: int, j: int | None) -> Any:
    return value[i] if j is None else value[i][j]


def _read(handle: ArrayHandle, sel: tuple[slice, ...]) -> np.ndarray:
    return handle[sel]


def _read_chunk(handle: ArrayHandle, sel: tuple[slice, ...], head0: int, split: bool, precision: str,
                reductions: Sequence[SlabReduction] = (), gram: bool = True) -> Partial:
    """Read one slab of all records and reduce it at once (read, Gram chunk step and slab reductions fused)."""
    x = handle[sel]
    out = chunk_partial(x, None, 0, 0, head0, split, precision) if gram else {}
    if reductions:
        out.update(reduce_chunk(x, sel, reductions))
    return out


def _chunk_layer(name: str, chunks: tuple[tuple[int, ...], ...], heads: bool, precision: str,
                 xname: str | None, handle: ArrayHandle | None, reductions: tuple[SlabReduction, ...] = (),
                 gram: bool = True) -> tuple[dict[Any, Any], list[Any]]:
    starts = [np.concatenate([[0], np.cumsum(c)]).astype(int) for c in chunks]

    def sel(idx: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(int(starts[ax][i]), int(starts[ax][i + 1])) for ax, i in enumerate(idx))

    layer: dict[Any, Any] = {}
    parts: list[Any] = []
    n_rec_blocks = len(chunks[0])
    for col in itertools.product(*[range(len(c)) for c in chunks[1:]]):
        head0 = int(starts[1][col[0]]) if heads else 0
        if handle is not None and n_rec_blocks == 1:
            key = (name, "chunk", len(parts))
            layer[key] = (_read_chunk, handle, sel((0, *col)), head0, heads, precision, reductions, gram)
            parts.append(key)
            continue
        refs = []
        for a in range(n_rec_blocks):
            if handle is None:
                refs.append((xname, a, *col))
            else:
                refs.append((name, "read", a, *col))
                layer[refs[-1]] = (_read, handle, sel((a, *col)))
        if reductions:      # each record block once
            for a in range(n_rec_blocks):
                key = (name, "chunk", len(parts))
                layer[key] = (reduce_chunk, refs[a], sel((a, *col)), reductions)
                parts.append(key)
        for a in range(n_rec_blocks if gram else 0):    # one task per row of pairs (a, b >= a): tasks linear in N
            key = (name, "chunk", len(parts))
            layer[key] = (row_partial, refs[a], list(refs[a + 1:]), a, head0, heads, precision)
            parts.append(key)
    return layer, parts


def reduction_tree(layer: dict[Any, Any], name: str, parts: list[Any], split_every: int,
          reductions: tuple[SlabReduction, ...] = ()) -> Any:
    """Add combine tasks of fan-in *split_every* until one key remains; return it."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for i in range(0, len(parts), split_every):
            key = (name, "combine", level, i // split_every)
            group = list(parts[i:i + split_every])
            layer[key] = (combine_all, group, reductions) if reductions else (combine_partials, group)
            nxt.append(key)
        parts = nxt
        level += 1
    if not parts:
        raise SpecError(f"{name}: the array has no chunks to reduce.")
    return parts[0]


# ------------------------------------------------------------------ the store
def slab_chunks(store: Store, name: str, slab_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Dask chunks of the Gram pass over stored array *name*: all records x about *slab_bytes* of features.

    Where all records of one on-disk chunk's features fit in *slab_bytes*, these are
    the reader's slabs (whole on-disk feature chunks, grown to *slab_bytes*:
    ``Store.lazy``).  Where they do not (many records) but are no larger than the Gram
    matrices they feed (N x N float64 for each head of the chunk, which the exact
    regime holds anyway), one task reads all records of one on-disk chunk's features:
    the record axis stays whole.  Only beyond that is the record axis split in blocks
    of whole on-disk chunks (the reader's choice); the graph then pairs the blocks one
    task per block (:func:`row_partial`), not one per pair.
    """
    chunks = store.chunks(name, slab_bytes)
    info = store.arrays[name]
    shape, disk = [int(s) for s in info.shape], [int(c) for c in info.chunks]
    n = max(shape[0], 1)
    whole = 4 * n * int(np.prod(disk[1:], dtype=np.int64)) <= 8 * n * n * (disk[1] if info.split else 1)
    if len(chunks[0]) == 1 or len(shape) < 2 or not whole:
        return tuple(tuple(int(c) for c in ax) for ax in chunks)
    # all records of one on-disk chunk's features are no larger than the K they give: whole chunks, one task each
    return ((shape[0],), *[_pieces(shape[j], disk[j], disk[j]) for j in range(1, len(shape))])


def _pieces(size: int, chunk: int, most: int) -> tuple[int, ...]:
    """Chunk sizes along an axis of *size* stored in chunks of *chunk*: each on-disk chunk cut into
    balanced pieces of at most *most* (a piece never straddles two on-disk chunks)."""
    out: list[int] = []
    for start in range(0, size, chunk):
        extent = min(chunk, size - start)
        n = -(-extent // max(1, min(most, extent)))
        out += [extent // n + (1 if i < extent % n else 0) for i in range(n)]
    return tuple(out)


def gram_sources(store: Store) -> dict[str, str]:
    """Which stored array each tensor's K is computed from: ``grads/<t>`` or, failing that, ``sketch/<t>``."""
    return {t: (f"grads/{t}" if t in store.grads else f"sketch/{t}") for t in store.tensors}


def gram_graph(store: Store, tensor: str, *, slab_bytes: int = DEFAULT_SLAB_BYTES,
               split_every: int = DEFAULT_SPLIT_EVERY, precision: str = "float32") -> Delayed:
    """Lazy Gram matrices of one stored tensor (whole, and per head where split).

    Reads ``grads/<tensor>`` in slabs of about *slab_bytes* (all records x whole
    on-disk feature chunks, or parts of them: :func:`slab_chunks`), or
    ``sketch/<tensor>`` where no full gradient is stored.
    """
    if tensor in store.grads:
        info, from_sketch = store.grads[tensor], False
    elif tensor in store.sketches:
        info, from_sketch = store.sketches[tensor], True
    else:
        raise MissingArrayError(f"{store.path}: no grads/{tensor} or sketch/{tensor} in the store; "
                                f"tensors are {store.tensors[:5]}{'...' if len(store.tensors) > 5 else ''}.")
    chunks = slab_chunks(store, info.name, slab_bytes)      # all records x a feature range of ~slab_bytes
    return gram_of_handle(store.handle(info), chunks, tensor, heads=info.split is not None,
                          from_sketch=from_sketch, split_every=split_every, precision=precision)


def slab_graph(store: Store, tensor: str, reductions: Sequence[SlabReduction], *, gram: bool = True,
               slab_bytes: int = DEFAULT_SLAB_BYTES, split_every: int = DEFAULT_SPLIT_EVERY,
               precision: str = "float32", outputs: bool = False) -> Delayed:
    """One read of ``grads/<tensor>`` feeding its Gram matrices and the given slab reductions.

    Computes to ``(list[GramResult] | None, [aggregate of each reduction])``; the
    Gram part is None with ``gram=False``.  Each slab is read once, in the task
    that also runs every reduction's ``chunk`` on it.
    """
    bad = [r.tensor for r in reductions if r.tensor != tensor]
    if bad or (reductions and tensor not in store.grads):
        raise SpecError(f"{store.path}: slab reductions of grads/{tensor} must name that stored gradient; "
                        f"got {sorted(set(bad)) or [tensor]}.")
    if not reductions:
        raise SpecError(f"{store.path}: slab_graph of {tensor} needs at least one slab reduction.")
    info = store.grads[tensor]
    chunks = slab_chunks(store, info.name, slab_bytes)
    return gram_of_handle(store.handle(info), chunks, tensor, heads=info.split is not None, from_sketch=False,
                          split_every=split_every, precision=precision, reductions=tuple(reductions), gram=gram,
                          outputs=outputs)


def slab_outputs(store: Store, tensor: str, reductions: Sequence[SlabReduction], *, gram: bool = True,
                 **kwargs: Any) -> tuple[Delayed | None, list[Delayed]]:
    """:func:`slab_graph` split into its outputs: ``(Gram results or None, [each reduction's aggregate])``.

    The same graph and values as ``slab_graph(...)[0]`` and ``slab_graph(...)[1][j]``,
    without a task (and a tokenization) per indexing: what the engine uses.
    """
    from dask.delayed import Delayed

    whole = slab_graph(store, tensor, reductions, gram=gram, outputs=True, **kwargs)
    name = whole.key[0]
    g = Delayed((name, "out", "gram"), whole.dask, layer=name) if gram else None
    return g, [Delayed((name, "out", j), whole.dask, layer=name) for j in range(len(reductions))]


def gram_graphs(store: Store, tensors: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Delayed]:
    """:func:`gram_graph` of every tensor (default: all tensors with gradients or sketches)."""
    return {t: gram_graph(store, t, **kwargs) for t in (store.tensors if tensors is None else tensors)}


def flatten_grams(results: dict[str, list[GramResult]]) -> dict[tuple[str, int | None], GramResult]:
    """``{tensor: [whole, head0, ...]}`` -> ``{(tensor, head): GramResult}`` (the ``Context.grams`` shape)."""
    return {(g.tensor, g.head): g for res in results.values() for g in res}
