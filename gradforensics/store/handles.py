"""Opened Zarr arrays of local stores, kept per process for the reads of a pass.

Every read task of the Gram pass reads one slab of one array.  Opening the array
(``zarr.open_array``: a metadata read, its parse, the codec pipeline) cost about
1.7 ms, more than reading a small tensor's chunk: a store of 2,000 small tensors
paid it 2,000 times a pass.  :func:`open_zarr_array` keeps the opened array,
keyed by the store's absolute path and the array's name, **and the exact bytes of
the array's** ``zarr.json``: each lookup reads that file again (tens of
microseconds) and uses the kept array only when the bytes are the same.

Why that cannot serve stale data: a zarr array object holds its metadata and
nothing else - every read opens and decodes the chunk files on disk again (zarr
keeps no chunk cache).  The metadata it holds was parsed from these very bytes,
so it is the array a fresh ``zarr.open_array`` would build now.  A store written
again (``overwrite=True``, a capture that grew the array, a different dtype or
chunking) changes its ``zarr.json`` and is opened afresh; a store rewritten with
the same metadata and new chunks is read from its new chunk files either way.
The bytes are compared before and after an open, so a metadata write racing the
open is never kept.  Stores at a URL are not cached (their reads open by URL).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["MAX_HANDLES", "clear", "open_zarr_array"]

#: Opened arrays kept per process (least recently used dropped first).
MAX_HANDLES = 8192
#: A ``zarr.json`` longer than this is not kept (nor is it one gradforensics writes).
_MAX_META = 1 << 20

_CACHE: OrderedDict[tuple[str, str], tuple[bytes, Any]] = OrderedDict()
_LOCK = threading.Lock()


def _metadata(path: str, name: str) -> bytes | None:
    try:
        with open(os.path.join(path, name, "zarr.json"), "rb") as f:
            raw = f.read(_MAX_META + 1)
    except OSError:
        return None
    return raw if len(raw) <= _MAX_META else None


def open_zarr_array(path: str, name: str) -> Any:
    """``zarr.open_array(<path>/<name>, mode="r")``, the one opened before when its ``zarr.json`` is unchanged."""
    import zarr

    key = (os.path.abspath(path), name)
    before = _metadata(path, name)
    if before is not None:
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None and hit[0] == before:
                _CACHE.move_to_end(key)
                return hit[1]
    arr = zarr.open_array(os.path.join(path, name), mode="r")
    if before is not None and _metadata(path, name) == before:
        with _LOCK:
            _CACHE[key] = (before, arr)
            _CACHE.move_to_end(key)
            while len(_CACHE) > MAX_HANDLES:
                _CACHE.popitem(last=False)
    return arr


def clear() -> None:
    """Forget every kept array (tests; nothing else needs it: a changed ``zarr.json`` is never served)."""
    with _LOCK:
        _CACHE.clear()
