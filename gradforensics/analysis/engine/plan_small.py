"""The Gram pass of small tensors: many one-slab tensors read and reduced in one task.

A tensor whose slab pass is one read (all records x all features fit one slab, on one
on-disk chunk column: :func:`~gradforensics.analysis.engine.gram.slab_chunks` gives a
single block per axis) costs the pass a read task, an aggregate task and one task per
output - five tasks for a tensor with two slab reductions - and each read is a round
trip through zarr's event loop.  A store of 2,000 tensors of 32 floats spent about
12 CPU-s on that for a few megabytes.

Here such tensors are grouped (up to :data:`GROUP_BYTES` of stored floats and
:data:`GROUP_TENSORS` tensors a group) and each group is **one task**: it reads all
its tensors with one call into zarr's event loop
(:func:`~gradforensics.store.backends.read_handles`), then runs, per tensor, the steps
of the one-tensor graph - :func:`~gradforensics.analysis.engine.gramkernel.chunk_partial`
and each reduction's ``chunk`` on the slab, then
:func:`~gradforensics.analysis.engine.gramkernel.aggregate_partial` or
:func:`~gradforensics.analysis.engine.gramkernel.aggregate_all` on that one partial (a
one-slab pass has no combine step).  The task's value is the flat list of the tensors'
outputs, in the order :func:`fused_outputs` names them.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import SlabReduction
from gradforensics.analysis.engine.gram import DEFAULT_SLAB_BYTES, PRECISIONS, slab_chunks
from gradforensics.analysis.engine.gramkernel import aggregate_all, aggregate_partial, chunk_partial, reduce_chunk
from gradforensics.analysis.engine.spill import write_spilled
from gradforensics.errors import SpecError
from gradforensics.store.backends import ArrayHandle, read_handles
from gradforensics.store.layout import MiB

if TYPE_CHECKING:
    from dask.delayed import Delayed

    from gradforensics.store.reader import Store

__all__ = ["GROUP_BYTES", "GROUP_TENSORS", "OneSlab", "fused_output", "fused_outputs", "fused_slabs", "one_slab"]

#: Stored floats one fused task reads at most (bytes, float32 as read).
GROUP_BYTES = 8 * MiB
#: Tensors one fused task reads at most (keeps several tasks for the threads on a small store).
GROUP_TENSORS = 128


@dataclass(frozen=True)
class OneSlab:
    """One tensor whose slab pass is a single read: what the fused task does with it."""

    tensor: str
    handle: ArrayHandle
    sel: tuple[slice, ...]
    heads: bool
    reductions: tuple[SlabReduction, ...]
    gram: bool
    #: ``(tensor, record_chunks, n_heads, n_features, from_sketch)`` of its aggregate step
    args: tuple[Any, ...]
    #: ``(directory, slot)``: its Gram results written there by the task (a spilled pass, local scheduler)
    spill: tuple[str, int] | None = None

    @property
    def n_outputs(self) -> int:
        """Values this tensor contributes: its Gram results (if *gram*), then each reduction's."""
        return int(self.gram) + len(self.reductions)


def one_slab(store: Store, tensor: str, reductions: Sequence[SlabReduction], gram: bool,
             slab_bytes: int = DEFAULT_SLAB_BYTES, spill: tuple[str, int] | None = None) -> OneSlab | None:
    """*tensor*'s pass as one read, or None where it takes more (several slabs, a split record axis).

    With *spill* ``(directory, slot)`` its Gram results are written to the spill directory by the
    fused task, as :meth:`~gradforensics.analysis.engine.spill.GramSpill.wrap`'s task writes a
    one-tensor graph's (the same files, named by the same *slot*).
    """
    if tensor in store.grads:
        info, from_sketch = store.grads[tensor], False
    elif tensor in store.sketches and not reductions:
        info, from_sketch = store.sketches[tensor], True
    else:
        return None
    if 4 * int(np.prod(info.shape, dtype=np.int64)) > min(slab_bytes, GROUP_BYTES):
        return None
    chunks = slab_chunks(store, info.name, slab_bytes)
    if any(len(c) != 1 for c in chunks):
        return None
    sel = tuple(slice(0, int(c[0])) for c in chunks)
    heads = info.split is not None
    if heads and len(info.shape) < 2:
        return None            # the one-tensor graph says what is wrong
    args = (tensor, (int(chunks[0][0]),), int(info.shape[1]) if heads else None,
            int(np.prod(info.shape[1:], dtype=np.int64)), from_sketch)
    return OneSlab(tensor, store.handle(info), sel, heads, tuple(reductions), gram, args, spill if gram else None)


def fused_slabs(items: Sequence[OneSlab], precision: str = "float32") -> list[Any]:
    """Read every tensor of *items* (one zarr call) and reduce each as its one-tensor graph does.

    Returns the outputs of all items, flat: per item its Gram results (if ``gram``), then
    each reduction's aggregate.
    """
    xs = read_handles([it.handle for it in items], [it.sel for it in items])
    out: list[Any] = []
    for it, x in zip(items, xs, strict=True):
        part = chunk_partial(x, None, 0, 0, 0, it.heads, precision) if it.gram else {}
        if it.reductions:
            part.update(reduce_chunk(x, it.sel, it.reductions))
            grams, values = aggregate_all(part, it.reductions, it.gram, *it.args)
            out.extend(([_spilled(grams, it.spill)] if it.gram else []) + values)
        else:
            out.append(_spilled(aggregate_partial(part, *it.args), it.spill))
    return out


def _spilled(grams: Any, spill: tuple[str, int] | None) -> Any:
    """One tensor's Gram results, or what stands in for them once written to the spill directory."""
    return grams if spill is None else write_spilled(spill[0], spill[1], grams)


def fused_outputs(items: Sequence[OneSlab], precision: str = "float32") -> list[tuple[Delayed, list[OneSlab]]]:
    """The fused tasks of *items*: ``[(delayed flat list of outputs, the items it covers)]``.

    Items are grouped in the order given, :data:`GROUP_TENSORS` and :data:`GROUP_BYTES` a group.
    """
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    if precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {PRECISIONS}; got {precision!r}.")
    out: list[tuple[Delayed, list[OneSlab]]] = []
    group: list[OneSlab] = []
    size = 0
    for it in [*items, None]:
        nbytes = 0 if it is None else 4 * int(np.prod(it.handle.shape, dtype=np.int64))
        if group and (it is None or len(group) >= GROUP_TENSORS or size + nbytes > GROUP_BYTES):
            # a fresh name (reductions are closures: tokenizing them costs more than the task), and the
            # items inside a partial: dask does not walk 128 handles looking for keys
            key = f"fused-slabs-{uuid.uuid4().hex}"
            graph = HighLevelGraph.from_collections(key, {key: (partial(fused_slabs, group, precision),)})
            out.append((Delayed(key, graph, layer=key), group))
            group, size = [], 0
        if it is not None:
            group.append(it)
            size += nbytes
    return out


def fused_output(fused: Delayed, i: int) -> Delayed:
    """Output *i* of a fused task (:func:`fused_outputs`) as a collection of its own: what a slab
    reduction's ``finish`` builds on (one small task, no ``Delayed`` indexing's tokenizing)."""
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    key = f"{fused.key}-out-{i}"
    layer: dict[Any, Any] = {key: (operator.getitem, fused.key, i)}
    deps: list[Any] = [fused]
    graph = HighLevelGraph.from_collections(key, layer, dependencies=deps)
    return Delayed(key, graph, layer=key)
