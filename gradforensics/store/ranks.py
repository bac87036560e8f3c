"""Many ranks, one store: who writes which record, and how the count is committed.

Under ``torch.distributed`` every rank of a job writes its own records into one
Zarr store at the same time, without a lock on the data:

* **ownership** - every array is chunked one record per chunk, and rank ``q`` of
  ``R`` writes its ``i``-th record at global index ``i * R + q``; no chunk file
  is ever written by two ranks;
* **metadata** - only rank 0 writes array metadata (it creates every array and
  grows it); another rank writes its chunks through a local view whose shape is
  long enough (:func:`row_view`), so it never touches an array's ``zarr.json``;
* **progress** - rank ``q > 0`` keeps a marker ``ranks/<q>`` (a group whose
  attributes are its record count, whether it closed, its host and pid), written
  only by that rank after its chunks;
* **commit** - rank 0 alone writes the root attribute: ``n_records`` is the
  longest prefix of global indices whose owners have written them
  (:func:`committed_prefix`).  At close rank 0 waits until every rank has closed
  or died (pid gone on this host) or the wait times out, then moves the complete
  records that lie after a hole (a dead rank's missing records) down into it
  (:func:`compaction_moves`), and commits them all together with the ``ranks``
  root attribute: world size, ranks that completed, records per rank.

A rank killed with ``kill -9`` therefore loses only its records in flight; the
other ranks' records, before and after, are kept.  A launcher that answers a dead rank
by sending SIGTERM to the others (torchrun) is met by :mod:`~gradforensics.store.termguard`:
while a multi-rank recorder is open, SIGTERM raises :class:`~gradforensics.errors.Terminated`
in the main thread, the recorder closes, and rank 0 waits at most
:data:`TERM_WAIT_S` for the others before it commits.  A record is *complete* when
the rank that owns it says so: rank 0 for its own, rank ``q``'s marker count for
rank ``q``'s (the marker is written after the chunks); every complete record is
committed, whatever the other ranks reached.

At open rank 0 tells every rank whether it created the store (:attr:`RankPlan.share`,
a broadcast): a refusal (the store locked by another job, ...) is raised on every
rank as the same one-line error, instead of leaving the others at a barrier.
HDF5 (one writer per file) is refused under many ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.errors import GradforensicsError, SpecError, StoreMismatchError
from gradforensics.store.backends import backend_kind, open_backend
from gradforensics.store.inventory import is_marker_temporary
from gradforensics.store.layout import chunk_shape
from gradforensics.store.location import Location
from gradforensics.store.schema import ROOT_ATTR, StoreMeta, committed_prefix
from gradforensics.store.writer import WEIGHT_RECORD, Row, StoreWriter

__all__ = ["DEFAULT_WAIT_S", "MARKERS", "TERM_WAIT_S", "RankPlan", "alive", "check_backend",
           "clean_marker_temporaries", "compaction_moves", "counts", "ensure_markers_group", "rank_writer", "read_marker", "row_view", "wait_for_array",
           "write_marker"]


MARKERS = "ranks"
#: Seconds rank 0 waits at close for the other ranks to close (or die) before it commits without them
#: (``GRADFORENSICS_RANK_WAIT_S`` overrides it).
DEFAULT_WAIT_S = float(os.environ.get("GRADFORENSICS_RANK_WAIT_S", "600"))
#: After SIGTERM, rank 0's wait is at most this long: torchrun kills a rank 30 s after its SIGTERM.
TERM_WAIT_S = 10.0
#: A marker's temporary older than this is abandoned whoever wrote it (writing one takes milliseconds).
TEMPORARY_STALE_S = 60.0


@dataclass(frozen=True)
class RankPlan:
    """This process's place in a multi-rank capture.

    ``share`` is a collective every rank calls once at open: rank 0 passes what
    came of creating the store (``None``, or the error it raises) and every rank
    gets it back (a broadcast from rank 0), so the others open the store after it
    exists, or raise rank 0's error.  ``barrier`` is a plain collective (after
    close, in :func:`gradforensics.replay.replay`); ``wait_s`` bounds rank 0's wait
    for the other ranks at close.
    """

    rank: int
    world: int
    barrier: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)
    share: Callable[[Any], Any] = field(default=lambda word: word, compare=False, repr=False)
    wait_s: float = DEFAULT_WAIT_S
    kind: str = "local"

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world):
            raise SpecError(f"rank {self.rank} is not in 0..{self.world - 1}.")

    def index(self, i: int) -> int:
        """Global record index of this rank's *i*-th record."""
        return i * self.world + self.rank


def check_backend(path: str, kind: str) -> None:
    """Many ranks write only into a local Zarr directory."""
    if kind != "zarr":
        raise SpecError(f"{path}: an HDF5 file has one writer; capture from many ranks into a Zarr store "
                        "('*.zarr').")
    if "://" in path:
        raise SpecError(f"{path}: capture from many ranks writes to a local (or shared-file-system) Zarr "
                        "directory; copy the store to object storage after the run.")


# ------------------------------------------------------------------ markers
def write_marker(path: str, plan: RankPlan, n_records: int, done: bool) -> None:
    """Rank *plan.rank*'s progress, written atomically (temporary file, then rename)."""
    d = Path(path) / MARKERS / str(plan.rank)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group",
           "attributes": {"records": n_records, "done": done, "host": socket.gethostname(), "pid": os.getpid()}}
    tmp = d / f".zarr.json.{os.getpid()}"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, d / "zarr.json")
    clean_marker_temporaries(path, only=plan.rank)       # one left here by an earlier process of this rank


def clean_marker_temporaries(path: str | Path, only: int | None = None) -> int:
    """Remove the marker temporaries ``ranks/<q>/.zarr.json.<pid>`` that ranks which died left; how many.

    A temporary is abandoned when it names this host and a process that is gone, or when it is
    older than :data:`TEMPORARY_STALE_S` (a rank on another host of a shared file system); this
    process's own is never touched.  A rank directory left empty goes too.  Readers ignore such
    temporaries anyway (:func:`gradforensics.store.inventory.is_marker_temporary`); the writers
    remove them: a rank after each marker (its own directory, *only*), rank 0 at open, and every
    write of analysis results.
    """
    base = Path(path) / MARKERS
    removed = 0
    try:
        dirs = [base / str(only)] if only is not None else [d for d in base.iterdir() if d.is_dir()]
    except OSError:
        return 0
    for d in dirs:
        try:
            names = [n for n in os.listdir(d) if is_marker_temporary(f"{MARKERS}/{d.name}/{n}")]
        except OSError:
            continue
        here = 0
        for n in names:
            if n == f".zarr.json.{os.getpid()}" or not _abandoned(d / n):
                continue
            with contextlib.suppress(FileNotFoundError):
                (d / n).unlink()
                here += 1
        removed += here
        if here:
            with contextlib.suppress(OSError):     # rmdir takes only an empty directory
                d.rmdir()
    return removed


def _abandoned(tmp: Path) -> bool:
    try:
        if time.time() - tmp.stat().st_mtime > TEMPORARY_STALE_S:
            return True
        doc = json.loads(tmp.read_text())
        attrs = doc.get("attributes") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return False                     # being written right now, or unreadable: its age decides later
    return isinstance(attrs, dict) and not alive(attrs)


def ensure_markers_group(path: str) -> None:
    """The ``ranks`` group itself (rank 0, at open), without the temporaries of ranks that died."""
    d = Path(path) / MARKERS
    d.mkdir(parents=True, exist_ok=True)
    clean_marker_temporaries(path)
    (d / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))


def read_marker(path: str, rank: int) -> dict[str, Any] | None:
    try:
        doc = json.loads((Path(path) / MARKERS / str(rank) / "zarr.json").read_text())
    except (OSError, ValueError):
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return attrs if isinstance(attrs, dict) else None


def alive(marker: dict[str, Any] | None) -> bool:
    """False when the rank's marker names a process on this host that is gone."""
    if not marker or marker.get("host") != socket.gethostname():
        return True
    try:
        pid = int(marker["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    try:   # a killed child its parent has not reaped yet is a zombie: dead too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def counts(path: str, plan: RankPlan, own: int) -> list[int]:
    """Records written by every rank (rank 0's from *own*, the others' from their markers)."""
    out = []
    for q in range(plan.world):
        m = read_marker(path, q) if q != plan.rank else {"records": own}
        n = m.get("records") if m else 0
        out.append(n if isinstance(n, int) and n >= 0 else 0)
    return out


# ------------------------------------------------------------------ layout
def compaction_moves(per_rank: list[int]) -> list[tuple[int, int]]:
    """``(from, to)`` global indices that close the holes left by ranks with fewer records.

    Every written record keeps its relative order; the result is contiguous
    from 0 to ``sum(per_rank)``.
    """
    world = len(per_rank)
    written = sorted(i * world + q for q, c in enumerate(per_rank) for i in range(c))
    return [(old, new) for new, old in enumerate(written) if old != new]


def row_view(arr: Any, n_rows: int) -> Any:
    """A write handle on zarr array *arr* that accepts rows below *n_rows*, never writing its metadata.

    The chunk files a rank writes do not depend on the array's recorded shape
    (one record per chunk, Zarr v3's chunk key encoding), so a rank other than 0
    writes through a copy of the array object whose in-memory shape is long
    enough; rank 0 grows the stored shape before it commits those rows.  The copy
    writes empty chunks too, as the rank writer's arrays do.
    """
    import zarr

    if arr.metadata.shape[0] >= n_rows:
        return arr
    meta = arr.metadata.update_shape((n_rows, *arr.metadata.shape[1:]))
    return zarr.Array(zarr.AsyncArray(meta, arr.store_path, config={"write_empty_chunks": True}))


def wait_for_array(root: Any, name: str, wait_s: float) -> Any:
    """Open array *name* once rank 0 has created it (another rank's first record may come first)."""
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        try:
            return root[name]
        except (KeyError, ValueError, FileNotFoundError) as exc:   # absent, or its zarr.json half written
            if time.monotonic() > deadline:
                raise StoreMismatchError(f"{name}: rank 0 has not created it after {wait_s:.0f} s; every rank "
                                         "must record the same tensors.") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _word(exc: BaseException, path: str) -> BaseException:
    """Rank 0's failure at open as the other ranks raise it: the same exception when it pickles, else one line."""
    if isinstance(exc, GradforensicsError | OSError):
        try:
            return pickle.loads(pickle.dumps(exc))     # what the broadcast does with it
        except Exception:      # an exception that does not pickle: its line below
            pass
    return GradforensicsError(f"{path}: rank 0 could not create the store ({type(exc).__name__}: {exc}).")


# ------------------------------------------------------------------ the writer
class _NoLock:
    """Ranks other than 0 write under rank 0's lock."""

    def heartbeat(self) -> None:
        pass

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


def rank_writer(path: str | Location, meta: StoreMeta, plan: RankPlan, **kwargs: Any) -> _RankWriter:
    """A :class:`~gradforensics.store.writer.StoreWriter` for one rank of a multi-rank capture.

    Collective: every rank calls it (rank 0 creates the store, the others open it
    once rank 0 has said so, or raise rank 0's error).  ``records_per_chunk`` is 1:
    a chunk holds one record, so one rank owns it.
    """
    check_backend(str(path), backend_kind(path))
    kwargs["records_per_chunk"] = 1
    return _RankWriter(path, meta, plan=plan, **kwargs)


class _RankWriter(StoreWriter):
    """Rank *plan.rank*'s writer; see the module docstring for the protocol."""

    def __init__(self, path: str | Location, meta: StoreMeta, *, plan: RankPlan, **kwargs: Any) -> None:
        self.plan = plan
        self._ranks_done: list[int] = []
        self._per_rank: list[int] = [0] * plan.world
        self._rows_on_disk = 0
        self._arrays: dict[str, Any] = {}
        if plan.rank:
            super().__init__(path, meta, **kwargs)      # _open waits for rank 0's word
            return
        try:
            super().__init__(path, meta, **kwargs)
            ensure_markers_group(self.path)
        except BaseException as exc:    # refused (locked by another job, ...): every rank raises it, none waits
            with contextlib.suppress(Exception):   # the other ranks are gone: rank 0's own error is raised
                plan.share(_word(exc, str(path)))
            raise
        plan.share(None)                # the store exists: the other ranks may open it

    # ---------------------------------------------------------------- opening
    def _open(self, overwrite: bool) -> tuple[Any, Any]:
        if self.plan.rank == 0:
            return super()._open(overwrite)
        word = self.plan.share(None)  # wait for rank 0 to create the store, or to say why it could not
        if isinstance(word, BaseException):
            raise word
        return _NoLock(), open_backend(self.location, "a")

    def hurry(self) -> None:
        """SIGTERM: rank 0 waits at most :data:`TERM_WAIT_S` for the other ranks at close (from its start)."""
        self.plan = replace(self.plan, wait_s=min(self.plan.wait_s, TERM_WAIT_S))

    def _create(self, name: str, row: Row, r: int) -> None:
        data = row.data
        if self.plan.rank == 0:
            chunks = chunk_shape(data.shape, data.dtype.itemsize, 1, self.policy, row.head_split)
            self._backend.create(name, (0, *data.shape), data.dtype.str, (1, *chunks[1:]), row.attrs,
                                 row.compression, self.policy.checksums)
        else:
            arr = wait_for_array(self._group, name, self.plan.wait_s)
            if tuple(arr.shape[1:]) != tuple(data.shape) or arr.dtype != data.dtype:
                raise StoreMismatchError(f"{self.path}: rank {self.plan.rank}: {name} has rows {data.shape} "
                                         f"{data.dtype}; rank 0 created {tuple(arr.shape[1:])} {arr.dtype}.")
            self._arrays[name] = arr.with_config({"write_empty_chunks": True})
        self._layout[name] = (tuple(data.shape), data.dtype)

    @property
    def _group(self) -> Any:
        import zarr

        return zarr.open_group(self.path, mode="r+", zarr_format=3, use_consolidated=False)

    # ---------------------------------------------------------------- writing
    def append(self, rows: dict[str, Row], weights: dict[str, Row] | None = None) -> None:
        # weights are the same on every rank: rank 0 keeps them
        super().append(rows, weights if self.plan.rank == 0 else None)

    def flush(self) -> None:
        if not self._buffer and not self._weights:
            return
        self._lock.check()        # fenced (rank 0 holds the lock; other ranks write under it)
        for j, rec in enumerate(self._buffer):
            at = self.plan.index(self._n + j)
            for name in self._layout:
                self._write_row(name, at, rec[name].data)
        if self._weights:   # rank 0 only: the snapshot's record is its global index
            self._weights = [(self.plan.index(i), w) for i, w in self._weights]
        self._n += len(self._buffer)
        self._nw = self._write_weights()
        self._buffer.clear()
        self._commit()

    def _write_row(self, name: str, at: int, data: Any) -> None:
        if self.plan.rank == 0:
            if at >= self._rows_on_disk:      # grow ahead, doubling: few metadata writes
                self._set_rows(max(at + 1, 2 * self._rows_on_disk, self.plan.world), grow_only=True)
            self._backend.write_rows(name, at, data[None])
        else:
            row_view(self._arrays[name], at + 1)[at:at + 1] = data[None]

    def _commit(self) -> None:
        if self.plan.rank:
            write_marker(self.path, self.plan, self._n, done=self._closed)
            return
        self._per_rank = counts(self.path, self.plan, self._n)
        self._set_rows(committed_prefix(self._per_rank), grow_only=True)
        self._commit_root(committed_prefix(self._per_rank))

    def _commit_root(self, n: int) -> None:
        ranks = {"world_size": self.plan.world, "completed": list(self._ranks_done), "records": self._per_rank}
        meta = self.meta.committed(n, self._nw)
        self._lock.check()
        self._backend.set_root_attr(ROOT_ATTR, replace(meta, ranks=ranks).to_attrs())
        self._lock.heartbeat()

    def _set_rows(self, n: int, grow_only: bool) -> None:
        if (grow_only and n <= self._rows_on_disk) or not self._layout:
            return
        for name in self._layout:
            self._backend.truncate(name, n)
        self._rows_on_disk = n

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        if self._closed:
            return
        if self.plan.rank:
            try:
                self.flush()
            finally:
                self._closed = True
                write_marker(self.path, self.plan, self._n, done=True)
                self._backend.close()
            return
        try:
            self.flush()
            self._finish()
        finally:
            self._closed = True
            try:
                self._backend.close()
            finally:
                self._lock.release()

    def _finish(self) -> None:
        """Rank 0: wait for the other ranks, close the holes, commit every complete record."""
        start = time.monotonic()
        while True:
            markers = {q: read_marker(self.path, q) for q in range(1, self.plan.world)}
            waiting = [q for q, m in markers.items() if not (m and m.get("done")) and alive(m)]
            if not waiting or time.monotonic() > start + self.plan.wait_s:    # hurry() may shorten it meanwhile
                break
            time.sleep(0.05)
        self._ranks_done = [0, *[q for q, m in markers.items() if m and m.get("done")]]
        per = self._per_rank = counts(self.path, self.plan, self._n)
        last = max((c - 1) * self.plan.world + q + 1 for q, c in enumerate(per))
        self._set_rows(max(last, 0), grow_only=True)
        moves = compaction_moves(per)
        for old, new in moves:
            for name in self._layout:
                self._backend.write_rows(name, new, self._backend.read(name, slice(old, old + 1)))
        if moves and self._nw:
            self._remap_weights(dict(moves))
        total = sum(per)
        if self._layout:
            for name in self._layout:
                self._backend.truncate(name, total)
        self._commit_root(total)

    def _remap_weights(self, moved: dict[int, int]) -> None:
        rec = self._backend.read(WEIGHT_RECORD, slice(0, self._nw))
        self._backend.write_rows(WEIGHT_RECORD, 0, np.array([moved.get(int(i), int(i)) for i in rec], dtype=np.int64))
