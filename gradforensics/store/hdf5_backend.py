"""The HDF5 backend: one local file (one writer per file; readers open it per task).

One of the backends of :data:`~gradforensics.store.backends.BACKENDS`; it follows the
:class:`~gradforensics.store.backends.StoreBackend` protocol.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from gradforensics.errors import NotAStoreError, StoreLockedError
from gradforensics.store.hdf5_inventory import from_h5_attr, hdf5_inventory
from gradforensics.store.inventory import Inventory
from gradforensics.store.location import Location, located
from gradforensics.store.staging import publish, staging_path

__all__ = ["HDF5Backend"]


def _locked(path: str, exc: OSError) -> StoreLockedError | None:
    """The one line for a file HDF5 could not open because a writer holds its file lock, else None.

    h5py says ``[Errno 11] ... (unable to lock file, errno = 11, ...)``: the file is open for
    writing in another process (a Recorder, a capture, an import).  The holder is named from
    the store's own lock (:func:`~gradforensics.store.lock.current_writer`) when it has one.
    """
    if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK) and "unable to lock file" not in str(exc):
        return None
    from gradforensics.store.lock import current_writer

    holder = current_writer(path)
    who = f" ({holder.describe()})" if holder is not None else ""
    return StoreLockedError(f"{path}: being written by another process{who}; an HDF5 store cannot be read until its "
                            "writer closes it (HDF5 locks the file). Try again then, or write a Zarr store (*.zarr) "
                            "to read it while it is written.")


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

        try:
            f = h5py.File(location.path, "r")
        except OSError as exc:
            raise _locked(location.path, exc) or exc from exc
        with f:
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
        except OSError as exc:
            locked = _locked(str(path), exc)
            if locked is not None:      # a writer has it open: what it is cannot be read now, and is not replaced
                raise locked from exc
            return "is not an HDF5 file"
        return None

    @classmethod
    def create_store(cls, location: Location, attrs: dict[str, Any]) -> HDF5Backend:
        """A new store file that holds *attrs* from the moment it is at its path.

        Made under a staging name, its root attributes written and the file closed, then
        renamed into place (:mod:`gradforensics.store.staging`): a half-made HDF5 file is never
        at the store's path.
        """
        import h5py

        staged = staging_path(location.path)
        with h5py.File(staged, "w") as f:
            for k, v in attrs.items():
                f.attrs[k] = json.dumps(v)
        publish(staged, location.path)
        return cls(location, "a")

    def __init__(self, where: Location | str | os.PathLike[str], mode: str = "r") -> None:
        import h5py

        self.location = located(where)
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
                raise _locked(self.path, exc) or NotAStoreError(
                    f"{self.path}: not an HDF5 file ({exc}); expected a gradforensics store.") from exc
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

    def _ensure_room(self, nbytes: int) -> None:
        """Refuse (``OSError`` ENOSPC / EFBIG, naming the file) a write of *nbytes* that the disk or the process's
        file-size limit has no room for, with :data:`ROOM_MARGIN` to spare, *before* HDF5 writes a byte of it.

        HDF5 does not survive a write the kernel refuses: its metadata cache is left half written (the file
        then does not open, "address of object past end of allocation") and closing it can crash the process
        (issue 42).  The margin keeps room for the metadata that closing the file writes.  Another process
        filling the disk between this check and the write is not covered.
        """
        need = nbytes + ROOM_MARGIN
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
        except OSError:
            return
        if st.f_bavail * st.f_frsize < need:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            size = max(os.path.getsize(self.path), int(self._f.id.get_filesize()))
            if size + need > soft:
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), self.path)

    def write_rows(self, name: str, start: int, data: np.ndarray) -> None:
        ds = self._f[name]
        stop = start + data.shape[0]
        rows = ds.chunks[0] if ds.chunks else data.shape[0]
        chunk_bytes = int(np.prod(ds.chunks or data.shape)) * ds.dtype.itemsize
        self._ensure_room((-(-stop // rows) - start // rows) * chunk_bytes)
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


#: bytes an HDF5 write leaves free on its disk (and under the file-size limit): the metadata its close writes
ROOM_MARGIN = 1 << 20


#: The backend table: every backend, in the order a path's suffix is tried against them.
