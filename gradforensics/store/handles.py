"""Opening a local store's Zarr arrays for reading through zarr's public API, parsing shared metadata once.

Every read task of the Gram pass reads one slab of one array.  ``zarr.open_array``
would read and parse the array's ``zarr.json`` and build its codec pipeline each
time - about 2 ms, more than reading a small tensor's chunk.  The arrays of a store
share their metadata but for their attributes and dimension names (which no read
uses): :func:`open_zarr_async` reads the array's ``zarr.json`` from disk **every
time** (tens of microseconds), lets zarr parse each distinct rest of it once per
process (``zarr.AsyncArray(metadata_dict, store_path)``, its ``.metadata`` kept),
and builds the array on that parsed metadata and one read-only ``LocalStore`` per
store.

Why that cannot serve stale data: nothing is kept but parsed metadata, keyed by
its own content.  The ``zarr.json`` read now decides the shape, data type, chunk
grid, fill value and codecs of the array returned - the values a fresh
``zarr.open_array`` would parse from the same file now - and every read opens and
decodes the chunk files on disk (zarr keeps no chunk data).  A store written
again (``overwrite=True``, a capture that grew the array, another dtype or
chunking) is read as it is now.  Anything unusual (a metadata file that cannot be
read or parsed) goes to ``zarr.open_array`` itself, with its own errors.  Stores
at a URL are not handled here (their reads open by URL).

:func:`read_zarr_many` reads many arrays in one event-loop run: the ``getitem``
coroutines of zarr's public ``AsyncArray``, gathered on an ``asyncio.Runner`` kept
per thread whose executor runs zarr's file reads and decoding in that thread (no
hand-off to another thread; a thread that already runs an event loop reads each
array through ``zarr.Array`` instead).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = [
    "MANY_BYTES",
    "MAX_PARSED",
    "clear",
    "open_zarr_array",
    "open_zarr_async",
    "parsed_count",
    "read_zarr_many",
]

#: Distinct array metadata kept parsed per process (all dropped when full).
MAX_PARSED = 4096
#: A ``zarr.json`` longer than this goes to ``zarr.open_array`` (gradforensics writes a few hundred bytes).
_MAX_META = 1 << 20
#: Metadata entries no chunk read depends on.
_NOT_READ = ("attributes", "dimension_names")
#: Decoded chunk bytes read at once by :func:`read_zarr_many` (zarr decodes a chunk whole, however
#: few of its records are written: 2,000 small tensors in chunks of 4,096 records, read all at once,
#: held 0.5 MiB a tensor).
MANY_BYTES = 8 << 20

_PARSED: dict[str, Any] = {}
#: One read-only ``LocalStore`` per (thread, root): a zarr store opens itself on first use
#: (``_ensure_open``: check, then set), which two threads' event loops racing on one shared
#: store turn into "store is already open"; a thread's store is only ever used by its loop.
_STORES: dict[tuple[int, str], Any] = {}
_LOCK = threading.Lock()
_LOCAL = threading.local()


def _metadata(path: str, name: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, name, "zarr.json"), "rb") as f:
            raw = f.read(_MAX_META + 1)
        meta = json.loads(raw) if len(raw) <= _MAX_META else None
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
    return meta if ok else None


def open_zarr_async(path: str, name: str) -> Any:
    """``zarr.AsyncArray`` of ``<path>/<name>`` for reading, its metadata parsed once per distinct content."""
    import zarr

    meta = _metadata(path, name)
    if meta is not None:
        try:
            return _build(os.path.abspath(path), name, meta)
        except Exception:                 # zarr's own open says what is wrong, in its words
            pass
    opened = zarr.open_array(os.path.join(path, name), mode="r")
    return zarr.AsyncArray(opened.metadata, opened.store_path)


def open_zarr_array(path: str, name: str) -> Any:
    """``zarr.open_array(<path>/<name>, mode="r")``: the same array for every read, its metadata parsed once."""
    import zarr

    return zarr.Array(open_zarr_async(path, name))


def read_zarr_many(reads: Sequence[tuple[str, str, Any]]) -> list[np.ndarray]:
    """``open_zarr_array(path, name)[sel]`` of every ``(path, name, sel)``, in one event-loop run.

    Each array is opened as :func:`open_zarr_async` opens it and read with its own basic
    selection (``AsyncArray.getitem``, what ``Array.__getitem__`` runs); the reads run
    concurrently, :data:`MANY_BYTES` of decoded chunks at a time, on this thread's
    ``asyncio.Runner``.
    """
    arrays = [open_zarr_async(path, name) for path, name, _ in reads]
    batches: list[list[int]] = [[]]
    held = 0
    for i, (a, (_, _, sel)) in enumerate(zip(arrays, reads, strict=True)):
        nbytes = _chunk_bytes(a, sel)
        if batches[-1] and held + nbytes > MANY_BYTES:
            batches.append([])
            held = 0
        batches[-1].append(i)
        held += nbytes

    async def gather() -> list[Any]:
        out: list[Any] = []
        for batch in batches:
            out += await asyncio.gather(*(arrays[i].getitem(reads[i][2]) for i in batch))
        return out

    runner = _runner()
    if runner is None:                    # this thread runs an event loop: zarr's own, one array at a time
        import zarr

        return [np.asarray(zarr.Array(a)[r[2]]) for a, r in zip(arrays, reads, strict=True)]
    return [np.asarray(x) for x in runner.run(gather())]


def _runner() -> asyncio.Runner | None:
    """This thread's event-loop runner (a new one after a fork), or None where a loop runs here already."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return None
    pid = os.getpid()
    if getattr(_LOCAL, "pid", None) != pid:
        new = asyncio.Runner()
        new.get_loop().set_default_executor(_InThread())
        _LOCAL.runner, _LOCAL.pid = new, pid
    runner: asyncio.Runner = _LOCAL.runner
    return runner


class _InThread(ThreadPoolExecutor):
    """An executor that runs each call at once in the calling thread (the loop's own).

    zarr hands every chunk file read and every decode to the loop's default executor;
    for the small chunk files of a store those hand-offs cost more than the work (each
    a thread switch under the GIL while the pass computes on the other threads), so the
    reading thread does the work itself, as a plain ``open``/``read`` would.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:          # the caller's await raises it, as from a thread
            done.set_exception(exc)
        return done


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
    import zarr
    from zarr.storage import LocalStore, StorePath

    rest: Any = {k: v for k, v in meta.items() if k not in _NOT_READ}     # zarr's JSON form of the metadata
    key = json.dumps(rest, sort_keys=True)
    with _LOCK:
        parsed = _PARSED.get(key)
        store = _STORES.get((threading.get_ident(), root))
    if store is None:
        store = LocalStore(root, read_only=True)
    array = zarr.AsyncArray(rest if parsed is None else parsed, StorePath(store, name))
    with _LOCK:
        for kept in (_PARSED, _STORES):
            if len(kept) >= MAX_PARSED:
                kept.clear()
        _PARSED[key] = array.metadata
        _STORES.setdefault((threading.get_ident(), root), store)
    return array


def parsed_count() -> int:
    """Distinct array metadata parsed and kept now (what :func:`clear` forgets)."""
    with _LOCK:
        return len(_PARSED)


def clear() -> None:
    """Forget the parsed metadata and stores (tests; a changed ``zarr.json`` is never served from here)."""
    with _LOCK:
        _PARSED.clear()
        _STORES.clear()
