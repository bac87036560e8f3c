"""Per-tensor, per-head Gram matrices ``K = X Xᵀ`` in one streaming pass.

``X`` is the (N, d) matrix of the N flattened per-record gradients of one
tensor (or one head).  Every direction statistic of gradforensics (cosines,
drift, principal directions, per-source means, noise scale) is a function of
``K`` and the batch metadata, so the store is read once and ``K`` (N x N,
small) carries everything onwards.

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import GramResult, SlabReduction
from gradforensics.errors import MissingArrayError, SpecError
from gradforensics.store.layout import MiB

if TYPE_CHECKING:
    import dask.array as da
    from dask.delayed import Delayed

    from gradforensics.store.backends import ArrayHandle
    from gradforensics.store.reader import Store

__all__ = [
    "DEFAULT_SLAB_BYTES",
    "DEFAULT_SPLIT_EVERY",
    "PRECISIONS",
    "SUB_BLOCK",
    "Partial",
    "aggregate_all",
    "aggregate_partial",
    "chunk_partial",
    "combine_partials",
    "flatten_grams",
    "gram_graph",
    "gram_graphs",
    "gram_of_array",
    "gram_of_handle",
    "gram_sources",
    "head_blocks",
    "reduce_chunk",
    "reduction_tree",
    "row_partial",
    "slab_chunks",
    "slab_graph",
    "slab_outputs",
]


SUB_BLOCK = 4096
"""Features per float32 product inside a chunk; the products are summed in float64."""

DEFAULT_SLAB_BYTES = 128 * MiB
DEFAULT_SPLIT_EVERY = 8
PRECISIONS = ("float32", "float64")

Partial = dict[tuple[Any, ...], Any]


# ------------------------------------------------------------ slab reductions
def reduce_chunk(x: np.ndarray, sel: tuple[slice, ...], reductions: Sequence[SlabReduction]) -> Partial:
    return {("r", j): r.chunk(x, sel) for j, r in enumerate(reductions)}


def _combine_all(parts: Sequence[Partial], reductions: Sequence[SlabReduction]) -> Partial:
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


def row_partial(xa: np.ndarray, later: Sequence[np.ndarray], a: int, head0: int, split: bool,
                precision: str = "float32") -> Partial:
    """Chunk step of record block *a* against itself and every later block ``a + 1, ...`` (*later*).

    The pairs ``(a, b)``, ``b >= a``, of one slab in one task: each product is the
    :func:`chunk_partial` of that pair (the same numbers as one task a pair), and the
    tasks of a split record axis grow with its blocks, not with their pairs.
    """
    out = chunk_partial(xa, None, a, a, head0, split, precision)
    for j, xb in enumerate(later):
        out.update(chunk_partial(xa, xb, a, a + 1 + j, head0, split, precision))
    return out


def reduction_tree(layer: dict[Any, Any], name: str, parts: list[Any], split_every: int,
          reductions: tuple[SlabReduction, ...] = ()) -> Any:
    """Add combine tasks of fan-in *split_every* until one key remains; return it."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for i in range(0, len(parts), split_every):
            key = (name, "combine", level, i // split_every)
            group = list(parts[i:i + split_every])
            layer[key] = (_combine_all, group, reductions) if reductions else (combine_partials, group)
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
    whole = 4 * n * int(np.prod(disk[1:], dtype=np.int64)) <= 8 * n * n * (disk[1] if info.heads else 1)
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
    return gram_of_handle(store.handle(info), chunks, tensor, heads=info.heads is not None,
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
    return gram_of_handle(store.handle(info), chunks, tensor, heads=info.heads is not None, from_sketch=False,
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
