"""Chunk layout of a store, chosen once from the first record's shapes.

The rules (measured in ``benchmarks/store_layout.py``, written up in
``docs/store-layout.md``):

* All per-record arrays are flushed together every ``R`` records
  (``records_per_chunk``): the writer buffers ``R`` records and writes each
  chunk whole, so no append ever rewrites a chunk it wrote before.
  ``R`` is the largest power of two with ``R x record_bytes <= buffer_bytes``,
  between 1 and 64; when the number of records is known in advance, lowered so that
  the records fill their chunks evenly (an edge chunk is stored whole: no padding).
* A chunk of a large array holds ``R`` records of a slab of rows of the tensor
  (head by head for a head-split tensor), about ``chunk_bytes`` in all, so a
  reader can take all records of a slab of features - the shape the Gram pass
  wants - without reading anything else.
* Small arrays (metadata, sketches, activation statistics) take several
  flushes per chunk, up to ``small_chunk_bytes``; rewriting such a chunk costs
  at most that much per flush.  When the records the array will hold are known
  (``records``: the capture's ``expected_records``, or the records of a capture
  that closes before its first flush) its chunk holds no more flushes than they
  fill: 32 records of 32 floats are one chunk of 32 records, not of 4,096 (a
  reader decodes a whole chunk, so 4,096 would cost 128x the bytes of the data).
* Every chunk carries a checksum (``checksums``): a damaged chunk fails to
  decode, naming its array and records, instead of reading back as gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LayoutPolicy", "MiB", "chunk_shape", "dimension_names", "records_per_chunk"]


MiB = 1 << 20


@dataclass(frozen=True)
class LayoutPolicy:
    chunk_bytes: int = 8 * MiB
    buffer_bytes: int = 256 * MiB
    small_chunk_bytes: int = 1 * MiB
    max_records_per_chunk: int = 64
    #: CRC-32C (Zarr) / Fletcher-32 (HDF5) on every chunk: damage is an error, never data.
    checksums: bool = True


def _pow2_floor(x: float) -> int:
    return 1 if x < 2 else 1 << int(np.floor(np.log2(x)))


def records_per_chunk(record_bytes: int, policy: LayoutPolicy, expected: int | None = None) -> int:
    """Records buffered per flush: a power of two in [1, max_records_per_chunk].

    With *expected* (the records the writer will get, when the caller knows it: a
    replay of N batches, a what-if of K steps), the records are spread evenly over as
    many chunks as that power of two needs, so the last chunk is not mostly padding:
    both formats store an edge chunk at its full size, and 24 records in chunks of 64
    took 2.7x the bytes of their data.
    """
    r = int(min(max(_pow2_floor(policy.buffer_bytes / max(record_bytes, 1)), 1), policy.max_records_per_chunk))
    if expected is not None and expected >= 1:
        r = -(-expected // -(-expected // r))          # ceil(n / ceil(n / r)) <= r: the least padding
    return r


def chunk_shape(row_shape: tuple[int, ...], itemsize: int, r: int, policy: LayoutPolicy,
                head_split: bool = False, records: int | None = None) -> tuple[int, ...]:
    """On-disk chunk of an array whose rows (one per record) have *row_shape*.

    *records*, when known, is how many records the array will hold: a small array's
    chunk then spans no more flushes of *r* records than those records fill.

    For a head-split array (rows ``(H, ...)``) a chunk holds whole heads - as many
    as fit in ``chunk_bytes`` with its ``R`` records, balanced so the chunks are
    alike - or, for a head larger than that, a slab of one head's rows.  Chunks are
    sized by bytes, not by heads: 4,096 heads of 64 KiB are 32 chunks of 8 MiB, not
    4,096 files.  (Stores written before this held one head a chunk; readers take
    any chunking.)
    """
    row_shape = tuple(int(s) for s in row_shape)
    inner = list(row_shape)
    if head_split and inner:
        inner[0] = 1
    inner_bytes = int(np.prod(inner, dtype=np.int64)) * itemsize
    if r * inner_bytes <= policy.small_chunk_bytes and not head_split:
        # Small array: several flushes per chunk.
        m = _pow2_floor(policy.small_chunk_bytes / max(r * inner_bytes, 1))
        m = min(m, max(1, 4096 // r))
        if records is not None and records >= 1:
            m = min(m, -(-int(records) // r))       # no flush a chunk the records will not fill
        return (r * m, *row_shape)
    if head_split and inner and r * inner_bytes <= policy.chunk_bytes:
        inner[0] = _balanced(row_shape[0], max(1, policy.chunk_bytes // max(r * inner_bytes, 1)))
    elif r * inner_bytes > policy.chunk_bytes:
        ax = 1 if head_split else 0
        if ax < len(inner):
            per_row = r * inner_bytes // inner[ax]
            rows = int(max(1, min(inner[ax], policy.chunk_bytes // max(per_row, 1))))
            inner[ax] = _balanced(inner[ax], rows)
    return (r, *inner)


def _balanced(size: int, most: int) -> int:
    """Chunk length along an axis of *size*: at most *most*, the chunks as equal as can be (least edge padding)."""
    most = int(max(1, min(size, most)))
    n_chunks = -(-size // most)
    return -(-size // n_chunks)


# Axis names of the stored arrays (Zarr v3 ``dimension_names``; see docs/store-schema.md).
#: groups whose arrays have one row per record (axis 0 is the shared ``record`` dimension)
_PER_RECORD = ("batches", "grads", "sketch", "acts", "attn", "logits", "optim_live", "router")


def dimension_names(name: str, ndim: int, attrs: dict[str, object] | None = None) -> tuple[str, ...]:
    """The names of the *ndim* axes of array *name* of a store, as xarray will see them.

    ``record`` first (shared by every per-record array, so ``xarray.open_zarr(store,
    group="grads")`` aligns them), ``snapshot`` first for ``weights/``; ``source``
    on ``batches/mixture``; ``<key>.head`` on the head axis of a head-split array,
    ``<key>.expert`` on the expert axis of an experts unit (attribute ``experts``);
    every other axis ``<key>.ax<i>`` - qualified by the array's key so that two
    tensors of different shapes never give one dimension two sizes.
    """
    group, _, key = name.partition("/")
    key = (key or name).replace("/", ".")
    names: list[str] = []
    if group in _PER_RECORD:
        names.append("record")
    elif group == "weights":
        names.append("snapshot")
    if name == "batches/mixture" and ndim == 2:
        names.append("source")
    if (attrs or {}).get("heads") and len(names) == 1 and ndim > 1:
        names.append(f"{key}.head")
    elif (attrs or {}).get("experts") and len(names) == 1 and ndim > 1:
        names.append(f"{key}.expert")
    names += [f"{key}.ax{i}" for i in range(len(names), ndim)]
    return tuple(names[:ndim])
