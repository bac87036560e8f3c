"""The single writer of a store: buffers whole chunks, then commits.

Protocol, per flush of ``R`` buffered records:

1. every per-record array gets its new rows (whole chunks, never a rewrite of
   a chunk written by an earlier flush, except the small metadata arrays);
2. weight snapshots taken during those records are written;
3. *last*, the root attribute's ``n_records`` / ``n_weights`` are updated.

A process killed at any point leaves a store whose committed count names only
complete records; arrays may be longer than that and readers ignore the tail.
A write the machine refuses (a full disk, a file-size limit, a read-only file
system) is a :class:`~gradforensics.errors.WriteRefusedError` naming the store
and the records it keeps (those committed before it); the writer then writes
nothing more, and closing it only releases the lock.  So is a storage service that
stops answering (:class:`~gradforensics.errors.StoreUnreachableError`, given at the
deadline of the operation it left unanswered, :mod:`gradforensics.store.remote`):
nothing more is tried, and the lock is released if the service still answers (else
its lease runs out).
There is exactly one writer per store (zarr 3 and h5py both lose data under
concurrent writers to one array): the writer holds the store's lock
(:mod:`gradforensics.store.lock`) from open to close.  An existing path is
replaced only with ``overwrite=True`` and only when it is a gradforensics
store; anything else there is never deleted.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.errors import (
    GradforensicsError,
    StoreClosedError,
    StoreExistsError,
    StoreMismatchError,
    StoreUnreachableError,
    WriteRefusedError,
    refusal,
)
from gradforensics.store.backends import create_backend, guess_backend, locate
from gradforensics.store.layout import LayoutPolicy, chunk_shape, records_per_chunk
from gradforensics.store.location import Location
from gradforensics.store.lock import StoreLock
from gradforensics.store.pause import pause_point
from gradforensics.store.remote import clear_url
from gradforensics.store.schema import ROOT_ATTR, StoreMeta
from gradforensics.store.staging import clear_staged

__all__ = ["WEIGHT_RECORD", "Row", "StoreWriter"]


WEIGHT_RECORD = "weights/_record"


@dataclass
class Row:
    """One record's value for one array, ready to write (already encoded)."""

    data: np.ndarray
    attrs: dict[str, Any] = field(default_factory=dict)
    head_split: bool = False
    compression: str = "none"


class StoreWriter:
    """Append records to a new store at *path* (Zarr if ``*.zarr``, HDF5 if ``*.h5``).

    *path* may be an fsspec URL of a Zarr store, with *storage_options* for its
    file system, or a :class:`~gradforensics.store.location.Location`.
    """

    def __init__(self, path: str | os.PathLike[str] | Location, meta: StoreMeta, *,
                 policy: LayoutPolicy | None = None, overwrite: bool = False,
                 records_per_chunk: int | None = None, storage_options: Mapping[str, Any] | None = None,
                 expected_records: int | None = None) -> None:
        #: where the store is written (path or URL, backend kind, storage options)
        self.location = locate(path, storage_options)
        self.path = self.location.path
        self.kind = self.location.kind
        self.meta = meta
        self._lock, self._backend = self._open(overwrite)
        self.policy = policy or LayoutPolicy()
        self._fixed_r = records_per_chunk
        self._expected = expected_records           # known in advance: chunks sized for no padding
        #: records the arrays will hold, when known (a small array's chunk spans no more flushes than they fill)
        self._chunk_records = expected_records
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        self._protos: dict[str, Row] = {}           # per array, how it was created (no data): for _fit_chunks
        self._buffer: list[dict[str, Row]] = []
        self._blocks: dict[str, np.ndarray] = {}   # per array, the rows of one flush: filled in place, reused
        self._rows = 0                              # rows the arrays are grown to (ahead of the records)
        self._weights: list[tuple[int, dict[str, Row]]] = []
        self._n = 0
        self._nw = 0
        self._r = 0
        self._closed = False
        #: the refusal that stopped this writer (a full disk, a service that stopped answering...): nothing more
        #: is written after it
        self._refused: GradforensicsError | None = None
        self._committed_meta: StoreMeta | None = None    # the root attributes as last committed
        pause_point("store-created")
        try:
            with self._refusals("creating the store"):
                self._commit()
        except BaseException:
            self._close_quietly()
            raise

    def _open(self, overwrite: bool) -> tuple[Any, Any]:
        """Take the writer lock, make room and create the store, its identity in the creating write (a
        multi-rank writer overrides it)."""
        lock = StoreLock(self.location).acquire()
        try:
            if self.location.is_url:
                clear_url(self.path, overwrite, self.location.storage_options)
            else:
                clear_staged(self.path)               # what a writer killed while creating it left
                _clear_path(Path(self.path), overwrite)
            backend = create_backend(self.location, {ROOT_ATTR: self.meta.committed(0, 0).to_attrs()})
            fence = getattr(backend, "fence", None)
            if fence is not None:     # at an s3:// URL every later PUT is conditional: a fenced writer lands none
                fence(lock.check)
            return lock, backend
        except OSError as exc:
            lock.release()
            why = refusal(exc)
            if why is None or isinstance(exc, WriteRefusedError):
                raise
            raise WriteRefusedError(f"{self.path}: creating the store failed: the machine refused a write ({why}). "
                                    "Free space on its disk (or choose another path) and record again.") from exc
        except BaseException:
            lock.release()
            raise

    # ------------------------------------------------------------------ API
    @property
    def n_records(self) -> int:
        """Records committed to disk (buffered ones not included)."""
        return self._n

    def discard_if_empty(self) -> bool:
        """After :meth:`close`: remove the store if it committed no record (a run that failed before its first
        record leaves nothing that blocks the retry); returns whether it was removed.  Nothing is lost: an
        empty store holds only the metadata this writer made."""
        if not self._closed or self._n or self._nw or isinstance(self._refused, StoreUnreachableError):
            return False
        lock = StoreLock(self.location).acquire()      # nobody else writes it while it goes
        try:
            if self.location.is_url:
                clear_url(self.path, True, self.location.storage_options)
            else:
                _clear_path(Path(self.path), overwrite=True)
        finally:
            lock.release()
        return True

    def append(self, rows: dict[str, Row], weights: dict[str, Row] | None = None) -> None:
        """Buffer one record; flush when ``R`` records are buffered."""
        if self._closed:
            raise StoreClosedError(f"{self.path}: the store writer is closed.")
        if self._refused is not None:
            raise self._refused
        if not self._layout:
            with self._refusals("creating its arrays"):
                self._lock.check()    # fenced: a writer frozen since its open creates no array in a store taken over
                self._plan(rows)
        self._check(rows)
        if weights:
            self._weights.append((self._n + len(self._buffer), weights))
        if self._r > 1:     # copied once, into the flush's block; the record's arrays are released now
            j = len(self._buffer)
            for name, row in rows.items():
                self._block(name)[j] = row.data
            rows = {}
        self._buffer.append(rows)
        if len(self._buffer) >= self._r:
            self.flush()

    def snapshot(self, weights: dict[str, Row]) -> None:
        """Buffer a weight snapshot taken at the next record, before it is appended (a record may have several).

        The next :meth:`append` must follow: the snapshot's ``weights/_record`` names that record.
        """
        if self._closed:
            raise StoreClosedError(f"{self.path}: the store writer is closed.")
        self._weights.append((self._n + len(self._buffer), weights))

    def flush(self) -> None:
        """Write the buffered records and commit them.

        Raises
        ------
        WriteRefusedError
            The machine refused a write (full disk, ...): names the store and the records it keeps.
        """
        if self._refused is not None:
            raise self._refused
        if not self._buffer and not self._weights:
            return
        m = len(self._buffer)
        with self._refusals(f"writing records {self._n}-{self._n + m - 1}" if m > 1 else
                            f"writing record {self._n}" if m else "writing a weight snapshot"):
            self._flush()

    def _flush(self) -> None:
        self._lock.check()        # fenced: a writer whose lock was taken over writes nothing more
        m = len(self._buffer)
        if m:
            self._grow(self._n + m)
        for name in self._layout:
            if m:     # one record: written from its own array, no copy; several: the filled block
                block = self._blocks[name][:m] if self._r > 1 else self._buffer[0][name].data[None]
                self._backend.write_rows(name, self._n, block)
        n_new = self._n + len(self._buffer)
        nw = self._write_weights()
        self._buffer.clear()
        self._n = n_new
        self._nw = nw
        self._commit()

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._refused is not None:     # said already; the store keeps what was committed before it
                return
            if self._n == 0 and self._fixed_r is None and 0 < len(self._buffer) < self._r:
                with self._refusals(f"writing records 0-{len(self._buffer) - 1}"):
                    self._fit_chunks(len(self._buffer))
            self.flush()
            if self._rows > self._n:      # arrays grown ahead: back to the records written
                with self._refusals("trimming the arrays to the records written"):
                    for name in self._layout:
                        self._backend.truncate(name, self._n)
            if self.meta != self._committed_meta:     # attributes set since the last commit (an import's summary)
                self._commit()
        finally:
            self._close_quietly()

    def _close_quietly(self) -> None:
        """Close the backend and release the lock (after a refusal, the backend's own close may fail too)."""
        self._closed = True
        try:
            try:
                self._backend.close()
            except OSError as exc:
                if self._refused is None or refusal(exc) is None:
                    raise
        finally:
            try:
                self._lock.release()
            except StoreUnreachableError:
                if not isinstance(self._refused, StoreUnreachableError):
                    raise        # said already: the lock object stays until its lease runs out

    @contextmanager
    def _refusals(self, doing: str) -> Iterator[None]:
        """Turn the machine refusing a write (full disk, file-size limit, read-only) into one
        :class:`WriteRefusedError` naming the store and what it keeps; the writer writes nothing more."""
        try:
            yield
        except StoreUnreachableError as exc:     # a service that stopped answering: writing more would only wait
            kept = (f"the store keeps the {self._n} record{'s' if self._n != 1 else ''} committed before it"
                    if self._n else "no record was committed before it")
            self._refused = StoreUnreachableError(f"{exc} Stopped {doing}: {kept}.")
            self._buffer.clear()
            self._weights.clear()
            raise self._refused from exc
        except OSError as exc:
            why = refusal(exc)
            if why is None or isinstance(exc, WriteRefusedError):
                raise
            kept = (f"it keeps the {self._n} record{'s' if self._n != 1 else ''} committed before"
                    if self._n else "no record was committed before")
            self._refused = WriteRefusedError(
                f"{self.path}: {doing} failed: the machine refused a write ({why}); {kept} it. Free space on its "
                "disk (or choose another path) and record again.")
            self._buffer.clear()
            self._weights.clear()
            raise self._refused from exc

    # ------------------------------------------------------------- internals
    def _fit_chunks(self, m: int) -> None:
        """Closing before the first flush, with *m* < R records: chunks of *m* records, not R.

        Both formats store an edge chunk at its full size, so a capture shorter than one
        chunk would be mostly padding (a 32-record HDF5 sketch store took 2x its data).
        Nothing is on disk yet but empty arrays (no record is committed, no chunk written):
        they are created again with the chunks records_per_chunk(expected=m) gives, then the
        one flush writes them.  A kill in between leaves a store of no record, as a kill
        before the first record does.  A small array's chunk is those *m* records too, not
        the several flushes of a long capture (32 records of 32 floats: one chunk of 32,
        where it was 4,096 records, decoded whole by every read).
        """
        self._lock.check()
        self._chunk_records = m
        for name, row in self._protos.items():
            self._backend.delete(name)
            self._create(name, row, m)
        self.meta = replace(self.meta, records_per_chunk=m)

    def _block(self, name: str) -> np.ndarray:
        block = self._blocks.get(name)
        if block is None:
            shape, dtype = self._layout[name]
            block = self._blocks[name] = np.empty((self._r, *shape), dtype=dtype)
        return block

    def _grow(self, stop: int) -> None:
        """Grow every array to at least *stop* rows, doubling: one metadata write per array every few flushes.

        Rows past the committed count are ignored by readers (see the module
        docstring); :meth:`close` trims the arrays to the records written.
        """
        if stop <= self._rows:
            return
        target = max(stop, 2 * self._rows)
        for name in self._layout:
            self._backend.truncate(name, target)
        self._rows = target

    def _plan(self, rows: dict[str, Row]) -> None:
        record_bytes = sum(r.data.nbytes for r in rows.values())
        self._r = self._fixed_r or records_per_chunk(record_bytes, self.policy, self._expected)
        self.meta = replace(self.meta, records_per_chunk=self._r)
        for name, row in rows.items():
            self._create(name, row, self._r)
            # the array's description without its data (a broadcast view: no memory)
            self._protos[name] = Row(np.broadcast_to(np.zeros((), row.data.dtype), row.data.shape), row.attrs,
                                     row.head_split, row.compression)

    def _create(self, name: str, row: Row, r: int) -> None:
        data = row.data
        chunks = chunk_shape(data.shape, data.dtype.itemsize, r, self.policy, row.head_split, self._chunk_records)
        # A small array's chunk spans many flushes and is mostly padding until filled: in Zarr,
        # compress it (cheap at this size) so the padding costs no disk; Zarr rewrites a chunk
        # file atomically.  Not in HDF5: a filtered chunk (compressed, or checksummed) that is
        # rewritten can move, and a writer killed before the next flush leaves the on-disk index
        # pointing at reused space (seen in tests/test_crash.py).  So in HDF5 a chunk holds one
        # flush of records and is written once, like the large arrays' chunks.
        small = chunks[0] > r and row.compression == "none"
        rewrites = self._backend.rewrites_chunks      # Zarr: yes; HDF5: a chunk is written once
        compression = "zstd" if small and rewrites else row.compression
        if not rewrites and (small or row.compression != "none" or self.policy.checksums):
            chunks = (r, *chunks[1:])
        self._backend.create(name, (0, *data.shape), data.dtype.str, chunks, row.attrs, compression,
                             self.policy.checksums)
        self._layout[name] = (tuple(data.shape), data.dtype)

    def _check(self, rows: dict[str, Row]) -> None:
        if rows.keys() != self._layout.keys():
            missing = sorted(self._layout.keys() - rows.keys())
            extra = sorted(rows.keys() - self._layout.keys())
            raise StoreMismatchError(
                f"{self.path}: record {self._n + len(self._buffer)} has a different set of arrays than "
                f"record 0 (missing {missing[:3]}, new {extra[:3]}); every record must carry the same tensors."
            )
        for name, row in rows.items():
            shape, dtype = self._layout[name]
            if row.data.shape != shape or row.data.dtype != dtype:
                raise StoreMismatchError(
                    f"{self.path}: {name} has shape {row.data.shape} {row.data.dtype}; the store holds "
                    f"{shape} {dtype} for it since record 0."
                )

    def _write_weights(self) -> int:
        nw = self._nw
        for rec_index, snap in self._weights:
            for name, row in snap.items():
                if not self._backend.has(name):
                    chunks = chunk_shape(row.data.shape, row.data.dtype.itemsize, 1, self.policy)
                    self._backend.create(name, (0, *row.data.shape), row.data.dtype.str, chunks,
                                         row.attrs, row.compression, self.policy.checksums)
                shape, _, _ = self._backend.info(name)
                if tuple(shape[1:]) != row.data.shape:
                    raise StoreMismatchError(
                        f"{self.path}: {name} snapshot has shape {row.data.shape}; the store holds {shape[1:]}."
                    )
                self._backend.truncate(name, nw)
                self._backend.write_rows(name, nw, row.data[None])
            if not self._backend.has(WEIGHT_RECORD):   # HDF5: one snapshot a chunk, never rewritten (see _create)
                chunk = (1024,) if self._backend.rewrites_chunks else (1,)
                self._backend.create(WEIGHT_RECORD, (0,), "<i8", chunk, {}, "none", self.policy.checksums)
            self._backend.write_rows(WEIGHT_RECORD, nw, np.array([rec_index], dtype=np.int64))
            nw += 1
        self._weights.clear()
        return nw

    def _commit(self) -> None:
        self._lock.check()        # again right before the commit: a late flush never commits into another's store
        self._backend.set_root_attr(ROOT_ATTR, self.meta.committed(self._n, self._nw).to_attrs())
        self._committed_meta = self.meta
        self._lock.heartbeat()


def _clear_path(p: Path, overwrite: bool) -> None:
    """Make room for a new store at *p*: refuse, or delete an old gradforensics store there."""
    if not (p.exists() or p.is_symlink()):
        return
    if not overwrite:
        raise StoreExistsError(f"{p} already exists; pass overwrite=True to replace a gradforensics store, "
                               "or choose another path.",
                               cli=f"{p} already exists; pass --overwrite to replace a gradforensics store, "
                                   "or choose another --out.")
    problem = _not_a_store(p)
    if problem:
        raise StoreExistsError(f"{p} {problem}; refusing to delete it, even with overwrite=True. "
                               "Choose another path, or remove it yourself.",
                               cli=f"{p} {problem}; refusing to delete it, even with --overwrite. "
                                   "Choose another --out, or remove it yourself.")
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()


def _not_a_store(p: Path) -> str | None:
    """Why *p* is not a gradforensics store that may be deleted, or None when it is one."""
    if p.is_symlink():
        return "is a symbolic link"
    return guess_backend(str(p)).not_a_store(p)
