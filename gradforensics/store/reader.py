"""Open a store for reading: validate once, then hand out lazy dask arrays.

``Store(path)`` checks, at open (without trusting the store: see ``inventory.py`` and
``validate.py``): the path is a store, its schema version is
known, the schema's arrays are present with the committed length, and every
chunk of the committed records exists on disk (a deleted chunk would otherwise
read back silently as zeros).  After that, readers trust the parsed metadata.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CorruptChunkError, GradforensicsError, MissingArrayError, NotAStoreError
from gradforensics.store.backends import ArrayHandle, locate, open_backend
from gradforensics.store.layout import MiB
from gradforensics.store.location import Location
from gradforensics.store.schema import (
    ACT_FIELDS,
    ATTN_FIELDS,
    BATCH_FIELDS,
    LOGIT_FIELDS,
    MODEL_AUX_LOSS,
    ROOT_ATTR,
    ROUTER_FIELDS,
    StoreMeta,
    parse_root_attrs,
)
from gradforensics.store.validate import check_arrays, check_ranks, chunks_checked, rows_of
from gradforensics.store.writer import WEIGHT_RECORD
from gradforensics.store.zarr_backend import read_url_array

if TYPE_CHECKING:
    import dask.array as da

    from gradforensics.store.holder import Holder

__all__ = ["MAX_SLAB", "ArrayInfo", "Store", "open_store"]


@dataclass(frozen=True)
class ArrayInfo:
    """What one stored array holds."""

    name: str                 # path inside the store, e.g. "grads/model.layers.0.q_proj.weight"
    shape: tuple[int, ...]    # stored shape, record axis first (committed length)
    chunks: tuple[int, ...]
    dtype: str                # on-disk dtype
    attrs: dict[str, Any]
    nbytes_stored: int

    @property
    def key(self) -> str:
        return self.name.split("/", 1)[1]

    @property
    def heads(self) -> int | None:
        h = self.attrs.get("heads")
        return int(h) if h else None

    @property
    def split(self) -> int | None:
        """The units along axis 1 of a row, each with its own Gram matrix: the heads of a head-split
        array, the experts of a mixture-of-experts unit (attribute ``experts``); None for a whole tensor."""
        e = self.attrs.get("experts")
        return self.heads or (int(e) if e else None)

    @property
    def encoding(self) -> str:
        return str(self.attrs.get("encoding", "float32"))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def compression_ratio(self) -> float:
        return self.nbytes / self.nbytes_stored if self.nbytes_stored else float("nan")


class Store:
    """A gradforensics store (Zarr v3 directory or HDF5 file), opened read-only.

    Opening lists the store without trusting it (:mod:`gradforensics.store.inventory`),
    parses the root attributes strictly (:func:`~gradforensics.store.schema.parse_root_attrs`)
    and checks every array against the schema (:mod:`gradforensics.store.validate`),
    before anything is allocated.  With ``check_chunks=False`` the chunks of the
    bulk arrays (gradients, sketches, weights) are not checked: ``report`` reads
    only the small arrays and the ``analysis/`` results.

    Nothing here writes: ``analyze`` saves its results through
    :mod:`gradforensics.store.results`, after which the store is opened again to
    see them.

    *path* may be an fsspec URL of a Zarr store (``s3://bucket/dump.zarr``), or
    a :class:`~gradforensics.store.location.Location`; *storage_options* then go
    to its file system.  The store keeps its :attr:`location`, so every later
    open of it (reads, dask tasks, results written back) uses the same options;
    nothing is remembered per URL in the process.
    """

    def __init__(self, path: str | os.PathLike[str] | Location, *, check_chunks: bool = True,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        #: where the store lies (path or URL, backend kind, storage options)
        self.location: Location = locate(path, storage_options)
        self.path = self.location.path
        self.kind = self.location.kind
        if not self.location.is_url and not os.path.lexists(self.path):
            raise NotAStoreError(f"{self.path}: no such file or directory; expected a gradforensics store.")
        b = open_backend(self.location, "r")
        try:
            # check_chunks=False: the bulk arrays' chunk trees are not listed (none of their chunks is checked)
            inv = b.inventory(None if check_chunks else _unlisted)
        finally:
            b.close()
        self.meta: StoreMeta = parse_root_attrs(self.path, inv.root_attrs.get(ROOT_ATTR))
        #: where the committed analysis results lie (``analysis/<key>`` is read from there)
        self.analysis_selection = inv.selection
        #: a line saying damaged analysis results were ignored, else None
        self.analysis_note = inv.analysis_note
        check_arrays(self.path, self.meta, inv.arrays, check_chunks)
        self.arrays: dict[str, ArrayInfo] = {}
        for name, a in sorted(inv.arrays.items()):
            n = rows_of(name, self.meta)
            shape = a.shape if n is None else (n, *a.shape[1:])
            self.arrays[name] = ArrayInfo(name, shape, a.chunks, a.dtype, a.attrs, a.nbytes_stored)

    # ---------------------------------------------------------------- basics
    @property
    def n_records(self) -> int:
        return self.meta.n_records

    @property
    def writer(self) -> Holder | None:
        """The live process writing records into this store now (read from its lock, not taken), else None.

        The store then holds the records committed so far (:attr:`n_records`) and grows.
        A lock held by an ``analyze`` saving its results is not a writer of records.
        """
        from gradforensics.store.lock import current_writer

        where = getattr(self, "location", None) or locate(self.path)   # a subclass may skip __init__
        holder = current_writer(where)
        return holder if holder is not None and holder.writing == "records" else None

    @property
    def sources(self) -> tuple[str, ...]:
        return self.meta.sources

    @property
    def mode(self) -> str:
        return self.meta.mode

    def _group(self, prefix: str) -> dict[str, ArrayInfo]:
        return {i.key: i for n, i in self.arrays.items() if n.startswith(prefix + "/")}

    @cached_property
    def grads(self) -> dict[str, ArrayInfo]:
        """Gradient arrays by tensor name."""
        return self._group("grads")

    @cached_property
    def sketches(self) -> dict[str, ArrayInfo]:
        return self._group("sketch")

    @cached_property
    def weights(self) -> dict[str, ArrayInfo]:
        return {k: v for k, v in self._group("weights").items() if k != "_record"}

    @cached_property
    def act_modules(self) -> list[str]:
        return sorted({k.rsplit("/", 1)[0] for k in self._group("acts")})

    @cached_property
    def attn_modules(self) -> list[str]:
        """The attention modules with per-head statistics (``attn/<module>/...``), sorted."""
        return sorted({k.rsplit("/", 1)[0] for k in self._group("attn")})

    @cached_property
    def logit_modules(self) -> list[str]:
        """The modules with output-logit statistics (``logits/<module>/...``), sorted."""
        return sorted({k.rsplit("/", 1)[0] for k in self._group("logits")})

    @cached_property
    def router_modules(self) -> list[str]:
        """The mixture-of-experts routers with statistics (``router/<module>/...``), sorted."""
        return sorted({k.rsplit("/", 1)[0] for k in self._group("router") if "/" in k})

    @property
    def tensors(self) -> list[str]:
        """Every tensor with gradient information (whole or sketched), sorted."""
        return sorted(set(self.grads) | set(self.sketches))

    # ---------------------------------------------------------------- reads
    def read(self, name: str) -> np.ndarray:
        """A small array, whole, as stored (committed rows only)."""
        if name not in self.arrays:
            raise MissingArrayError(f"{self.path}: no array {name} in the store.")
        info = self.arrays[name]
        if self.location.is_url:
            return self._read_url(name, info)
        b = open_backend(self.location, "r")
        try:
            return b.read(self.analysis_selection.physical(name), slice(0, info.shape[0]))
        except GradforensicsError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise CorruptChunkError(f"{self.path}: {name} could not be read ({type(exc).__name__}: {exc}).") from exc
        finally:
            b.close()

    def _read_url(self, name: str, info: ArrayInfo) -> np.ndarray:
        try:
            return read_url_array(self.path, self.analysis_selection.physical(name), slice(0, info.shape[0]),
                                  self.location.storage_options)
        except GradforensicsError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise CorruptChunkError(f"{self.path}: {name} could not be read ({type(exc).__name__}: {exc}).") from exc

    def batches(self) -> dict[str, np.ndarray]:
        """Every ``batches/*`` array (committed records only).

        Raises
        ------
        CorruptStoreError
            ``batches/rank`` holds a negative rank, or (in a multi-rank store) one
            outside ``0 .. world_size - 1`` of the root ``ranks`` field.
        """
        out = {f: self.read(f"batches/{f}") for f in BATCH_FIELDS if f"batches/{f}" in self.arrays}
        if "rank" in out:
            check_ranks(self.path, out["rank"], self.meta.ranks.get("world_size"))
        return out

    def handle(self, info: ArrayInfo) -> ArrayHandle:
        """A picklable reader of the stored array *info* (opens the store inside each task)."""
        return ArrayHandle(self.location, info.name, info.shape, info.encoding, info.chunks)

    def lazy(self, name: str, slab_bytes: int | None = None) -> da.Array:
        """Lazy float32 dask array of a stored array.

        Chunks follow the on-disk chunks.  With *slab_bytes*, dask chunks instead
        span all records and as many on-disk feature chunks as fit in
        *slab_bytes* - the shape a Gram-matrix pass over features wants.
        """
        import dask.array as da

        info = self.arrays[name]
        chunks = self.chunks(name, slab_bytes)
        # meta given: dask would otherwise read an empty slice (open the array) to learn the type
        return da.from_array(self.handle(info), chunks=chunks, asarray=True, fancy=False, lock=False,
                             name=f"gf-{_token(self.path, name, info.shape, chunks)}",
                             meta=np.empty((0,) * len(info.shape), dtype=np.float32))

    def chunks(self, name: str, slab_bytes: int | None = None) -> tuple[tuple[int, ...], ...]:
        """The dask chunks :meth:`lazy` gives *name* (block sizes per axis), without building the array.

        The Gram pass needs only these to plan its tasks: no dask array, no read.
        """
        info = self.arrays[name]
        per_axis = info.chunks if slab_bytes is None else _slab_chunks(info, slab_bytes)
        return tuple(_blocks(int(n), int(c)) for n, c in zip(info.shape, per_axis, strict=True))

    def grad(self, tensor: str, head: int | None = None, slab_bytes: int | None = None) -> da.Array:
        """Per-record gradient of *tensor* (of one head, if given) as float32 dask array."""
        x = self.lazy(f"grads/{tensor}", slab_bytes)
        return x if head is None else x[:, head]

    def sketch(self, tensor: str, head: int | None = None) -> da.Array:
        x = self.lazy(f"sketch/{tensor}")
        return x if head is None else x[:, head]

    def weight_records(self) -> np.ndarray:
        return self.read(WEIGHT_RECORD) if WEIGHT_RECORD in self.arrays else np.zeros(0, np.int64)

    def weight(self, tensor: str) -> da.Array:
        return self.lazy(f"weights/{tensor}")

    def act(self, module: str, stat: str) -> np.ndarray:
        if stat not in ACT_FIELDS:
            raise KeyError(stat)
        return self.read(f"acts/{module}/{stat}")

    def attn(self, module: str, stat: str) -> np.ndarray:
        """Per-head attention statistic *stat* (one of ``ATTN_FIELDS``) of *module*, float32 ``(N, H)``."""
        if stat not in ATTN_FIELDS:
            raise KeyError(stat)
        return self.read(f"attn/{module}/{stat}")

    def logits(self, module: str, stat: str) -> np.ndarray:
        """Output-logit statistic *stat* (one of ``LOGIT_FIELDS``) of *module*, float32 ``(N,)``."""
        if stat not in LOGIT_FIELDS:
            raise KeyError(stat)
        return self.read(f"logits/{module}/{stat}")

    def router(self, module: str, stat: str) -> np.ndarray:
        """Router statistic *stat* (one of ``ROUTER_FIELDS``) of *module*: float32 ``(N, E)`` for ``load``,
        ``(N,)`` for the others (:mod:`gradforensics.recording.experts`)."""
        if stat not in ROUTER_FIELDS:
            raise KeyError(stat)
        return self.read(f"router/{module}/{stat}")

    def model_aux_loss(self) -> np.ndarray | None:
        """The load-balancing loss the model reported per record (``router/aux_loss``, float32 ``(N,)``), or None."""
        return self.read(MODEL_AUX_LOSS) if MODEL_AUX_LOSS in self.arrays else None

    def experts_of(self, tensor: str) -> int | None:
        """E when ``grads/<tensor>`` is a mixture-of-experts unit ``(N, E, ...)`` (attribute ``experts``), else None."""
        arr = self.arrays.get(f"grads/{tensor}")
        e = arr.attrs.get("experts") if arr is not None else None
        return int(e) if e is not None else None

    def act_attrs(self, module: str) -> dict[str, Any]:
        return self.arrays[f"acts/{module}/hist"].attrs

    def has(self, name: str) -> bool:
        return name in self.arrays


def _slab_chunks(info: ArrayInfo, slab_bytes: int) -> tuple[Any, ...]:
    """Dask chunks for a pass over features: all records, whole on-disk feature chunks.

    The record axis is one chunk, unless even one on-disk feature chunk of all
    records exceeds *slab_bytes*; then it is split into multiples of the on-disk
    record chunk.  A head-split array grows along its head axis when its on-disk
    chunks hold whole heads (several heads a task: a store written one head a
    chunk is read in slabs of many), else along the heads' own first split axis.
    """
    n = max(info.shape[0], 1)
    disk = [int(c) for c in info.chunks]
    shape = [int(s) for s in info.shape]
    chunks = list(disk)
    # first axis we may grow along: the head axis where each chunk holds whole heads
    first = 2 if info.split and disk[2:] != shape[2:] else 1
    # smallest unit of one record: the on-disk chunk without its record axis
    unit = 4 * int(np.prod(disk[1:], dtype=np.int64))
    if n * unit > slab_bytes:
        r = max(disk[0], (slab_bytes // unit) // disk[0] * disk[0])
        chunks[0] = min(r, n)
        return tuple(chunks)
    chunks[0] = n
    budget = slab_bytes // (n * unit)
    for ax in range(first, len(shape)):
        if disk[ax] < shape[ax]:
            chunks[ax] = min(shape[ax], disk[ax] * max(1, int(budget)))
            break
    return tuple(chunks)


def _unlisted(name: str) -> bool:
    """Whether a store opened with ``check_chunks=False`` leaves the chunk tree of array *name* unlisted."""
    return not chunks_checked(name, False)


def _blocks(n: int, c: int) -> tuple[int, ...]:
    """Block sizes of an axis of length *n* in chunks of *c* (as ``dask.array.normalize_chunks``)."""
    if n == 0:
        return (0,)
    c = max(1, min(c, n))
    return (c,) * (n // c) + ((n % c,) if n % c else ())


def _token(*parts: Any) -> str:
    from dask.base import tokenize

    return tokenize(*parts)


def open_store(path: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store at *path* (a local path or an fsspec URL) for reading (validates it; see :class:`Store`)."""
    return Store(path, storage_options=storage_options)


MAX_SLAB = 128 * MiB
