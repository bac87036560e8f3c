"""The framework-agnostic :class:`ArrayRecorder`: arrays in, schema-v1 store out.

``record()`` validates and copies what it is given on the caller's thread (so
the caller may zero its gradients right after), then hands the record to one
background writer thread through a bounded queue: capture overlaps compute and
memory stays bounded, because a full queue blocks ``record()`` (backpressure)
rather than buffering without limit.  The writer thread encodes (bfloat16 bit
patterns, head split, sketch, activation statistics) and writes.

The PyTorch recorder (:class:`~gradforensics.recording.torch.TorchRecorder`)
subclasses it: it reads ``.grad`` and hooks modules, then goes through the same
path.  ``gf.Recorder`` (:func:`gradforensics.recording.Recorder`) picks one of the two.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import queue
import threading
import time as _time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np

from gradforensics.errors import SpecError, StoreClosedError, StoreMismatchError, Terminated
from gradforensics.recording.actstats import ActRange, act_stats, make_range
from gradforensics.recording.encoding import DTYPES, PendingRecord, encode, is_bf16, mixture_row, parse_sketch, to_f32
from gradforensics.recording.experts import match_experts
from gradforensics.recording.heads import match_heads
from gradforensics.store.backends import locate
from gradforensics.store.heads import HeadSpec
from gradforensics.store.layout import LayoutPolicy
from gradforensics.store.names import check_name
from gradforensics.store.ranks import RankPlan, rank_writer
from gradforensics.store.schema import (
    ATTN_FIELDS,
    StoreMeta,
    act_path,
    attn_path,
    batch_path,
    grad_path,
    new_meta,
    sketch_path,
    weight_path,
)
from gradforensics.store.termguard import TermGuard
from gradforensics.store.writer import Row, StoreWriter

__all__ = ["ArrayRecorder"]


class ArrayRecorder:
    """Record per-batch gradients, activation statistics and weights (arrays) into a store.

    ``gf.Recorder(path, sources=...)`` without ``model=`` returns one.

    Parameters
    ----------
    path
        ``*.zarr`` (Zarr v3 directory) or ``*.h5`` / ``*.hdf5`` (HDF5 file).
    sources
        Names of the data sources; every record names its source or mixture.
    heads
        ``{glob: H}`` or ``{glob: {"heads": H, "axis": A, "role": R, "fused": F,
        "interleaved": bool}}``: tensors to store per head, ``(N, H, ...)``.
    experts
        ``{glob: E}``: tensors that are mixture-of-experts units, ``(E, ...)`` with the
        E experts on axis 0; stored ``(N, E, ...)`` with the attribute ``experts = E``
        (the PyTorch recorder finds them in the model: :mod:`gradforensics.recording.experts`).
    sketch
        ``k`` or ``{"k": k, "seed": s, "method": "countsketch"|"gaussian"}``: also
        store a k-dim seeded projection of every gradient (per head where split).
    full
        Globs of tensors whose whole gradient is stored.  Default: all, unless
        *sketch* is given, then none (sketch-only capture).
    dtype
        ``"float32"``, ``"float16"`` or ``"bfloat16"``: the on-disk format of
        gradients.  Default: as given (bfloat16 kept as its bit patterns).
    mode
        ``"training"`` (records over optimizer steps) or ``"replay"``.
    act_bounds
        ``{module_glob: (lo, hi)}`` for bounded activations (tanh: (-1, 1)).
    queue_size
        Records in flight to the writer thread before ``record()`` blocks.
    background
        ``False`` writes on the caller's thread (debugging).
    overwrite
        Replace an existing gradforensics store at *path*.  Without it an existing
        path is refused (:class:`~gradforensics.errors.StoreExistsError`); even with
        it, anything that is not a gradforensics store is never deleted.
    records_per_chunk, layout, compression
        On-disk layout (see :mod:`gradforensics.store.layout`); the defaults
        were chosen by measurement (``docs/store-layout.md``).
    expected_records
        How many records will be written, if known: the chunks are then sized so
        that the last one is not mostly padding (``replay`` and ``whatif`` pass it).
    framework, model_info, extra
        The store's ``framework``, ``model`` and ``extra`` root attributes
        (``extra={"replicated": True}``: every rank records the same batches, the
        input of the ``rankconsistency`` analysis; ``extra={"dataset_size": N}``:
        the data set's size, so a run whose every record has ``n_samples == N`` is
        known as full-batch training).
    dtypes
        The run's number formats, ``{"parameters": "bfloat16", "master": "float32"}``
        (root attribute ``dtypes``; the PyTorch recorder fills it from the model, the
        master format defaulting to the parameters'): the precision analysis speaks of
        these formats, and of any other only as a what-if.
    ranks
        This rank's :class:`~gradforensics.store.ranks.RankPlan` in a multi-rank
        capture (the PyTorch recorder sets it under ``torch.distributed``).  While
        such a recorder is open, SIGTERM (torchrun stopping the ranks when one
        died) raises :class:`~gradforensics.errors.Terminated` in the main thread,
        so that leaving ``with`` closes the store and rank 0 commits every rank's
        complete records (:class:`~gradforensics.store.termguard.TermGuard`).
    storage_options
        For *path* an fsspec URL (``s3://bucket/dump.zarr``): options of its file
        system (credentials, ``endpoint_url``, ...); default: the environment.

    Notes
    -----
    A subclass that gathers its arrays itself (the PyTorch recorder) builds a
    record with :meth:`_make_pending`, may attach a ``settle`` callable to it
    (:class:`PendingRecord`), and hands it over with :meth:`_submit`; the
    writer-side encoding is not meant to be overridden.
    """

    def __init__(self, path: str | os.PathLike[str], *, sources: Sequence[str], heads: Mapping[str, Any] | None = None,
                 sketch: int | Mapping[str, Any] | None = None, full: Sequence[str] | None = None,
                 dtype: str | None = None, mode: str = "training",
                 act_bounds: Mapping[str, tuple[float, float]] | None = None, queue_size: int = 4,
                 background: bool = True, overwrite: bool = False, records_per_chunk: int | None = None,
                 framework: str = "numpy", model_info: Mapping[str, Any] | None = None, compression: str = "none",
                 layout: LayoutPolicy | None = None, storage_options: Mapping[str, Any] | None = None,
                 ranks: RankPlan | None = None, extra: Mapping[str, Any] | None = None,
                 dtypes: Mapping[str, str] | None = None, expected_records: int | None = None,
                 experts: Mapping[str, int] | None = None) -> None:
        if experts is not None and not isinstance(experts, Mapping):
            raise SpecError(f"experts of an array recorder must be {{tensor glob: E}}; got {experts!r} "
                            "('auto' needs model=).")
        if dtype is not None and dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {DTYPES} or None; got {dtype!r}.")
        self.path = str(path)
        self.sources = tuple(sources)
        self.heads = dict(heads or {})
        self.experts = {str(k): int(v) for k, v in (experts or {}).items()}
        self.sketcher = parse_sketch(sketch)
        self.full = tuple(full) if full is not None else (() if self.sketcher else ("*",))
        self.dtype = dtype
        self.act_bounds = dict(act_bounds or {})
        self.compression = compression
        #: Tensors whose sketch arrives computed (:attr:`PendingRecord.sketches`).
        self.device_sketched: frozenset[str] = frozenset()
        meta = new_meta(self.sources, mode, framework, dict(model_info or {}), dict(extra or {}), dict(dtypes or {}))
        #: where the store is written: a path, or a Zarr store at an fsspec URL with its storage options
        self.location = locate(path, storage_options)
        self.path = self.location.path
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        self._term: TermGuard | None = None
        self._writer = self._open_writer(meta, overwrite, records_per_chunk, layout, expected_records)
        self._shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self._head_specs: dict[str, HeadSpec | None] = {}
        self._ranges: dict[str, ActRange] = {}
        self._n_submitted = 0
        self._error: BaseException | None = None
        self._closed = False
        self.bytes_per_record: int | None = None
        self._queue: queue.Queue[PendingRecord | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max(1, queue_size))
            self._thread = threading.Thread(target=self._run, name="gradforensics-writer", daemon=True)
            self._thread.start()

    def _open_writer(self, meta: StoreMeta, overwrite: bool, records_per_chunk: int | None,
                     layout: LayoutPolicy | None, expected_records: int | None) -> StoreWriter:
        """The store's writer; under many ranks collective (rank 0 creates the store, the others join it)."""
        if self.ranks is None:
            return StoreWriter(self.location, meta, overwrite=overwrite, records_per_chunk=records_per_chunk,
                               policy=layout, expected_records=expected_records)
        writer = rank_writer(self.location, meta, self.ranks, overwrite=overwrite, policy=layout)
        self._term = TermGuard(on_signal=writer.hurry)   # SIGTERM closes the store: rank 0 commits
        return writer

    # ------------------------------------------------------------------ API
    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Close; a ``with`` block that fails before its first record is committed removes the empty store
        (one process only), so the retry is not refused by it."""
        try:
            self.close()
        finally:
            if exc_type is not None and self.ranks is None:
                self._writer.discard_if_empty()

    @property
    def n_records(self) -> int:
        """Records handed to ``record()`` so far."""
        return self._n_submitted

    def record(self, *, step: int | None = None, loss: float = math.nan, source: str | None = None,
               mixture: Mapping[str, float] | None = None, n_samples: int = 1, lr: float = math.nan, rank: int = 0,
               time: float | None = None, grads: Mapping[str, Any] | None = None,
               activations: Mapping[str, Any] | None = None, weights: Mapping[str, Any] | None = None,
               attention: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Record one batch.  Arrays are copied before this returns.

        *attention*: ``{module: {stat: (H,) array}}`` with every stat of
        ``ATTN_FIELDS`` (``max_logit``, ``entropy_mean``, ``entropy_min``, ``onehot_frac``).
        """
        pending = self._make_pending(
            step=step, loss=loss, source=source, mixture=mixture, n_samples=n_samples, lr=lr, rank=rank,
            time=time, grads=grads, activations=activations, weights=weights)
        pending.attn = self._take_attn(attention or {})
        self._submit(pending)

    def _take_attn(self, attention: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
        """Validate per-head attention statistics: every stat, one (H,) shape per module since record 0."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for module, stats in attention.items():
            if set(stats) != set(ATTN_FIELDS):
                raise SpecError(f"record(): attention[{module!r}] has stats {sorted(stats)}; expected {list(ATTN_FIELDS)}.")
            row = {k: np.array(stats[k], dtype=np.float32, copy=True) for k in ATTN_FIELDS}
            shapes = {a.shape for a in row.values()}
            key = "attn:" + check_name(module, "record(): attention key")
            seen = self._shapes.setdefault(key, (next(iter(shapes)), "float32"))
            if len(shapes) != 1 or len(seen[0]) != 1 or shapes != {seen[0]}:
                raise StoreMismatchError(f"record(): attention[{module!r}] has shapes {sorted(shapes)}; expected one "
                                         f"(H,) shape, {seen[0]} since record 0.")
            out[module] = row
        return out

    def _make_pending(self, *, step: int | None, loss: float, source: str | None, mixture: Mapping[str, float] | None,
                      n_samples: int, lr: float, rank: int, time: float | None, grads: Mapping[str, Any] | None,
                      activations: Mapping[str, Any] | None, weights: Mapping[str, Any] | None,
                      copy: bool = True) -> PendingRecord:
        """Validate one record; ``copy=False`` when the caller hands over fresh arrays."""
        self._raise_if_failed()
        if self._closed:
            raise StoreClosedError(f"{self.path}: record() after close().")
        i = self._n_submitted
        meta: dict[str, Any] = {
            "step": np.int64(i if step is None else step),
            "loss": np.float32(loss),
            "mixture": mixture_row(self.sources, source, mixture),
            "n_samples": np.int32(n_samples),
            "rank": np.int32(rank),
            "lr": np.float32(lr),
            "time": np.float64(_time.time() if time is None else time),
        }
        taken = {k: self._take(f"grads[{k!r}]", k, v, copy=copy) for k, v in (grads or {}).items()}
        if self.experts and i == 0:           # shapes are fixed from record 0: check the units once, here
            for k, g in taken.items():
                self._experts_of(k, g.shape)
        return PendingRecord(
            meta=meta,
            grads=taken,
            acts={k: self._take(f"activations[{k!r}]", "act:" + k, v, per_record_shape=False, copy=copy)
                  for k, v in (activations or {}).items()},
            weights={check_name(k, "record(): weights key"): np.array(v, copy=True) if copy else np.asarray(v)
                     for k, v in (weights or {}).items()},
        )

    def drain(self) -> None:
        """Wait until the writer thread has taken every record so far (no forced disk flush)."""
        if self._queue is not None:
            self._queue.join()
        self._raise_if_failed()

    def flush(self) -> None:
        """Wait until every record so far is written and committed."""
        self.drain()
        self._writer.flush()

    def close(self) -> None:
        """Flush and close.  Safe to call twice; re-raises a writer-thread error.

        Under many ranks, a SIGTERM that arrives while closing is held until the
        store is closed, then raised (:class:`~gradforensics.errors.Terminated`).
        """
        term = self._term
        if term is not None:
            term.closing = True      # first: a SIGTERM from here on must not cut the close short
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None and self._thread is not None:
                self._queue.put(None)
                self._thread.join()
        finally:
            try:
                self._writer.close()
            finally:
                if term is not None:
                    term.restore()
        self._raise_if_failed()
        if term is not None and term.pending:
            raise Terminated("SIGTERM")

    # ------------------------------------------------------ caller-side work
    def _take(self, label: str, key: str, value: Any, per_record_shape: bool = True,
              copy: bool = True) -> np.ndarray:
        if key not in self._shapes:   # a name is checked once, when it first arrives
            check_name(key.removeprefix("act:"), f"record(): {label.split('[')[0]} key")
        a = np.array(value, copy=True) if copy else np.asarray(value)
        if a.dtype.kind not in "fV" and not is_bf16(a):
            raise StoreMismatchError(f"record(): {label} has dtype {a.dtype}; expected a floating-point array.")
        shape = a.shape if per_record_shape else a.shape[-1:]
        seen = self._shapes.setdefault(key, (shape, a.dtype.name))
        if seen[0] != shape:
            raise StoreMismatchError(
                f"record(): {label} has shape {shape}; the store holds {seen[0]} for it since record 0."
            )
        if seen[1] != a.dtype.name:
            raise StoreMismatchError(
                f"record(): {label} has dtype {a.dtype.name}; the store holds {seen[1]} for it since record 0."
            )
        return a

    def _submit(self, pending: PendingRecord) -> None:
        self._n_submitted += 1
        if self._queue is None:
            self._write(pending)
        else:
            self._queue.put(pending)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # ------------------------------------------------------ writer-side work
    def _run(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._write(item)
            except BaseException as exc:
                self._error = exc
            finally:
                self._queue.task_done()

    def _write(self, p: PendingRecord) -> None:
        if p.settle is not None:
            p.settle()
        rows: dict[str, Row] = {}
        for name, value in p.meta.items():
            rows[batch_path(name)] = Row(np.asarray(value))
        for name, g in p.grads.items():
            rows.update(self._grad_rows(name, g))
        for name, (sk, shape, dtype) in p.sketches.items():
            assert self.sketcher is not None
            attrs = self._grad_attrs(name, shape, dtype)
            rows[sketch_path(name)] = Row(sk, {**attrs, **self.sketcher.attrs(), "encoding": "float32"})
        for module, a in p.acts.items():
            rows.update(self._act_rows(module, a))
        for module, stats in p.act_stats.items():
            rng = self._ranges[module]
            rows.update({act_path(module, k): Row(v, rng.attrs() if k == "hist" else {}) for k, v in stats.items()})
        for module, stats in p.attn.items():
            rows.update({attn_path(module, k): Row(v, {"heads": int(v.shape[0])}) for k, v in stats.items()})
        rows.update({k: Row(v, a) for k, (v, a) in p.rows.items()})
        weights = {weight_path(k): Row(*self._weight_row(k, w)) for k, w in p.weights.items()}
        if self.bytes_per_record is None:
            self.bytes_per_record = sum(r.data.nbytes for r in rows.values())
        self._writer.append(rows, weights or None)

    def _spec(self, name: str, shape: tuple[int, ...]) -> HeadSpec | None:
        if name not in self._head_specs:
            spec = match_heads(name, self.heads)
            if spec is not None:
                spec.validate(name, shape)
            self._head_specs[name] = spec
        return self._head_specs[name]

    def _grad_attrs(self, name: str, shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
        spec = self._spec(name, shape)
        attrs: dict[str, Any] = {"source_dtype": dtype, "shape": list(shape)}
        if spec is not None:
            return {**attrs, **spec.attrs()}
        e = self._experts_of(name, shape)
        return attrs if e is None else {**attrs, "experts": e}

    def _grad_rows(self, name: str, g: np.ndarray) -> dict[str, Row]:
        spec = self._spec(name, g.shape)
        data, encoding = encode(g, self.dtype, f"grads[{name!r}]")
        attrs: dict[str, Any] = {"encoding": encoding, **self._grad_attrs(name, g.shape, g.dtype.name)}
        out: dict[str, Row] = {}
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.full):
            blocks = spec.split(data) if spec is not None else data
            out[grad_path(name)] = Row(blocks, attrs, head_split=spec is not None or "experts" in attrs,
                                       compression=self.compression)
        if self.sketcher is not None and name not in self.device_sketched:
            g32 = g if g.dtype == np.float32 else to_f32(g)
            if spec is not None:
                sk = self.sketcher.project_heads(spec.split(g32))
            else:      # an experts unit: one sketch per expert (E, k), the experts on axis 0 as heads' blocks
                sk = self.sketcher.project_heads(g32) if "experts" in attrs else self.sketcher.project(g32)
            out[sketch_path(name)] = Row(sk, {**attrs, **self.sketcher.attrs(), "encoding": "float32"})
        return out

    def _experts_of(self, name: str, shape: tuple[int, ...]) -> int | None:
        """E when tensor *name* is an experts unit (``experts=``), checked against its leading axis."""
        e = match_experts(name, self.experts)
        if e is not None and (len(shape) < 2 or shape[0] != e):
            raise SpecError(f"experts for {name}: shape {shape} does not hold {e} experts on axis 0.")
        return e

    def _act_rows(self, module: str, a: np.ndarray) -> dict[str, Row]:
        rng = self._ranges.get(module)
        if rng is None:
            rng = self._ranges[module] = dataclasses.replace(      # units: the last axis of arrays given
                make_range(to_f32(a), self._bounds_for(module)), unit_axis=max(a.ndim - 1, 0),
                units=int(a.shape[-1]) if a.ndim else 1, unit_axis_from="last axis (an array given to record())")
        return {act_path(module, k): Row(v, rng.attrs() if k == "hist" else {})
                for k, v in act_stats(to_f32(a), rng).items()}

    def _bounds_for(self, module: str) -> tuple[float, float] | None:
        return next((b for glob, b in self.act_bounds.items() if fnmatch.fnmatchcase(module, glob)), None)

    def _weight_row(self, name: str, w: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        data, encoding = encode(w, None if is_bf16(w) or w.dtype == np.float16 else "float32")
        return data, {"encoding": encoding, "source_dtype": w.dtype.name}
