"""Two on-disk backends, one logical layout: a Zarr v3 directory or an HDF5 file.

The backends themselves are :class:`~gradforensics.store.zarr_backend.ZarrBackend`
and :class:`~gradforensics.store.hdf5_backend.HDF5Backend`.

A backend knows how to create, grow, write, read and list arrays and attributes
(the methods of :class:`StoreBackend`, the protocol every backend follows).  It
knows nothing of the schema (``schema.py``) or of buffering and commits
(``writer.py``).  :data:`BACKENDS` is the one table of backends - kind, class,
suffixes, whether it can live at a URL - and :func:`locate` the one place a
store path is turned into a :class:`~gradforensics.store.location.Location`
(its kind decided by that table).  Adding a backend is one class with the
protocol's methods and one entry in :data:`BACKENDS`.

:class:`ArrayHandle` is the small, picklable piece a dask task carries: it opens
the store *inside* the task, so HDF5 reads work on ``dask.distributed`` worker
processes (h5py handles do not pickle).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from gradforensics.errors import CorruptChunkError, GradforensicsError, NotAStoreError, SpecError
from gradforensics.store import remote
from gradforensics.store.hdf5_backend import HDF5Backend
from gradforensics.store.inventory import Inventory
from gradforensics.store.location import Location
from gradforensics.store.schema import decode_bf16
from gradforensics.store.zarr_backend import ZarrBackend

__all__ = ["BACKENDS", "STORE_SUFFIXES", "ArrayHandle", "StoreBackend", "backend_class", "backend_kind", "create_backend",
           "guess_backend", "locate", "open_backend", "read_handles"]


class StoreBackend(Protocol):
    """What every backend provides: the protocol :class:`ZarrBackend` and :class:`HDF5Backend` follow.

    Class attributes: ``kind`` (its name in :data:`BACKENDS` and ``Store.kind``),
    ``suffixes`` (the lower-case path suffixes it owns), ``description`` (how a
    message names a store of this kind), ``remote_ok`` (whether such a store may live
    at an fsspec URL) and ``remote_refusal`` (the line said when it may not).  A
    backend is opened on a :class:`Location` in mode ``"r"`` (a missing store is
    :class:`NotAStoreError`), ``"w"`` (a new store) or ``"a"`` (append: analysis
    results, ranks).  Array names are ``/``-separated paths below the root group.
    """

    kind: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]
    description: ClassVar[str]
    remote_ok: ClassVar[bool]
    remote_refusal: ClassVar[str]
    #: whether a chunk may be rewritten safely (Zarr replaces a chunk object whole; a rewritten filtered
    #: HDF5 chunk can move, so there a chunk holds one flush and is written once)
    rewrites_chunks: ClassVar[bool]
    location: Location
    path: str
    writable: bool

    @classmethod
    def read_array(cls, location: Location, name: str, sel: Any) -> np.ndarray:
        """``sel`` of array *name*, opened for this read only (what a dask task does)."""
    @classmethod
    def not_a_store(cls, path: Path) -> str | None:
        """Why the local *path* is not a gradforensics store that ``overwrite=True`` may delete, or None."""
    @classmethod
    def create_store(cls, location: Location, attrs: dict[str, Any]) -> StoreBackend:
        """A new store at *location* (nothing there) whose root attributes are *attrs* from the moment it exists,
        opened for writing."""

    def inventory(self, unlisted: Callable[[str], bool] | None = None) -> Inventory:
        """Root attributes and every array, listed from the store's own files without trusting them
        (the chunks of the arrays *unlisted* accepts need not be listed)."""
    def root_attrs(self) -> dict[str, Any]: ...
    def set_root_attr(self, key: str, value: dict[str, Any]) -> None: ...
    def attrs(self, name: str) -> dict[str, Any]: ...
    def create(self, name: str, shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
               attrs: dict[str, Any], compression: str = "none", checksum: bool = True) -> None:
        """A new chunked array (fill 0), with a checksum per chunk unless *checksum* is False."""
    def write_rows(self, name: str, start: int, data: np.ndarray) -> None:
        """Rows ``start .. start + len(data) - 1`` of array *name*, growing it along axis 0 as needed."""
    def truncate(self, name: str, n: int) -> None: ...
    def names(self) -> list[str]: ...
    def info(self, name: str) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
        """``(shape, dtype, chunks)`` of array *name*."""
    def has(self, name: str) -> bool: ...
    def read(self, name: str, sel: tuple[slice, ...] | slice = slice(None)) -> np.ndarray: ...
    def group_attrs(self, name: str) -> dict[str, Any]:
        """Attributes of group *name*; ``{}`` if there is none (or it cannot be read)."""
    def set_group_attr(self, name: str, key: str, value: Any) -> None:
        """One metadata write (the commit of an analysis generation)."""
    def children(self, name: str) -> list[str]: ...
    def delete(self, name: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


BACKENDS: tuple[type[StoreBackend], ...] = (ZarrBackend, HDF5Backend)
#: Every suffix a store path may end in (``.zarr``, ``.h5``, ``.hdf5``).
STORE_SUFFIXES: tuple[str, ...] = tuple(x for b in BACKENDS for x in b.suffixes)


def backend_class(kind: str) -> type[StoreBackend]:
    """The backend of *kind* (``"zarr"``, ``"hdf5"``)."""
    for b in BACKENDS:
        if b.kind == kind:
            return b
    raise SpecError(f"unknown store backend {kind!r}; known: {[b.kind for b in BACKENDS]}.")


def guess_backend(path: str) -> type[StoreBackend]:
    """The backend whose suffix *path* ends in, or :class:`NotAStoreError` naming every expected suffix."""
    suffix = Path(path.rstrip("/")).suffix.lower()
    for b in BACKENDS:
        if suffix in b.suffixes:
            return b
    expected = " or ".join(b.description + " " + " / ".join(f"'*{x}'" for x in b.suffixes) for b in BACKENDS)
    raise NotAStoreError(f"{path}: unknown store suffix {suffix!r}; expected {expected}.")


def locate(where: Location | str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Location:
    """The :class:`Location` of the store named by *where* (a Location is returned as is).

    The kind comes from the path's suffix (:data:`BACKENDS`); a backend that cannot
    live at a URL is refused there in one line.  A local path is made absolute here,
    once: the read tasks carry the Location to dask workers, whose working directory
    is their own.  *storage_options* are kept for a
    URL only (a local path has no file-system options).

    Raises
    ------
    NotAStoreError
        The suffix is no backend's, or the backend cannot be at a URL.
    SpecError
        *where* is a Location and other *storage_options* are given beside it.
    """
    if isinstance(where, Location):
        if storage_options and dict(storage_options) != dict(where.storage_options):
            raise SpecError(f"{where.path}: storage_options given twice (in its Location and beside it).")
        return where
    path = str(where)
    url = remote.is_url(path)
    if url:
        path = remote.normalize(path)
    else:
        if path.endswith(("/", os.sep)) and os.path.isfile(path.rstrip("/" + os.sep)):
            path = path.rstrip("/" + os.sep)     # "dump.h5/" (a shell's completion of a file): the file it names
        path = os.path.abspath(path)             # what a dask worker in another directory opens too
    backend = guess_backend(path)
    if url and not backend.remote_ok:
        raise NotAStoreError(f"{path}: {backend.remote_refusal}")
    return Location(path, backend.kind, dict(storage_options or {}) if url else {})


def backend_kind(where: Location | str | os.PathLike[str]) -> str:
    """``"zarr"`` or ``"hdf5"``: the backend of the store at *where* (:func:`locate`)."""
    return locate(where).kind


def create_backend(where: Location | str | os.PathLike[str], attrs: dict[str, Any]) -> StoreBackend:
    """A new store at *where* holding root attributes *attrs* from its creation (its identity), open for writing."""
    loc = locate(where)
    return backend_class(loc.kind).create_store(loc, attrs)


def open_backend(where: Location | str | os.PathLike[str], mode: str = "r",
                 storage_options: Mapping[str, Any] | None = None) -> StoreBackend:
    """The store at *where* opened in *mode* by its backend (:data:`BACKENDS`)."""
    loc = locate(where, storage_options)
    return backend_class(loc.kind)(loc, mode)  # type: ignore[call-arg]


@dataclass(frozen=True)
class ArrayHandle:
    """A picklable, lazily opened view of one stored array, decoded to float32.

    ``handle[sel]`` opens the store, reads *sel* (limited to the committed
    ``n_rows``), decodes bfloat16/float16 to float32 and closes again.  Carrying
    only strings and numbers, it pickles to any dask worker.  A store at a URL is
    opened by URL inside the task, with the storage options its
    :class:`~gradforensics.store.location.Location` carries; transient network
    errors are retried with backoff there.
    """

    location: Location
    name: str
    shape: tuple[int, ...]
    encoding: str
    chunks: tuple[int, ...]
    dtype = np.dtype(np.float32)

    @property
    def kind(self) -> str:
        return self.location.kind

    @property
    def path(self) -> str:
        return self.location.path

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, sel: Any) -> np.ndarray:
        try:
            raw = self.read_raw(sel)
        except GradforensicsError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            if not self.location.is_url and not os.path.exists(self.path):
                raise NotAStoreError(self._missing()) from exc
            raise CorruptChunkError(self._describe(sel, exc)) from exc
        return self.decode(raw)

    def _missing(self) -> str:
        """The store is not where the task was told it is (a worker on another machine, a moved store)."""
        import socket

        return (f"a worker on {socket.gethostname()} could not find {self.path} (reading {self.name}); a local "
                "store must be at the same path on every worker's machine (a shared file system), or at a URL "
                "every worker can reach.")

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """*raw* as read from the store, as float32 (bfloat16/float16 decoded)."""
        if self.encoding == "bfloat16-as-uint16":
            return decode_bf16(raw)
        return raw.astype(np.float32, copy=False)

    def read_raw(self, sel: Any) -> np.ndarray:
        """*sel* as stored (undecoded), read from the store for this call only; errors are the backend's."""
        return backend_class(self.kind).read_array(self.location, self.name, sel)

    def _describe(self, sel: Any, exc: Exception) -> str:
        """The failed read, narrowed to the first on-disk chunk that fails on its own."""
        bad = self._first_bad_chunk(sel)
        if bad is not None:
            idx, exc = bad
            r0 = idx[0] * self.chunks[0]
            where = f"chunk {'.'.join(map(str, idx))} (records {r0}-{min(r0 + self.chunks[0], self.shape[0]) - 1})"
        else:
            where = f"selection {sel!r}"
        return (f"{self.path}: {self.name}: {where} could not be read or decoded ({type(exc).__name__}: {exc}); "
                "the store is damaged there (a checksum or decode failure is never a gradient).")

    def _first_bad_chunk(self, sel: Any, limit: int = 4096) -> tuple[tuple[int, ...], Exception] | None:
        """Read the on-disk chunks under *sel* one at a time (only after a failure) to name the bad one."""
        sel = sel if isinstance(sel, tuple) else (sel,)
        ranges = []
        for ax, (n, c) in enumerate(zip(self.shape, self.chunks, strict=True)):
            s = sel[ax] if ax < len(sel) else slice(None)
            if isinstance(s, (int, np.integer)):
                s = slice(int(s), int(s) + 1)
            if not isinstance(s, slice):
                return None
            start, stop, _ = s.indices(n)
            ranges.append(range(start // c, -(-stop // c)))
        for k, idx in enumerate(np.ndindex(*[len(r) for r in ranges])):
            if k >= limit:
                return None
            chunk = tuple(r[i] for r, i in zip(ranges, idx, strict=True))
            box = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, self.chunks, self.shape,
                                                                              strict=True))
            try:
                self.read_raw(box)
            except (OSError, RuntimeError, ValueError) as exc:
                return chunk, exc
        return None


def read_handles(handles: list[ArrayHandle], sels: list[Any]) -> list[np.ndarray]:
    """``handle[sel]`` of every pair, as float32; the reads of local Zarr stores in one event-loop run.

    One run of this thread's event loop for all of them
    (:func:`~gradforensics.store.handles.read_zarr_many`) instead of a hand-off into zarr's
    loop each (what a task reading hundreds of small tensors pays for).  Any failure of that
    run reads the pairs again one at a time, so a damaged chunk is named as ``handle[sel]``
    names it (:class:`~gradforensics.errors.CorruptChunkError`); HDF5 stores and stores at a
    URL are read one at a time.
    """
    from gradforensics.store.handles import read_zarr_many

    if handles and all(h.kind == "zarr" and not h.location.is_url for h in handles):
        try:
            raws = read_zarr_many([(h.path, h.name, s) for h, s in zip(handles, sels, strict=True)])
        except (OSError, RuntimeError, ValueError, KeyError, TypeError):
            raws = None
        if raws is not None:
            return [h.decode(r) for h, r in zip(handles, raws, strict=True)]
    return [h[s] for h, s in zip(handles, sels, strict=True)]
