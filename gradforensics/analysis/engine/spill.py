"""The exact regime's Gram matrices on disk as the pass computes them, read back one unit at a time.

Below ``N₀`` records the pass computes one N×N float64 Gram matrix per tensor and head
(a *unit*): ``units × N² × 8`` bytes, 1.9 GB for 936 units at N = 512, 70 GB for a
7B-shaped store (4,320 units) at N = 1,426.  Held in memory together, they made
the pass's memory grow with the unit count, and ``N₀`` had to fall with it.
:class:`GramSpill` keeps them out of memory instead:

* under the local scheduler each tensor's results are written (raw float64, its
  units appended to one file at their offsets) by a task of the pass itself, right
  after the task that computes them, so the pass holds the Gram matrices of the
  tensors in flight only; under a
  ``dask.distributed`` client they are written by the client as each tensor's
  result arrives (``as_completed``), so it never holds them all;
* ``Context.grams`` is then a read-only mapping, :class:`SpilledGrams`, whose
  ``grams[(tensor, head)]`` reads that unit's matrix (memory-mapped copy-on-write above 1 MiB: an
  analysis may scribble on it, the file is never changed): memory is bounded by
  the units in use (the threads of :func:`~gradforensics.analysis.toolkit.parallel.map_units`),
  not by all units, and reading only ``nonfinite`` or the diagonal touches little;
* saving them into the store streams them from the files (a few at a time).

The files go to a private directory made with :func:`tempfile.mkdtemp` under the
platform's temporary directory (``TMPDIR``), not the store's ``analysis/`` group:
the store may be read-only, at a URL or on a slow network file system, and a
private directory is local, writable and removed as a whole when the pass ends,
also when an analysis raises.  Before anything is read :meth:`GramSpill.start`
checks that the directory's file system has room (:func:`shutil.disk_usage`);
when it has not, it says so in one line and the pass falls back to the
long-history regime (or refuses, when the exact regime was asked for).

Small passes (Gram matrices of at most :data:`SPILL_ABOVE` bytes in all) keep them in
memory; the engine option ``spill`` forces either way.

The long-history regime spills the same way what it keeps of size ``m²`` per unit: the
super-records' Gram matrix (``m = windows × sources``, 256 × 256 float64 = 512 KiB a unit
by default, whatever N; 2.2 GB for a 7B store's 4,320 units).  :func:`write_spilled`
writes it and returns the :class:`~gradforensics.analysis.contract.grams.LongGram` without
it (``super_path`` instead); the band moments, norms and non-finite records stay in memory.

Saving the exact regime's matrices into the store (``analysis/gram/k``) frees each
spilled file once the bytes of all its units have been written there
(:meth:`SpilledGrams.release`), so the spill and the saved copy do not both hold every
matrix at once: the peak disk use of a pass is one copy, a batch and one file (at most
:data:`SPILL_FILE_BYTES`), not two copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gradforensics._format import fmt_bytes
from gradforensics.analysis.contract.grams import GramResult, LongGram
from gradforensics.errors import WriteRefusedError, refusal
from gradforensics.store.layout import MiB

__all__ = ["SPILL_ABOVE", "SPILL_FILE_BYTES", "SPILL_RESERVE", "GramSpill", "Spilled", "SpilledGrams", "fits_on_disk", "read_matrix",
           "spill_bytes", "write_spilled"]

SPILL_ABOVE = 64 * MiB
"""Gram bytes of a pass (``units × N² × 8``) up to which they stay in memory (engine option ``spill`` None)."""
SPILL_RESERVE = 256 * MiB
"""Free bytes the spill leaves on its file system."""
SPILL_FILE_BYTES = 16 * MiB
"""Most bytes of one spill file of a tensor's exact Gram matrices (a larger matrix has a file of its own).  A file is
removed once all its units are saved (:meth:`SpilledGrams.release`), so the save's peak disk is one copy, a batch
and at most this much: 16 MiB holds 128 units at N = 128, and a unit of 16 MiB or more (N >= 1,449) is a file anyway."""
_NPY_HEADER = 128          # room counted per file beyond its matrix (the files are raw now: a margin)

Key = tuple[str, int | None]


def spill_bytes(n_units: int, n_records: int) -> int:
    """Bytes the Gram matrices of *n_units* tensors and heads over *n_records* records take on disk."""
    return int(n_units) * (int(n_records) ** 2 * 8 + _NPY_HEADER)


def fits_on_disk(n_units: int, free: int) -> int:
    """The most records whose Gram matrices of *n_units* units fit in *free* bytes (keeping :data:`SPILL_RESERVE`)."""
    room = max(0, int(free) - SPILL_RESERVE) // max(1, int(n_units)) - _NPY_HEADER
    return math.isqrt(max(0, room) // 8)


@dataclass(frozen=True)
class Spilled:
    """One unit's Gram matrix in a file: what :class:`GramResult` holds, ``gram`` replaced by its path."""

    tensor: str
    head: int | None
    path: str
    nonfinite: np.ndarray
    n_features: int
    from_sketch: bool = False
    #: where the matrix starts in *path* (a tensor's matrices share one file), in bytes
    offset: int = 0

    def load(self) -> GramResult:
        """The :class:`GramResult`, its ``gram`` memory-mapped copy-on-write (the file is never changed)."""
        gram = read_matrix(self.path, int(self.nonfinite.size), "c", self.offset)
        return GramResult(self.tensor, self.head, gram, self.nonfinite, self.n_features, self.from_sketch)


def read_matrix(path: str, n: int, mode: Literal["r", "c"] = "r", offset: int = 0) -> np.ndarray:
    """The ``n × n`` float64 matrix a spill file holds at byte *offset*, memory-mapped (*mode* ``"r"`` read-only,
    ``"c"`` copy-on-write).

    The files are raw (no ``.npy`` header): parsing one cost about 0.7 ms an access
    (``numpy.load``), four times the mapping itself, and a unit is taken several times.
    """
    if n == 0:
        return np.zeros((0, 0))
    return np.memmap(path, dtype=np.float64, mode=mode, shape=(int(n), int(n)), offset=int(offset))


def write_spilled(directory: str, slot: int,
                  results: Sequence[GramResult | LongGram]) -> list[Spilled | LongGram]:
    """Write the Gram matrices of one tensor's *results* (whole, heads) to *directory*; what stands in for them.

    A :class:`GramResult` (the exact regime) becomes its :class:`Spilled`: the tensor's
    matrices are appended to one file, each at its offset, a new file begun where one would
    pass :data:`SPILL_FILE_BYTES` (a tensor of 32 heads is one file, not 32: creating and
    removing a file a unit cost about 3 s of a pass's wall over a thousand units).  A
    :class:`~gradforensics.analysis.contract.grams.LongGram` (the long-history regime)
    becomes the same LongGram with its super-record Gram matrix in a file of its own
    (``super_gram`` None, ``super_path`` set).  A task of the pass under the local
    scheduler, and the client's arrival hook under ``dask.distributed``; *slot* (the
    tensor's place in the pass) names the files, so they are distinct without any shared
    state.

    Raises
    ------
    WriteRefusedError
        The disk refused a write (full, read-only): it names the directory and what to do.
    """
    out: list[Spilled | LongGram] = []
    pack = _Pack(directory, int(slot))
    try:
        for j, g in enumerate(results):
            if isinstance(g, LongGram):
                path = os.path.join(directory, f"{int(slot)}-{j}.f8")
                _save(path, g.super_matrix(), g.tensor, g.head, directory, "{'spill': False}", "hold them in memory")
                out.append(dataclasses.replace(g, super_gram=None, super_path=path))
                continue
            path, offset = pack.add(g.gram, g.tensor, g.head)
            out.append(Spilled(g.tensor, g.head, path, np.asarray(g.nonfinite), int(g.n_features),
                               bool(g.from_sketch), offset))
    finally:
        pack.close()
    return out


class _Pack:
    """One tensor's exact Gram matrices appended to files ``<slot>.<k>.f8``, raw float64, each at its offset."""

    def __init__(self, directory: str, slot: int) -> None:
        self.directory, self.slot = directory, slot
        self._fh: Any = None
        self._path = ""
        self._files = 0
        self._offset = 0

    def add(self, matrix: np.ndarray, tensor: str, head: int | None) -> tuple[str, int]:
        """Append *matrix*; its file and byte offset there."""
        data = np.ascontiguousarray(matrix, dtype=np.float64)
        try:
            if self._fh is None or (self._offset and self._offset + data.nbytes > SPILL_FILE_BYTES):
                self.close()
                self._path = os.path.join(self.directory, f"{self.slot}.{self._files}.f8")
                self._files += 1
                self._fh, self._offset = open(self._path, "wb"), 0     # noqa: SIM115  (closed by close())
            at = self._offset
            self._fh.write(data.data)
        except OSError as exc:
            _refused(exc, tensor, head, self.directory, "{'long_history': 0}", "no per-record Gram matrix")
        self._offset += data.nbytes
        return self._path, at

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()


def _save(path: str, matrix: np.ndarray, tensor: str, head: int | None, directory: str, instead: str,
          why_instead: str) -> None:
    """One unit's matrix as raw float64 in a file of its own (C order, no header: :func:`read_matrix` knows its
    shape), a refused write one line naming the unit and what to do."""
    try:
        with open(path, "wb") as fh:
            fh.write(np.ascontiguousarray(matrix, dtype=np.float64).data)
    except OSError as exc:
        _refused(exc, tensor, head, directory, instead, why_instead)


def _refused(exc: OSError, tensor: str, head: int | None, directory: str, instead: str, why_instead: str) -> None:
    """Raise the one-line :class:`WriteRefusedError` for a spill write the disk refused (other errors as they are)."""
    why = refusal(exc)
    if why is None:
        raise exc
    raise WriteRefusedError(f"{directory}: the Gram matrix of {tensor}{'' if head is None else f' head {head}'} "
                            f"could not be spilled ({why}); point TMPDIR at a disk with room, or pass "
                            f"options={{'engine': {instead}}} ({why_instead}).") from exc


class SpilledGrams(Mapping[Key, GramResult]):
    """``Context.grams`` of a spilled pass: ``{(tensor, head): GramResult}``, read-only, each loaded on access.

    Iteration order is the pass's (tensors in store order, each whole then its
    heads), as the in-memory dict's was.  Entries held in memory (a small pass)
    are returned as they are.  Safe to read from several threads.
    """

    def __init__(self, entries: Sequence[GramResult | Spilled]) -> None:
        self._entries: dict[Key, GramResult | Spilled] = {(e.tensor, e.head): e for e in entries}
        self._released: set[Key] = set()
        self._left: dict[str, int] = {}           # per spill file, its units not yet released
        self._lock = threading.Lock()
        for e in self._entries.values():
            if isinstance(e, Spilled):
                self._left[e.path] = self._left.get(e.path, 0) + 1

    def __getstate__(self) -> dict[str, Any]:
        """What a copy shipped to a ``dask.distributed`` worker takes: everything but the lock (not picklable)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __getitem__(self, key: Key) -> GramResult:
        e = self._entries[key]
        if key in self._released:
            raise ValueError(f"the Gram matrix of {key[0]}{'' if key[1] is None else f' head {key[1]}'} was released "
                             "(its spill file removed) once it was saved into the store; load_grams() reads it there.")
        return e.load() if isinstance(e, Spilled) else e

    def release(self, keys: Sequence[Key]) -> None:
        """Release *keys* (their bytes are saved elsewhere now): a later read of them is refused, and a spill file is
        removed once every unit it holds is released (a tensor's units share a file).

        Saving a spilled pass calls it batch by batch as each is written into the
        store (:func:`~gradforensics.analysis.engine.results.save_results`), so the pass's
        disk holds one copy of the Gram matrices, not the spill and the store's both.
        Entries held in memory are left as they are.
        """
        with self._lock:
            self._release(keys)

    def _release(self, keys: Sequence[Key]) -> None:
        for key in keys:
            e = self._entries[key]
            if isinstance(e, Spilled) and key not in self._released:
                self._released.add(key)
                self._left[e.path] -= 1
                if not self._left[e.path]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        on_disk = sum(isinstance(e, Spilled) for e in self._entries.values())
        return f"SpilledGrams({len(self)} units, {on_disk} on disk)"


class GramSpill:
    """Where one pass's Gram matrices go: memory, or a private directory under ``TMPDIR`` (a context manager).

    :meth:`start` decides (before anything is read), :meth:`wrap` makes a tensor's
    Gram collection write its results there, :meth:`arrive` writes results that
    came back to the client, :meth:`grams` is the ``Context.grams`` mapping; leaving
    the ``with`` block removes the directory and everything in it.
    """

    def __init__(self) -> None:
        self.directory: str | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> GramSpill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the spill directory (nothing happens for a pass held in memory)."""
        with self._lock:
            where, self.directory = self.directory, None
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)

    def start(self, n_units: int, n_records: int, spill: bool | None,
              what: str = "the exact regime's Gram matrices", rows: str = "records") -> tuple[str, int] | None:
        """Get ready for the Gram matrices of *n_units* units over *n_records* records (*rows*).

        *spill*: True spills, False holds them in memory, None spills above
        :data:`SPILL_ABOVE` bytes.  Returns None when ready, or - the temporary
        directory's file system lacks the room - one line saying *what* needs how
        much, where, and how much is free, and the most records that would fit
        (below *n_records*; nothing is created then).
        """
        need = spill_bytes(n_units, n_records)
        if spill is False or (spill is None and need <= SPILL_ABOVE):
            return None
        base = tempfile.gettempdir()
        free = shutil.disk_usage(base).free
        if need + SPILL_RESERVE > free:
            return (f"{what} ({n_units:,} tensors and heads x {n_records:,}² {rows} x 8 "
                    f"bytes = {fmt_bytes(need)}) do not fit the {fmt_bytes(free)} free under {base} (TMPDIR)",
                    fits_on_disk(n_units, free))
        with self._lock:
            if self.directory is None:
                self.directory = tempfile.mkdtemp(prefix="gradforensics-grams-", dir=base)
        return None

    @property
    def on_disk(self) -> bool:
        return self.directory is not None

    def wrap(self, collection: Any, slot: int) -> Any:
        """*collection* (one tensor's ``list[GramResult]`` or ``list[LongGram]``) followed by the task writing it to
        disk, when spilling."""
        if self.directory is None:
            return collection
        import dask

        return dask.delayed(write_spilled, pure=False)(self.directory, slot, collection)

    def arrive(self, slot: int, results: Sequence[GramResult | LongGram]
               ) -> list[Spilled | LongGram] | Sequence[GramResult | LongGram]:
        """Results of one tensor that came back to the client: written to disk when spilling."""
        return results if self.directory is None else write_spilled(self.directory, slot, results)

    @staticmethod
    def grams(lists: Mapping[str, Sequence[GramResult | Spilled]]) -> SpilledGrams:
        """``Context.grams`` from ``{tensor: [whole, head0, ...]}`` of results or :class:`Spilled` entries."""
        return SpilledGrams([e for res in lists.values() for e in res])
