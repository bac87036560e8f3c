"""Opening a local store's Zarr arrays for reading, without parsing the same metadata twice.

Every read task of the Gram pass reads one slab of one array and opened it with
``zarr.open_array``: a round trip through zarr's event loop, the metadata file read
and parsed, its codec pipeline built - about 2 ms, more than reading a small
tensor's chunk, so a store of 2,000 small tensors paid 4 s a pass for it.  The
arrays of a store share their metadata but for their attributes and dimension names
(which no read uses): :func:`open_zarr_array` reads the array's ``zarr.json`` from
disk **every time** (tens of microseconds), parses each distinct rest of it once
per process, and builds the array on that parsed metadata and one read-only
``LocalStore`` per store (0.04 ms).

Why that cannot serve stale data: nothing is kept but parsed metadata, keyed by
its own content.  The ``zarr.json`` read now decides the shape, data type, chunk
grid, fill value and codecs of the array returned - the values a fresh
``zarr.open_array`` would parse from the same file now - and every read opens and
decodes the chunk files on disk (zarr keeps no chunk data).  A store written
again (``overwrite=True``, a capture that grew the array, another dtype or
chunking) is read as it is now.  Anything unusual (a metadata file that cannot be
read or parsed) goes to ``zarr.open_array`` itself, with its own errors.  Stores
at a URL are not handled here (their reads open by URL).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["MANY_BYTES", "MAX_PARSED", "clear", "open_zarr_array", "read_zarr_many"]

#: Distinct array metadata kept parsed per process (all dropped when full).
MAX_PARSED = 4096
#: A ``zarr.json`` longer than this goes to ``zarr.open_array`` (gradforensics writes a few hundred bytes).
_MAX_META = 1 << 20
#: Metadata entries no chunk read depends on.
_NOT_READ = ("attributes", "dimension_names")

_PARSED: dict[str, Any] = {}
_STORES: dict[str, Any] = {}
_LOCK = threading.Lock()


def _metadata(path: str, name: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, name, "zarr.json"), "rb") as f:
            raw = f.read(_MAX_META + 1)
        meta = json.loads(raw) if len(raw) <= _MAX_META else None
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
    return meta if ok else None


def open_zarr_array(path: str, name: str) -> Any:
    """``zarr.open_array(<path>/<name>, mode="r")``: the same array for every read, its metadata parsed once."""
    import zarr

    meta = _metadata(path, name)
    if meta is None:
        return zarr.open_array(os.path.join(path, name), mode="r")
    try:
        return _build(os.path.abspath(path), name, meta)
    except Exception:                     # zarr's own open says what is wrong, in its words
        return zarr.open_array(os.path.join(path, name), mode="r")


#: Decoded chunk bytes read at once by :func:`read_zarr_many` (zarr decodes a chunk whole, however
#: few of its records are written: 2,000 small tensors in chunks of 4,096 records, read all at once,
#: held 0.5 MiB a tensor).
MANY_BYTES = 8 << 20


def read_zarr_many(reads: Sequence[tuple[str, str, Any]]) -> list[np.ndarray]:
    """``open_zarr_array(path, name)[sel]`` of every ``(path, name, sel)``, in one call into zarr's event loop.

    Arrays whose chunk files :func:`~gradforensics.store.chunkread.read_direct` can read
    (the codec chains gradforensics writes, every chunk present and sound) are read
    there, in this thread, without zarr's loop; the others go to zarr.  Each of those is opened as :func:`open_zarr_array` opens it and read with its own basic
    selection (``AsyncArray.getitem``, what ``Array.__getitem__`` runs for slices); the
    reads run concurrently on zarr's loop, :data:`MANY_BYTES` of decoded chunks at a time,
    one thread hand-off for all of them.
    """
    from zarr.core.sync import sync

    from gradforensics.store.chunkread import read_direct

    done: list[np.ndarray | None] = []
    for path, name, sel in reads:          # the chunk files read here where they can be (chunkread)
        meta = _metadata(path, name)
        done.append(None if meta is None else read_direct(path, name, meta, sel))
    left = [i for i, x in enumerate(done) if x is None]
    if not left:
        return [x for x in done if x is not None]
    arrays = {i: open_zarr_array(reads[i][0], reads[i][1]) for i in left}
    batches: list[list[int]] = [[]]
    held = 0
    for i in left:
        a, sel = arrays[i], reads[i][2]
        nbytes = _chunk_bytes(a, sel)
        if batches[-1] and held + nbytes > MANY_BYTES:
            batches.append([])
            held = 0
        batches[-1].append(i)
        held += nbytes

    async def gather() -> list[Any]:
        out: list[Any] = []
        for batch in batches:
            out += await asyncio.gather(*(arrays[i].async_array.getitem(reads[i][2]) for i in batch))
        return out

    for i, x in zip(left, sync(gather()), strict=True):
        done[i] = np.asarray(x)
    return [x for x in done if x is not None]


def _chunk_bytes(a: Any, sel: Any) -> int:
    """Bytes of the on-disk chunks of array *a* under the slices *sel* (decoded)."""
    sel = sel if isinstance(sel, tuple) else (sel,)
    n = a.dtype.itemsize
    for ax, (size, c) in enumerate(zip(a.shape, a.chunks, strict=True)):
        s = sel[ax] if ax < len(sel) and isinstance(sel[ax], slice) else slice(None)
        start, stop, _ = s.indices(size)
        n *= c * max(1, -(-stop // c) - start // c)
    return int(n)


def _build(root: str, name: str, meta: dict[str, Any]) -> Any:
    from zarr.core.array import Array, AsyncArray
    from zarr.core.metadata.v3 import ArrayV3Metadata
    from zarr.storage import LocalStore, StorePath

    key = json.dumps({k: v for k, v in meta.items() if k not in _NOT_READ}, sort_keys=True)
    with _LOCK:
        parsed = _PARSED.get(key)
        store = _STORES.get(root)
    if parsed is None:
        parsed = ArrayV3Metadata.from_dict({k: v for k, v in meta.items() if k not in _NOT_READ})
    if store is None:
        store = LocalStore(root, read_only=True)
    with _LOCK:
        if len(_PARSED) >= MAX_PARSED:
            _PARSED.clear()
        _PARSED[key] = parsed
        if len(_STORES) >= MAX_PARSED:
            _STORES.clear()
        _STORES.setdefault(root, store)
    return Array(AsyncArray(metadata=parsed, store_path=StorePath(store, name)))


def clear() -> None:
    """Forget the parsed metadata and stores (tests; a changed ``zarr.json`` is never served from here)."""
    with _LOCK:
        _PARSED.clear()
        _STORES.clear()
