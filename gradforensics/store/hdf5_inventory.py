"""What an HDF5 store holds, listed without trusting it: links and external data refused.

The HDF5 side of :mod:`gradforensics.store.inventory`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from gradforensics.errors import CorruptStoreError
from gradforensics.store import generations
from gradforensics.store.generations import Selection
from gradforensics.store.inventory import DTYPES, MAX_CHUNK_BYTES, Inventory, StoredArray, corrupt, finish, tolerate

__all__ = ["from_h5_attr", "hdf5_inventory"]


def hdf5_inventory(path: str, f: Any) -> Inventory:
    """Every dataset of the open HDF5 file *f*; links and external data are refused."""
    import h5py

    names: list[str] = []
    f_visit = names.append       # raise nothing inside h5py's callback: it garbles exceptions (SystemError)
    out: list[StoredArray] = []
    damaged: list[str] = []
    try:
        f.visit_links(f_visit)
        current = _hdf5_pointer(f, damaged)
        sel = Selection(current)
        for name in names:
            link = f.get(name, getlink=True)
            if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                raise CorruptStoreError(f"{path}: {name} is a {type(link).__name__}; a store is data and may not "
                                        "point elsewhere.")
            if not sel.visible(name):
                continue
            obj = f.get(name)
            if isinstance(obj, h5py.Dataset):
                try:
                    out.append(_hdf5_array(path, name, obj))
                except CorruptStoreError as exc:
                    tolerate(exc, name, damaged)
        root_attrs = {k: from_h5_attr(v) for k, v in f.attrs.items()}
    except CorruptStoreError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CorruptStoreError(f"{path}: the HDF5 file cannot be listed ({type(exc).__name__}: {exc}); "
                                "the file is damaged.") from exc
    return finish(path, root_attrs, {a.name: a for a in out}, current, damaged)


def _hdf5_pointer(f: Any, damaged: list[str]) -> str | None:
    import h5py

    group = f.get(generations.GROUP)
    if not isinstance(group, h5py.Group) or generations.ATTR not in group.attrs:
        return None
    try:
        return generations.pointer({generations.ATTR: from_h5_attr(group.attrs[generations.ATTR])})[0]
    except (OSError, RuntimeError, KeyError, ValueError, TypeError):
        damaged.append(generations.GROUP)
        return None


def _hdf5_array(path: str, name: str, ds: Any) -> StoredArray:
    if ds.is_virtual or ds.external:
        raise CorruptStoreError(f"{path}: {name} keeps its data outside the file (virtual or external storage); "
                                "a store is data and may not point elsewhere.")
    dtype = ds.dtype.name
    if dtype not in DTYPES or not ds.shape:
        raise corrupt(path, name, f"dtype {ds.dtype} / shape {ds.shape} is not one gradforensics writes")
    chunks = tuple(int(c) for c in (ds.chunks or ds.shape))
    shape = tuple(int(s) for s in ds.shape)
    arr = StoredArray(name, shape, tuple(max(c, 1) for c in chunks), dtype,
                      {k: from_h5_attr(v) for k, v in ds.attrs.items()}, int(ds.id.get_storage_size()))
    if arr.chunk_nbytes > MAX_CHUNK_BYTES:
        raise corrupt(path, name, f"chunks of {arr.chunk_nbytes} bytes, beyond {MAX_CHUNK_BYTES}")
    if ds.chunks is None:       # contiguous: all of it is there
        arr.all_present = True
    else:
        _hdf5_chunks(ds, arr)
    return arr


def _hdf5_chunks(ds: Any, arr: StoredArray) -> None:
    n = ds.id.get_num_chunks()
    if n >= math.prod(arr.grid(arr.shape[0])):     # all allocated: no need to list them
        arr.all_present = True
        return
    for i in range(n):
        info = ds.id.get_chunk_info(i)
        arr.chunk_files[tuple(o // c for o, c in zip(info.chunk_offset, arr.chunks, strict=True))] = int(info.size)


def from_h5_attr(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v
