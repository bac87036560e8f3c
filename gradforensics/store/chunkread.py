"""Reading a local Zarr array's chunk files straight, for the codec chains gradforensics writes.

A read through zarr (:func:`~gradforensics.store.handles.read_zarr_many`) costs about
1.3 ms an array on zarr's event loop - some 20 asyncio callbacks, a thread hop for the
file and one for the codec - more than reading and decoding a small tensor's chunk:
the fused pass over 2,000 tensors of 32 floats spent about 2.5 CPU-s on it.

:func:`read_direct` reads the same chunk files and runs the same decoders, in the
calling thread: the ``crc32c`` check (``google_crc32c``, as zarr's ``Crc32cCodec``),
the ``blosc`` decode (zarr's own ``BloscCodec`` built from the same metadata, so the
same ``numcodecs`` decoder and settings) and the ``bytes`` codec's view as the stored
little-endian type, each chunk's part copied into a C-ordered array of the selection:
lossless decoding, so the values are the bytes zarr returns.  It reads only what it is
sure of: the ``bytes`` [+ ``blosc``] [+ ``crc32c``] chains gradforensics writes, a
regular grid with the default ``/`` keys, a data type of :data:`NATIVE`, basic slices,
every chunk present.  Anything else - a missing chunk (zarr gives the fill value), a
checksum that fails, a chunk that does not decode to its size, another codec - returns
None, and the caller reads that array through zarr, which gives its own value or error.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["NATIVE", "clear", "read_direct"]

#: Data types read here (little-endian on disk, as the ``bytes`` codec writes them).
NATIVE = frozenset({"float32", "float16", "float64", "uint16", "uint8", "int32", "int64"})
_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_GRID = "regular"
_KEYS = {"name": "default", "configuration": {"separator": "/"}}

#: ``(dtype, chunk shape, blosc codec or None, crc32c)`` per distinct codec description (None: not read here).
_PLANS: dict[str, tuple[np.dtype[Any], tuple[int, ...], Any, bool] | None] = {}
_LOCK = threading.Lock()
_MAX_PLANS = 4096


def _plan(meta: dict[str, Any]) -> tuple[np.dtype[Any], tuple[int, ...], Any, bool] | None:
    """How to decode the chunks of an array with metadata *meta*, or None where it is not read here."""
    grid, codecs = meta.get("chunk_grid"), meta.get("codecs")
    key = json.dumps([meta.get("data_type"), grid, codecs, meta.get("chunk_key_encoding"),
                      meta.get("storage_transformers")], sort_keys=True, default=repr)
    with _LOCK:
        if key in _PLANS:
            return _PLANS[key]
    plan = _new_plan(meta)
    with _LOCK:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _new_plan(meta: dict[str, Any]) -> tuple[np.dtype[Any], tuple[int, ...], Any, bool] | None:
    if sys.byteorder != "little" or meta.get("data_type") not in NATIVE or meta.get("storage_transformers") not in (None, []):
        return None
    grid, codecs = meta.get("chunk_grid"), meta.get("codecs")
    if meta.get("chunk_key_encoding") != _KEYS or not isinstance(grid, dict) or grid.get("name") != _GRID:
        return None
    conf = grid.get("configuration")
    shape = conf.get("chunk_shape") if isinstance(conf, dict) else None
    if not isinstance(shape, list) or not shape or not all(isinstance(c, int) and c > 0 for c in shape):
        return None
    dtype = np.dtype(meta["data_type"])
    if not isinstance(codecs, list) or not codecs or not (
            codecs[0] == _BYTES or (codecs[0] == {"name": "bytes"} and dtype.itemsize == 1)):
        return None                # one-byte types carry no endianness
    rest = list(codecs[1:])
    crc = bool(rest) and rest[-1] == {"name": "crc32c"}
    if crc:
        rest.pop()
    blosc = None
    if rest and isinstance(rest[0], dict) and rest[0].get("name") == "blosc":
        try:
            from zarr.codecs import BloscCodec

            blosc = BloscCodec.from_dict(rest.pop(0))._blosc_codec
        except Exception:          # zarr's own read says what is wrong with it
            return None
    if rest:
        return None
    return dtype, tuple(shape), blosc, crc


def read_direct(path: str, name: str, meta: dict[str, Any], sel: Any) -> np.ndarray | None:
    """``zarr.open_array(<path>/<name>)[sel]`` read from the chunk files here, or None where zarr must read it.

    *meta* is the array's ``zarr.json`` as read now; *sel* a tuple of slices (step 1).
    """
    plan = _plan(meta)
    shape = meta.get("shape")
    if plan is None or not isinstance(shape, list) or len(shape) != len(plan[1]):
        return None
    dtype, chunks, blosc, crc = plan
    box = _box(sel, shape)
    if box is None:
        return None
    out = np.empty(tuple(b - a for a, b in box), dtype=dtype)
    if out.size == 0:
        return None
    nbytes = int(np.prod(chunks, dtype=np.int64)) * dtype.itemsize
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks, strict=True)]
    base = os.path.join(path, name, "c")
    for idx in itertools.product(*ranges):
        chunk = _chunk(os.path.join(base, *map(str, idx)), blosc, crc, nbytes)
        if chunk is None:
            return None
        chunk = chunk.view(dtype).reshape(chunks)
        src, dst = [], []
        for i, c, (a, b) in zip(idx, chunks, box, strict=True):
            lo, hi = max(a, i * c), min(b, (i + 1) * c)
            src.append(slice(lo - i * c, hi - i * c))
            dst.append(slice(lo - a, hi - a))
        out[tuple(dst)] = chunk[tuple(src)]
    return out


def _box(sel: Any, shape: list[Any]) -> list[tuple[int, int]] | None:
    """``[(start, stop)]`` per axis of the basic selection *sel* (slices of step 1), else None."""
    sel = sel if isinstance(sel, tuple) else (sel,)
    if len(sel) > len(shape) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return None
    box = []
    for ax, n in enumerate(shape):
        s = sel[ax] if ax < len(sel) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            return None
        start, stop, _ = s.indices(n)
        if stop <= start:
            return None
        box.append((start, stop))
    return box


def _chunk(file: str, blosc: Any, crc: bool, nbytes: int) -> np.ndarray | None:
    """The decoded bytes of one chunk file (uint8), or None (missing, failed checksum, wrong size)."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    data = np.frombuffer(raw, dtype=np.uint8)
    if crc:
        import google_crc32c

        if data.size < 4 or np.uint32(google_crc32c.value(data[:-4])).tobytes() != raw[-4:]:
            return None
        data = data[:-4]
    if blosc is not None:
        try:
            data = np.frombuffer(blosc.decode(data), dtype=np.uint8)
        except Exception:         # zarr's own read raises its error for it
            return None
    return data if data.size == nbytes else None


def clear() -> None:
    """Forget the decoding plans (tests)."""
    with _LOCK:
        _PLANS.clear()
