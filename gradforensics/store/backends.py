"""Two on-disk backends, one logical layout: a Zarr v3 directory or an HDF5 file.

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

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from gradforensics.errors import (
    CorruptChunkError,
    CorruptStoreError,
    GradforensicsError,
    NotAStoreError,
    SpecError,
)
from gradforensics.store import remote
from gradforensics.store.inventory import (
    Inventory,
    from_h5_attr,
    hdf5_inventory,
    refuse_links,
    remote_zarr_inventory,
    zarr_inventory,
)
from gradforensics.store.layout import dimension_names
from gradforensics.store.location import Location
from gradforensics.store.schema import decode_bf16

__all__ = ["BACKENDS", "STORE_SUFFIXES", "ArrayHandle", "HDF5Backend", "StoreBackend", "ZarrBackend",
           "backend_class", "backend_kind", "guess_backend", "locate", "open_backend", "read_handles",
           "read_url_array"]


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


def _zarr_codecs(compression: str, checksum: bool) -> dict[str, Any]:
    """Bytes-to-bytes codecs of a new array: the compressor, then the chunk's CRC-32C."""
    import zarr.codecs as zc

    codecs: list[Any] = []
    if compression == "zstd":
        codecs.append(zc.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle"))
    elif compression == "bitshuffle":
        codecs.append(zc.BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"))
    elif compression != "none":
        raise ValueError(compression)
    if checksum:
        codecs.append(zc.Crc32cCodec())
    return {"compressors": codecs or None}


class ZarrBackend:
    """Zarr v3 store: a local directory, or a prefix at an fsspec URL (:mod:`gradforensics.store.remote`)."""

    kind: ClassVar[str] = "zarr"
    suffixes: ClassVar[tuple[str, ...]] = (".zarr",)
    description: ClassVar[str] = "a Zarr directory"
    remote_ok: ClassVar[bool] = True
    remote_refusal: ClassVar[str] = ""
    rewrites_chunks: ClassVar[bool] = True

    @classmethod
    def read_array(cls, location: Location, name: str, sel: Any) -> np.ndarray:
        from gradforensics.store.handles import open_zarr_array

        if location.is_url:
            return read_url_array(location.path, name, sel, location.storage_options)
        return np.asarray(open_zarr_array(location.path, name)[sel])     # opened once while its zarr.json holds

    @classmethod
    def not_a_store(cls, path: Path) -> str | None:
        if not path.is_dir():
            return "is not a directory"
        try:
            root = json.loads((path / "zarr.json").read_text())
            if not isinstance(root.get("attributes", {}).get("gradforensics"), dict):
                return "is a Zarr group but not a gradforensics store"
        except (OSError, ValueError, AttributeError):
            return "is not a Zarr group (no readable zarr.json)"
        for top, dirs, files in os.walk(path):
            rel = Path(top).relative_to(path).parts
            for entry in [*dirs, *files]:
                if (Path(top) / entry).is_symlink():
                    return f"holds a symbolic link ({Path(*rel, entry)})"
            for f in files:
                if f != "zarr.json" and "c" not in rel:
                    return f"holds {Path(*rel, f)}, which no gradforensics store holds"
        return None

    def __init__(self, where: Location | str | os.PathLike[str], mode: str = "r",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.location = locate(where, storage_options)
        self.path = self.location.path
        self.mode = mode
        self.url = self.location.is_url
        self.storage_options = dict(self.location.storage_options)
        if mode == "r" and not self.url and not (Path(self.path) / "zarr.json").is_file():
            raise NotAStoreError(f"{self.path}: no Zarr v3 group here (zarr.json missing); expected a gradforensics store.")
        self.writable = mode != "r"
        self._open: dict[str, Any] = {}   # arrays opened here keep their write config
        if mode == "a" and not self.url:   # object storage has no links; its names are checked by the inventory
            refuse_links(self.path)
        if self.writable:
            self._root  # noqa: B018  (a writer creates or opens the group now)

    @cached_property
    def _root(self) -> Any:
        """The zarr group, opened on first use (a reader lists the store by :meth:`inventory` first)."""
        import zarr

        if self.url:
            store = remote.zarr_store(self.path, self.mode == "r", self.storage_options)
            return remote.translated(self.path, lambda: zarr.open_group(
                store, mode=self.mode, zarr_format=3, use_consolidated=False))  # type: ignore[arg-type]
        try:
            return zarr.open_group(self.path, mode=self.mode, zarr_format=3, use_consolidated=False)  # type: ignore[arg-type]
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptStoreError(f"{self.path}: zarr cannot open the root group ({type(exc).__name__}: {exc}); "
                                    "the store's metadata is damaged.") from exc

    def inventory(self, unlisted: Callable[[str], bool] | None = None) -> Inventory:
        """Root attributes and every array, from the store's own files, without trusting them.

        Locally the chunk trees of the arrays *unlisted* accepts are not listed; at a URL
        one listing gives every key anyway.
        """
        if self.url:
            return remote_zarr_inventory(self.path, self.storage_options)
        return zarr_inventory(self.path, unlisted=unlisted)

    def _array(self, name: str) -> Any:
        arr = self._open.get(name)
        if arr is None:
            arr = self._root[name]
            if self.writable:
                arr = arr.with_config({"write_empty_chunks": True})
            self._open[name] = arr
        return arr

    # attributes -----------------------------------------------------------
    def root_attrs(self) -> dict[str, Any]:
        return dict(self._root.attrs)

    def set_root_attr(self, key: str, value: dict[str, Any]) -> None:
        self._io(lambda: self._root.attrs.__setitem__(key, value))

    def attrs(self, name: str) -> dict[str, Any]:
        return dict(self._root[name].attrs)

    def _io(self, fn: Any) -> Any:
        """``fn()``; at a URL retried on transient network errors (every write here is idempotent)."""
        return remote.translated(self.path, fn) if self.url else fn()

    # arrays ---------------------------------------------------------------
    def create(self, name: str, shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
               attrs: dict[str, Any], compression: str = "none", checksum: bool = True) -> None:
        self._open[name] = self._io(lambda: self._root.create_array(
            name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
            attributes=attrs, config={"write_empty_chunks": True},
            overwrite=not (self.url and self.mode == "w"),   # a new store at a URL: skip listing each prefix
            dimension_names=dimension_names(name, len(shape), attrs),
            **_zarr_codecs(compression, checksum),
        ))

    def write_rows(self, name: str, start: int, data: np.ndarray) -> None:
        arr = self._array(name)
        stop = start + data.shape[0]
        if arr.shape[0] < stop:
            self._io(lambda: arr.resize((stop, *arr.shape[1:])))
        self._io(lambda: arr.__setitem__(slice(start, stop), data))

    def truncate(self, name: str, n: int) -> None:
        arr = self._array(name)
        if arr.shape[0] != n:
            self._io(lambda: arr.resize((n, *arr.shape[1:])))

    def names(self) -> list[str]:
        return sorted(_walk_zarr(self._root))

    def info(self, name: str) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
        arr = self._root[name]
        return tuple(arr.shape), str(arr.dtype), tuple(arr.chunks)

    def has(self, name: str) -> bool:
        try:
            self._root[name]
        except KeyError:
            return False
        return True

    def read(self, name: str, sel: tuple[slice, ...] | slice = slice(None)) -> np.ndarray:
        return np.asarray(self._io(lambda: self._root[name][sel]))

    # groups (the analysis generations) -------------------------------------
    def group_attrs(self, name: str) -> dict[str, Any]:
        """Attributes of group *name*; ``{}`` if there is none (or it cannot be read)."""
        try:
            return dict(self._io(lambda: self._root[name].attrs))
        except (KeyError, ValueError, TypeError, OSError):
            return {}

    def set_group_attr(self, name: str, key: str, value: Any) -> None:
        """One metadata write: zarr replaces ``name/zarr.json`` whole (a rename locally, one PUT at a URL)."""
        group = self._io(lambda: self._root.require_group(name))
        self._io(lambda: group.attrs.__setitem__(key, value))

    def children(self, name: str) -> list[str]:
        """The names of the nodes directly inside group *name* (from the file system, not zarr's metadata)."""
        if self.url:
            fs, root = remote.filesystem(self.path, self.storage_options)
            try:
                entries = self._io(lambda: fs.ls(f"{root}/{name}", detail=True))
            except FileNotFoundError:
                return []
            return sorted(str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries
                          if e.get("type") == "directory")
        d = Path(self.path) / name
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.is_symlink()) if d.is_dir() else []

    def delete(self, name: str) -> None:
        """Remove node *name* and everything under it."""
        if self.url:
            fs, root = remote.filesystem(self.path, self.storage_options)
            self._io(lambda: fs.rm(f"{root}/{name}", recursive=True))
        else:
            import shutil

            shutil.rmtree(Path(self.path) / name, ignore_errors=False)
        self._open = {k: v for k, v in self._open.items() if k != name and not k.startswith(name + "/")}

    def flush(self) -> None:
        """Nothing to do: every zarr write above has landed when it returns."""

    def close(self) -> None:
        pass


def _walk_zarr(group: Any) -> list[str]:
    out = [name for name, _ in group.arrays()]
    for gname, sub in group.groups():
        out += [f"{gname}/{a}" for a in _walk_zarr(sub)]
    return out


def _h5_filter(compression: str) -> dict[str, Any]:
    if compression == "none":
        return {}
    # Without hdf5plugin the portable choice is gzip-1 with the shuffle filter ("zstd" maps to it).
    return {"compression": "gzip", "compression_opts": 1, "shuffle": True}


class HDF5Backend:
    """HDF5 file store (one writer per file; readers open it per task)."""

    kind: ClassVar[str] = "hdf5"
    suffixes: ClassVar[tuple[str, ...]] = (".h5", ".hdf5")
    description: ClassVar[str] = "an HDF5 file"
    remote_ok: ClassVar[bool] = False
    remote_refusal: ClassVar[str] = (
        "HDF5 stores are local files only (h5py reads a remote file through many small dependent requests "
        "and cannot write one); use a Zarr store ('*.zarr') on object storage.")
    rewrites_chunks: ClassVar[bool] = False

    @classmethod
    def read_array(cls, location: Location, name: str, sel: Any) -> np.ndarray:
        import h5py

        with h5py.File(location.path, "r") as f:
            return np.asarray(f[name][sel])

    @classmethod
    def not_a_store(cls, path: Path) -> str | None:
        import h5py

        if not path.is_file():
            return "is not a file"
        try:
            with h5py.File(path, "r") as f:
                if "gradforensics" not in f.attrs:
                    return "is an HDF5 file but not a gradforensics store"
        except OSError:
            return "is not an HDF5 file"
        return None

    def __init__(self, where: Location | str | os.PathLike[str], mode: str = "r") -> None:
        import h5py

        self.location = locate(where)
        self.path = self.location.path
        if mode == "r":
            if Path(self.path).is_dir():
                raise NotAStoreError(f"{self.path}: is a directory, not an HDF5 file; expected a gradforensics store "
                                     "(an HDF5 store is one file; a Zarr store is a *.zarr directory).")
            if not Path(self.path).is_file():
                raise NotAStoreError(f"{self.path}: no such HDF5 file; expected a gradforensics store.")
            try:
                self._f = h5py.File(self.path, "r")
            except OSError as exc:
                raise NotAStoreError(f"{self.path}: not an HDF5 file ({exc}); expected a gradforensics store.") from exc
        else:
            self._f = h5py.File(self.path, "w" if mode == "w" else "a")
        self.writable = mode != "r"

    def root_attrs(self) -> dict[str, Any]:
        return {k: from_h5_attr(v) for k, v in self._f.attrs.items()}

    def set_root_attr(self, key: str, value: dict[str, Any]) -> None:
        self._f.attrs[key] = json.dumps(value)
        self._f.flush()

    def attrs(self, name: str) -> dict[str, Any]:
        return {k: from_h5_attr(v) for k, v in self._f[name].attrs.items()}

    def create(self, name: str, shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
               attrs: dict[str, Any], compression: str = "none", checksum: bool = True) -> None:
        if name in self._f:
            del self._f[name]
        # Fletcher-32 adds 4 bytes to every chunk: its size never changes on a rewrite, so
        # rewritten chunks stay in place (what the crash test needs; see writer.py).
        ds = self._f.create_dataset(
            name, shape=shape, maxshape=(None, *shape[1:]), dtype=dtype, chunks=chunks,
            fillvalue=0, fletcher32=checksum, **_h5_filter(compression),
        )
        for k, v in attrs.items():
            ds.attrs[k] = json.dumps(v)

    def write_rows(self, name: str, start: int, data: np.ndarray) -> None:
        ds = self._f[name]
        stop = start + data.shape[0]
        if ds.shape[0] < stop:
            ds.resize(stop, axis=0)
        ds[start:stop] = data

    def truncate(self, name: str, n: int) -> None:
        ds = self._f[name]
        if ds.shape[0] != n:
            ds.resize(n, axis=0)

    def names(self) -> list[str]:
        import h5py

        out: list[str] = []
        self._f.visititems(lambda n, obj: out.append(n) if isinstance(obj, h5py.Dataset) else None)
        return sorted(out)

    def info(self, name: str) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
        ds = self._f[name]
        return tuple(ds.shape), str(ds.dtype), tuple(ds.chunks or ds.shape)

    def has(self, name: str) -> bool:
        return name in self._f

    def group_attrs(self, name: str) -> dict[str, Any]:
        import h5py

        g = self._f.get(name)
        return {k: from_h5_attr(v) for k, v in g.attrs.items()} if isinstance(g, h5py.Group) else {}

    def set_group_attr(self, name: str, key: str, value: Any) -> None:
        self._f.require_group(name).attrs[key] = json.dumps(value)
        self._f.flush()

    def children(self, name: str) -> list[str]:
        import h5py

        g = self._f.get(name)
        return sorted(g.keys()) if isinstance(g, h5py.Group) else []

    def delete(self, name: str) -> None:
        if name in self._f:
            del self._f[name]

    def inventory(self, unlisted: Callable[[str], bool] | None = None) -> Inventory:
        """Root attributes and every dataset; links and external data refused (*unlisted*: counted anyway)."""
        return hdf5_inventory(self.path, self._f)

    def read(self, name: str, sel: tuple[slice, ...] | slice = slice(None)) -> np.ndarray:
        return np.asarray(self._f[name][sel])

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


#: The backend table: every backend, in the order a path's suffix is tried against them.
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
    live at a URL is refused there in one line.  *storage_options* are kept for a
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
    elif path.endswith(("/", os.sep)) and os.path.isfile(path.rstrip("/" + os.sep)):
        path = path.rstrip("/" + os.sep)         # "dump.h5/" (a shell's completion of a file): the file it names
    backend = guess_backend(path)
    if url and not backend.remote_ok:
        raise NotAStoreError(f"{path}: {backend.remote_refusal}")
    return Location(path, backend.kind, dict(storage_options or {}) if url else {})


def backend_kind(where: Location | str | os.PathLike[str]) -> str:
    """``"zarr"`` or ``"hdf5"``: the backend of the store at *where* (:func:`locate`)."""
    return locate(where).kind


def open_backend(where: Location | str | os.PathLike[str], mode: str = "r",
                 storage_options: Mapping[str, Any] | None = None) -> StoreBackend:
    """The store at *where* opened in *mode* by its backend (:data:`BACKENDS`)."""
    loc = locate(where, storage_options)
    return backend_class(loc.kind)(loc, mode)  # type: ignore[call-arg]


def read_url_array(url: str, name: str, sel: Any, storage_options: Mapping[str, Any] | None) -> np.ndarray:
    """``sel`` of array *name* of the Zarr store at *url*: two requests (its metadata, its chunks), retried."""
    import zarr

    def read() -> np.ndarray:
        store = remote.read_store(url, storage_options)
        return np.asarray(zarr.open_array(store, path=name, mode="r")[sel])

    return remote.translated(url, read)


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
            raise CorruptChunkError(self._describe(sel, exc)) from exc
        return self.decode(raw)

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
