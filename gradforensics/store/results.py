"""The ``analysis/`` group of a store: where ``gradforensics analyze`` keeps its results.

``analyze`` saves what it found in the store it read, so ``gradforensics report``
re-renders without touching a gradient.  This module owns the raw layout of that
group, for writing and reading back; what the documents *mean* (findings, tables,
series, the Gram index) is the analysis side's
(:mod:`gradforensics.analysis.engine.results`).

=============================  ==================================  ================================
path                           dtype, shape (chunks)               what
=============================  ==================================  ================================
``analysis/<key>`` (document)  uint8 ``(bytes,)``, attr             a JSON document, UTF-8
                               ``format: "json"``                  (``findings``, ``tables/<name>``,
                                                                   ``gram_index``)
``analysis/<key>`` (array)     as given, one chunk                 a plain array (``series/<name>``)
``analysis/gram/k``            float64 ``(M, N, N)``,              M Gram matrices over the N
                               chunks ``(c, N, N)``                records, ``c`` of them a chunk
                                                                   (about 4 MiB; at least one)
``analysis/gram/nonfinite``    int64 ``(M, N)``, one chunk         non-finite count per record
=============================  ==================================  ================================

The Gram matrices are two arrays in all (not two per tensor and head), so a model
with thousands of heads does not create thousands of arrays.

Every write is a new *generation*, committed in one metadata write at its end and
carrying over what it does not replace (:mod:`gradforensics.store.generations`):
a pass killed while writing leaves the results before it, never a half-written
set.  The paths above are the logical names readers use; on disk they lie under
``analysis/<generation>/``.

Writing (:func:`write_results`) holds the store's writer lock
(:class:`~gradforensics.store.lock.StoreLock`) and opens the store in mode
``"a"``, which refuses a store holding symbolic links
(:func:`~gradforensics.store.inventory.refuse_links`): nothing is written through
a link.  A :class:`~gradforensics.store.reader.Store` opened before a write does
not see what was written; open it again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CorruptStoreError, GradforensicsError, MissingArrayError, WriteRefusedError, refusal
from gradforensics.store import generations

if TYPE_CHECKING:
    from gradforensics.store.backends import StoreBackend
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["GRAM_ARRAY", "GRAM_CHUNK_BYTES", "GRAM_INDEX", "GROUP", "NONFINITE_ARRAY", "GramArrays", "gram_chunk_rows",
           "has_result", "read_document",
           "read_grams", "read_result", "write_results"]

#: The group every analysis result lives in.
GROUP = "analysis"
#: Key of the JSON document that says which tensor and head each Gram matrix is.
GRAM_INDEX = "gram_index"
GRAM_ARRAY = f"{GROUP}/gram/k"
NONFINITE_ARRAY = f"{GROUP}/gram/nonfinite"
#: Gram matrices written per call (bounds the memory of one stacked write) ...
GRAM_BATCH = 64
#: ... and their bytes: fewer per call for big N (a spilled pass streams them from disk).
GRAM_BATCH_BYTES = 64 * 2**20
#: Bytes of one chunk of ``analysis/gram/k`` (several matrices a chunk when they are small).
GRAM_CHUNK_BYTES = 4 * 2**20


@dataclass(frozen=True)
class GramArrays:
    """Gram matrices to save: one JSON-able index entry, matrix and count vector each.

    ``k[i]`` is (N, N) and ``nonfinite[i]`` is (N,) for the store's N records;
    ``index[i]`` describes them (the analysis side decides its fields).
    """

    n_records: int
    index: list[Any] = field(default_factory=list)
    k: Sequence[np.ndarray] = ()
    nonfinite: Sequence[np.ndarray] = ()


def _key(key: str) -> str:
    return f"{GROUP}/{key}"


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o))


# ---------------------------------------------------------------------- write
def write_results(path: str | os.PathLike[str] | Location, *, arrays: Mapping[str, np.ndarray] | None = None,
                  documents: Mapping[str, Any] | None = None, grams: GramArrays | None = None) -> None:
    """Write analysis results into the store at *path*, under its writer lock.

    Parameters
    ----------
    arrays
        ``{key: array}`` saved as ``analysis/<key>``, one chunk each.
    documents
        ``{key: JSON-able object}`` saved as ``analysis/<key>`` (numpy scalars and
        arrays become numbers and lists).
    grams
        Gram matrices saved as ``analysis/gram/k``, ``analysis/gram/nonfinite``
        and the ``gram_index`` document; written first.

    Raises
    ------
    StoreLockedError
        Another writer holds the store.
    PermissionError
        The store is read-only.
    WriteRefusedError
        The disk is full (or refused the write otherwise); the committed results are intact.
    CorruptStoreError
        The store holds a symbolic link (nothing is written through one).
    """
    try:
        _write_generation(path, arrays, documents, grams)
    except OSError as exc:
        why = refusal(exc)
        if why is None or isinstance(exc, GradforensicsError):
            raise
        raise WriteRefusedError(f"{path}: analysis results not written ({why}); the results committed before "
                                "are intact.") from exc


def _write_generation(path: str | os.PathLike[str] | Location, arrays: Mapping[str, np.ndarray] | None,
                      documents: Mapping[str, Any] | None, grams: GramArrays | None) -> None:
    from gradforensics.store.backends import locate, open_backend
    from gradforensics.store.lock import StoreLock

    where = locate(path)                               # a Location carries a URL's storage options
    with StoreLock(where, writing="analysis results") as lock:
        if where.kind == "zarr" and not where.is_url:
            from gradforensics.store.ranks import clean_marker_temporaries

            clean_marker_temporaries(where.path)         # what a rank that died left (readers ignore it)
        previous = _committed(where)
        b = open_backend(where, "a")
        fence = getattr(b, "fence", None)
        if fence is not None:        # at an s3:// URL every PUT conditional: a fenced writer lands none
            fence(lock.check)
        try:
            # the generation readers see now: the reader's listing says it (under this lock it cannot change)
            current = previous.analysis_selection.current if previous is not None else \
                generations.pointer(b.group_attrs(GROUP))[0]
            gen = generations.new_generation()
            into = generations.Selection(gen)
            written: set[str] = set()
            if grams is not None:
                written |= _write_grams(b, grams, into)
            for key, arr in (arrays or {}).items():
                written.add(_write_array(b, key, np.asarray(arr), into))
            for key, doc in (documents or {}).items():
                written.add(_write_document(b, key, doc, into))
            if previous is not None:
                _carry_over(b, previous, written, into)
            # the commit: one metadata write; until it lands readers see the generation before
            lock.check()                                 # still ours (a lock at a URL can be taken over)
            b.set_group_attr(GROUP, generations.ATTR, {"current": gen, "previous": current})
            _clean_up(b, where.path, gen, current)
        finally:
            b.close()


@dataclass(frozen=True)
class _Committed:
    """The committed results as readers see them now: ``analysis/`` arrays by logical name, and where they lie."""

    arrays: Mapping[str, Any]
    analysis_selection: generations.Selection


def _committed(path: str | os.PathLike[str] | Location) -> _Committed | None:
    """The store's committed results as readers see them now, or None if they cannot be listed.

    A local Zarr store lists its root and ``analysis/`` alone (the pass that saves has
    just read the rest; a store of 2,000 tensors took 0.5-0.9 s to list again); other
    stores are opened whole.
    """
    from gradforensics.errors import GradforensicsError
    from gradforensics.store.backends import locate
    from gradforensics.store.inventory import zarr_inventory
    from gradforensics.store.reader import Store

    where = locate(path)
    try:
        if where.kind == "zarr" and not where.is_url:
            inv = zarr_inventory(where.path, only=GROUP)
            return _Committed({n: a for n, a in inv.arrays.items() if n.startswith(GROUP + "/")}, inv.selection)
        store = Store(path, check_chunks=False)
    except GradforensicsError:
        return None
    return _Committed(store.arrays, store.analysis_selection)


def _carry_over(b: StoreBackend, store: _Committed, written: set[str], into: generations.Selection) -> None:
    """Copy the committed results this write does not replace into the new generation."""
    for name, info in store.arrays.items():
        if not name.startswith(GROUP + "/") or name in written:
            continue
        src = store.analysis_selection.physical(name)
        dst = into.physical(name)
        b.create(dst, info.shape, np.dtype(info.dtype).str, info.chunks, dict(info.attrs), "none")
        step = max(1, info.chunks[0]) if name == GRAM_ARRAY else max(1, info.shape[0])
        for start in range(0, info.shape[0], step):
            b.write_rows(dst, start, b.read(src, slice(start, min(start + step, info.shape[0]))))


def _clean_up(b: StoreBackend, path: str, new: str, current: str | None) -> None:
    """Remove what readers no longer see: older and unfinished generations, the flat results of the old layout.

    *current* (the generation just replaced) stays until the next write: a reader that
    opened it a moment ago can finish.  A generation newer than it was never committed.
    """
    unfinished = 0
    for child in b.children(GROUP):
        if child in (new, current):
            continue
        if generations.is_generation(child) and (current is None or child > current):
            unfinished += 1
        b.delete(f"{GROUP}/{child}")
    if unfinished:
        import warnings

        warnings.warn(f"{path}: removed {unfinished} unfinished analysis generation(s) left by an interrupted "
                      "`gradforensics analyze`; the committed results were intact.", stacklevel=4)


def _write_array(b: StoreBackend, key: str, arr: np.ndarray, into: generations.Selection) -> str:
    chunks = tuple(max(int(c), 1) for c in arr.shape) or (1,)
    where = into.physical(_key(key))
    b.create(where, arr.shape, arr.dtype.str, chunks, {}, "none")
    if arr.size:
        b.write_rows(where, 0, arr)
    return _key(key)


def _write_document(b: StoreBackend, key: str, doc: Any, into: generations.Selection) -> str:
    raw = np.frombuffer(json.dumps(doc, default=_json_default).encode(), dtype=np.uint8)
    where = into.physical(_key(key))
    b.create(where, (raw.size,), "|u1", (max(raw.size, 1),), {"format": "json"}, "none")
    b.write_rows(where, 0, raw)
    return _key(key)


def _write_grams(b: StoreBackend, grams: GramArrays, into: generations.Selection) -> set[str]:
    m, n = len(grams.k), int(grams.n_records)
    k_at, nf_at = into.physical(GRAM_ARRAY), into.physical(NONFINITE_ARRAY)
    per_chunk = gram_chunk_rows(m, n)
    b.create(k_at, (m, n, n), "<f8", (per_chunk, max(n, 1), max(n, 1)), {}, "none")
    b.create(nf_at, (m, n), "<i8", (max(m, 1), max(n, 1)), {}, "none")
    most = max(1, min(GRAM_BATCH, GRAM_BATCH_BYTES // max(1, 8 * n * n)))   # matrices per write, by bytes
    step = per_chunk * max(1, most // per_chunk)                             # in whole chunks
    for start in range(0, m, step):
        b.write_rows(k_at, start, np.stack(grams.k[start:start + step]))
    if m:
        b.write_rows(nf_at, 0, np.stack(grams.nonfinite))
    return {GRAM_ARRAY, NONFINITE_ARRAY, _write_document(b, GRAM_INDEX, grams.index, into)}


def gram_chunk_rows(m: int, n: int) -> int:
    """Gram matrices per chunk of ``analysis/gram/k``: as many (N, N) matrices as fill
    :data:`GRAM_CHUNK_BYTES` (at least one, at most all *m*).

    A store of thousands of small tensors gets a few chunk files, not one per matrix
    (writing those dominated saving the results).  Readers read the array whole, so a
    store written with one matrix a chunk (before) reads the same.
    """
    return int(max(1, min(max(m, 1), GRAM_CHUNK_BYTES // (8 * max(n, 1) ** 2))))


# ----------------------------------------------------------------------- read
def has_result(store: Store, key: str) -> bool:
    """Whether *store* (as opened) holds ``analysis/<key>``."""
    return store.has(_key(key))


def read_result(store: Store, key: str) -> np.ndarray:
    """The array ``analysis/<key>``, whole (:class:`MissingArrayError` if absent)."""
    return store.read(_key(key))


def read_document(store: Store, key: str) -> Any:
    """The JSON document ``analysis/<key>``, decoded (not otherwise checked).

    Raises
    ------
    MissingArrayError
        The store holds no such document.
    CorruptStoreError
        Its bytes are not UTF-8 JSON (or nest absurdly deep): the results are damaged.
    """
    raw = read_result(store, key)
    try:
        return json.loads(raw.tobytes().decode())
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, absurd nesting
        text = repr(str(exc))
        text = text if len(text) <= 120 else text[:120] + "..."
        raise CorruptStoreError(f"{store.path}: {_key(key)}: is not a JSON document ({type(exc).__name__}: "
                                f"{text}); the stored analysis results are damaged, run `gradforensics "
                                "analyze` again.") from exc


def read_grams(store: Store) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
    """``(index, k, nonfinite)`` as saved by :func:`write_results` (arrays None when the index is empty).

    Raises
    ------
    MissingArrayError
        No Gram matrices were saved in *store*.
    """
    if not has_result(store, GRAM_INDEX):
        raise MissingArrayError(f"{store.path}: no Gram matrices saved; run `gradforensics analyze` first.")
    index = read_document(store, GRAM_INDEX)
    if not index:
        return index, None, None
    return index, store.read(GRAM_ARRAY), store.read(NONFINITE_ARRAY)
