"""The single writer of a store: buffers whole chunks, then commits.

Protocol, per flush of ``R`` buffered records:

1. every per-record array gets its new rows (whole chunks, never a rewrite of
   a chunk written by an earlier flush, except the small metadata arrays);
2. weight snapshots taken during those records are written;
3. *last*, the root attribute's ``n_records`` / ``n_weights`` are updated.

A process killed at any point leaves a store whose committed count names only
complete records; arrays may be longer than that and readers ignore the tail.
There is exactly one writer per store (zarr 3 and h5py both lose data under
concurrent writers to one array); for data-parallel capture write one store
per rank.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.errors import StoreClosedError, StoreMismatchError
from gradforensics.store.backends import backend_kind, open_backend
from gradforensics.store.layout import LayoutPolicy, chunk_shape, records_per_chunk
from gradforensics.store.schema import ROOT_ATTR, StoreMeta

WEIGHT_RECORD = "weights/_record"


@dataclass
class Row:
    """One record's value for one array, ready to write (already encoded)."""

    data: np.ndarray
    attrs: dict[str, Any] = field(default_factory=dict)
    head_split: bool = False
    compression: str = "none"


class StoreWriter:
    """Append records to a new store at *path* (Zarr if ``*.zarr``, HDF5 if ``*.h5``)."""

    def __init__(self, path: str | os.PathLike[str], meta: StoreMeta, *,
                 policy: LayoutPolicy | None = None, overwrite: bool = False,
                 records_per_chunk: int | None = None) -> None:
        self.path = str(path)
        self.kind = backend_kind(self.path)
        p = Path(self.path)
        if p.exists():
            if not overwrite:
                raise FileExistsError(f"{self.path} already exists; pass overwrite=True to replace it.")
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        self.meta = meta
        self.policy = policy or LayoutPolicy()
        self._fixed_r = records_per_chunk
        self._backend = open_backend(self.path, "w")
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        self._buffer: list[dict[str, Row]] = []
        self._weights: list[tuple[int, dict[str, Row]]] = []
        self._n = 0
        self._nw = 0
        self._r = 0
        self._closed = False
        self._commit()

    # ------------------------------------------------------------------ API
    @property
    def n_records(self) -> int:
        """Records committed to disk (buffered ones not included)."""
        return self._n

    def append(self, rows: dict[str, Row], weights: dict[str, Row] | None = None) -> None:
        """Buffer one record; flush when ``R`` records are buffered."""
        if self._closed:
            raise StoreClosedError(f"{self.path}: the store writer is closed.")
        if not self._layout:
            self._plan(rows)
        self._check(rows)
        if weights:
            self._weights.append((self._n + len(self._buffer), weights))
        self._buffer.append(rows)
        if len(self._buffer) >= self._r:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records and commit them."""
        if not self._buffer and not self._weights:
            return
        for name in self._layout:
            block = np.stack([rec[name].data for rec in self._buffer]) if self._buffer else None
            if block is not None:
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
            self.flush()
        finally:
            self._closed = True
            self._backend.close()

    # ------------------------------------------------------------- internals
    def _plan(self, rows: dict[str, Row]) -> None:
        record_bytes = sum(r.data.nbytes for r in rows.values())
        self._r = self._fixed_r or records_per_chunk(record_bytes, self.policy)
        self.meta = replace(self.meta, records_per_chunk=self._r)
        for name, row in rows.items():
            self._create(name, row, self._r)

    def _create(self, name: str, row: Row, r: int) -> None:
        data = row.data
        chunks = chunk_shape(data.shape, data.dtype.itemsize, r, self.policy, row.head_split)
        # A small array's chunk spans many flushes and is mostly padding until filled: in Zarr,
        # compress it (cheap at this size) so the padding costs no disk; Zarr rewrites a chunk
        # file atomically.  Not in HDF5: a compressed chunk that is rewritten moves, and a writer
        # killed before the next flush leaves the on-disk index pointing at reused space
        # (seen in tests/test_crash.py); uncompressed chunks are rewritten in place.
        small = chunks[0] > r and row.compression == "none"
        compression = "zstd" if small and self.kind == "zarr" else row.compression
        self._backend.create(name, (0, *data.shape), data.dtype.str, chunks, row.attrs, compression)
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
                                         row.attrs, row.compression)
                shape, _, _ = self._backend.info(name)
                if tuple(shape[1:]) != row.data.shape:
                    raise StoreMismatchError(
                        f"{self.path}: {name} snapshot has shape {row.data.shape}; the store holds {shape[1:]}."
                    )
                self._backend.truncate(name, nw)
                self._backend.write_rows(name, nw, row.data[None])
            if not self._backend.has(WEIGHT_RECORD):
                self._backend.create(WEIGHT_RECORD, (0,), "<i8", (1024,), {}, "none")
            self._backend.write_rows(WEIGHT_RECORD, nw, np.array([rec_index], dtype=np.int64))
            nw += 1
        self._weights.clear()
        return nw

    def _commit(self) -> None:
        self._backend.set_root_attr(ROOT_ATTR, self.meta.committed(self._n, self._nw).to_attrs())
