"""The forensic pass: one ``dask.compute`` over the store, then every analysis.

:func:`analyze` opens the store, reads the small ``batches/*`` arrays once,
builds the Gram-matrix graph of every tensor (:mod:`gradforensics.analysis.engine.gram`),
with every selected analysis's gradient reductions (``Analysis.slab_reductions``)
folded into the same slab reads, and the extra lazy reductions of every selected
analysis (``Analysis.lazy``, never over gradients),
and computes all of them in **one** ``dask.compute`` - so each byte of the
store is read once and reads are shared.  With threads (the default) BLAS is
pinned to one thread per dask worker thread (threadpoolctl); under a
``dask.distributed`` client it is pinned on every worker.  Memory stays
bounded by slab size x workers, not by store size.

Then it builds the :class:`~gradforensics.analysis.engine.model.Context`, calls each
analysis's ``compute`` and ``flags`` in registry order, gathers
:class:`~gradforensics.analysis.engine.model.Findings` and persists them, with the Gram
matrices, under the store's ``analysis/`` group, so ``gradforensics report``
never re-reads gradients.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.engine.gram import (
    DEFAULT_SLAB_BYTES,
    DEFAULT_SPLIT_EVERY,
    PRECISIONS,
    SlabReduction,
    flatten_grams,
    gram_graph,
    save_grams,
    slab_graph,
)
from gradforensics.analysis.engine.model import Analysis, Context, Findings, GramResult
from gradforensics.errors import EmptyStoreError, SpecError
from gradforensics.store.reader import Store

if TYPE_CHECKING:
    from distributed import Client

ENGINE_KEY = "engine"


@dataclass(frozen=True)
class EngineOptions:
    """Options of the pass itself (``options={"engine": {...}}``).

    Attributes
    ----------
    slab_bytes
        Bytes of one dask chunk of a gradient array (all records x whole on-disk
        feature chunks).  Peak memory is about ``slab_bytes x workers``.
    split_every
        Fan-in of the Gram combine tree.
    precision
        ``"float32"`` products with float64 accumulation, or ``"float64"`` throughout.
    num_workers
        Threads of the local scheduler (default: CPU count).  Ignored under a client.
    persist
        Save the findings and Gram matrices in the store's ``analysis/`` group.
    """

    slab_bytes: int = DEFAULT_SLAB_BYTES
    split_every: int = DEFAULT_SPLIT_EVERY
    precision: str = "float32"
    num_workers: int | None = None
    persist: bool = True

    def __post_init__(self) -> None:
        if int(self.slab_bytes) < 1 << 16:
            raise SpecError(f"engine option slab_bytes must be >= 65536; got {self.slab_bytes}.")
        if int(self.split_every) < 2:
            raise SpecError(f"engine option split_every must be >= 2; got {self.split_every}.")
        if self.precision not in PRECISIONS:
            raise SpecError(f"engine option precision must be one of {PRECISIONS}; got {self.precision!r}.")
        if self.num_workers is not None and int(self.num_workers) < 1:
            raise SpecError(f"engine option num_workers must be >= 1; got {self.num_workers}.")


def select_analyses(only: str | Iterable[str] | None) -> list[Analysis]:
    """The analyses to run, in registry order; *only* restricts them (names or ``"a,b"``)."""
    from gradforensics.analysis import REGISTRY

    if only is None:
        return list(REGISTRY.values())
    names = [s.strip() for s in only.split(",")] if isinstance(only, str) else [str(s).strip() for s in only]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise SpecError(f"only= must name analyses among {sorted(REGISTRY)}; got {unknown or names!r}.")
    return [a for name, a in REGISTRY.items() if name in names]


def parse_options(options: Mapping[str, Any] | None, selected: list[Analysis]) -> tuple[EngineOptions, dict[str, Any]]:
    """Split ``options`` into :class:`EngineOptions` and per-analysis option dicts."""
    from gradforensics.analysis import REGISTRY

    options = dict(options or {})
    engine_raw = dict(options.pop(ENGINE_KEY, {}) or {})
    unknown = [k for k in options if k not in REGISTRY]
    if unknown:
        raise SpecError(f"options keys must be 'engine' or analyses among {sorted(REGISTRY)}; got {unknown!r}.")
    allowed = {f.name for f in fields(EngineOptions)}
    bad = sorted(set(engine_raw) - allowed)
    if bad:
        raise SpecError(f"engine options must be among {sorted(allowed)}; got {bad!r}.")
    return EngineOptions(**engine_raw), {k: dict(v or {}) for k, v in options.items()}


def analyze(path: str | os.PathLike[str] | Store, client: Client | None = None,
            only: str | Iterable[str] | None = None, options: Mapping[str, Any] | None = None,
            progress: bool = True) -> Findings:
    """Run the forensic pass over a store and return its :class:`Findings`.

    Parameters
    ----------
    path
        A ``*.zarr`` / ``*.h5`` store written by :class:`gradforensics.Recorder`
        (or an open :class:`~gradforensics.store.reader.Store`).
    client
        A ``dask.distributed.Client`` to run on (a LocalCluster, SLURM, ...).
        Default: the local threaded scheduler (or a default client, if one is set).
    only
        Names of the analyses to run (default: all, in registry order).
    options
        ``{"engine": {...}}`` (see :class:`EngineOptions`) and ``{name: {...}}``
        per analysis, handed to it as ``ctx.options[name]``.
    progress
        Show a progress bar (on stderr for threads; ``distributed.progress`` under a client).

    Returns
    -------
    Findings
        Tables, series and flags of every analysis; also saved in the store.

    Raises
    ------
    SpecError
        An unknown analysis or option.
    EmptyStoreError
        The store holds no committed record.
    """
    t0 = time.perf_counter()
    store = path if isinstance(path, Store) else Store(path)
    if store.n_records == 0:
        raise EmptyStoreError(f"{store.path}: the store holds no complete record; nothing to analyze.")
    selected = select_analyses(only)
    engine, per_analysis = parse_options(options, selected)
    batches = store.batches()
    grams, lazy = _compute_pass(store, selected, engine, client, progress)
    ctx = Context(store=store, meta=store.meta, batches=batches, grams=grams, lazy=lazy, options=per_analysis)
    results, flags = {}, []
    for a in selected:
        res = a.compute(ctx)
        results[a.name] = res
        flags.extend(a.flags(res, ctx))
    header = _header(store, batches, client, engine, time.perf_counter() - t0)
    findings = Findings(store=store.path, n_records=store.n_records, mode=store.mode, sources=store.sources,
                        header=header, results=results, flags=flags)
    if engine.persist:
        _persist(store, findings, grams)
    return findings


# ------------------------------------------------------------------ the pass
def _compute_pass(store: Store, selected: list[Analysis], engine: EngineOptions, client: Client | None,
                  progress: bool, grams: bool = True) -> tuple[dict[tuple[str, int | None], GramResult],
                                                             dict[str, Any]]:
    """Build every graph and compute them all in one go.

    Per tensor, one slab pass feeds its Gram matrices (when an analysis needs
    them and *grams*) and every analysis's slab reductions of that tensor.
    """
    keys: list[tuple[str, ...]] = []
    collections: list[Any] = []
    want_gram = grams and any("gram" in a.needs for a in selected)
    reductions = _slab_reductions(store, selected)
    opts: dict[str, Any] = {"slab_bytes": engine.slab_bytes, "split_every": engine.split_every, "precision": engine.precision}
    for tensor in store.tensors if want_gram else sorted(reductions):
        mine = reductions.get(tensor, [])
        if not mine:
            keys.append(("gram", tensor))
            collections.append(gram_graph(store, tensor, **opts))
            continue
        out: Any = slab_graph(store, tensor, [r for _, _, r in mine], gram=want_gram, **opts)
        if want_gram:
            keys.append(("gram", tensor))
            collections.append(out[0])
        for j, (aname, rkey, r) in enumerate(mine):
            keys.append(("lazy", aname, rkey))
            collections.append(out[1][j] if r.finish is None else r.finish(out[1][j]))
    for a in selected:
        if a.lazy is None:
            continue
        for name, coll in dict(a.lazy(store)).items():
            if ("lazy", a.name, name) in keys:
                raise SpecError(f"{a.name}: key {name!r} is returned by both lazy and slab_reductions.")
            keys.append(("lazy", a.name, name))
            collections.append(coll)
    values = _run(collections, client, progress, engine.num_workers) if collections else []
    gram_lists: dict[str, list[GramResult]] = {}
    lazy: dict[str, dict[str, Any]] = {a.name: {} for a in selected
                                       if a.lazy is not None or a.slab_reductions is not None}
    for key, val in zip(keys, values, strict=True):
        if key[0] == "gram":
            gram_lists[key[1]] = val
        else:
            lazy[key[1]][key[2]] = val
    return flatten_grams(gram_lists), lazy


def _slab_reductions(store: Store, selected: list[Analysis]) -> dict[str, list[tuple[str, str, SlabReduction]]]:
    """Every selected analysis's slab reductions, grouped by tensor: ``{tensor: [(analysis, key, reduction)]}``."""
    out: dict[str, list[tuple[str, str, SlabReduction]]] = {}
    for a in selected:
        if a.slab_reductions is None:
            continue
        for key, r in dict(a.slab_reductions(store)).items():
            out.setdefault(r.tensor, []).append((a.name, key, r))
    return out


def _run(collections: list[Any], client: Client | None, progress: bool, num_workers: int | None) -> list[Any]:
    """One compute of all *collections*, on *client* or the local scheduler."""
    import dask

    client = client if client is not None else _default_client()
    # dask 2026.8 (dask.compute and Client.compute alike) returns the results of mixed
    # Array / Delayed collections grouped by type, not in the order given, when it
    # optimizes the graph; keep the order by not optimizing a mixed list.
    optimize = len({type(c) for c in collections}) <= 1
    if client is not None:
        client.run(_pin_blas)
        futures = client.compute(collections, optimize_graph=optimize)
        if progress:
            from distributed import progress as dprogress

            dprogress(futures)
        return list(client.gather(futures))
    from threadpoolctl import threadpool_limits

    kwargs: dict[str, Any] = {}
    if dask.config.get("scheduler", None) is None:
        kwargs["scheduler"] = "threads"
        if num_workers:
            kwargs["num_workers"] = int(num_workers)
    with threadpool_limits(limits=1), _progress_bar(progress):
        return list(dask.compute(*collections, optimize_graph=optimize, **kwargs))


def _progress_bar(progress: bool) -> AbstractContextManager[Any]:
    if not progress:
        return nullcontext()
    from dask.diagnostics import ProgressBar

    return ProgressBar(minimum=1.0, out=sys.stderr)


def _default_client() -> Client | None:
    """The client dask would use anyway (one set as default), if distributed is loaded."""
    import dask

    if "distributed" not in sys.modules or dask.config.get("scheduler", None) is not None:
        return None
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


def _pin_blas() -> None:
    """One BLAS thread per worker thread (runs on each distributed worker)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1)


# ------------------------------------------------------------- header, save
def _header(store: Store, batches: dict[str, np.ndarray], client: Client | None, engine: EngineOptions,
            seconds: float) -> dict[str, Any]:
    mix = batches["mixture"]
    shares = {s: round(float(mix[:, i].mean()), 6) for i, s in enumerate(store.sources)}
    return {
        "store": store.path, "backend": store.kind, "model": dict(store.meta.model), "mode": store.mode,
        "records": store.n_records, "sources": shares, "framework": store.meta.framework,
        "created": store.meta.created,
        "tensors": {"full": len(store.grads), "sketch_only": len(set(store.sketches) - set(store.grads))},
        "bytes": int(sum(i.nbytes for i in store.grads.values())),
        "scheduler": "distributed" if client is not None else "threads",
        "engine": {"slab_bytes": engine.slab_bytes, "split_every": engine.split_every, "precision": engine.precision},
        "seconds": round(seconds, 3), "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    import dask
    import h5py
    import zarr

    from gradforensics import __version__

    return {"gradforensics": __version__, "python": sys.version.split()[0], "numpy": np.__version__,
            "dask": dask.__version__, "zarr": zarr.__version__, "h5py": h5py.__version__}


def _persist(store: Store, findings: Findings, grams: dict[tuple[str, int | None], GramResult]) -> None:
    """Save findings and Gram matrices under ``analysis/``, holding the store's writer lock.

    A store that is read-only, or that a live writer still holds, only warns: the
    findings are returned and reported either way.
    """
    from gradforensics.errors import StoreLockedError
    from gradforensics.store.lock import StoreLock

    try:
        with StoreLock(store.path):
            if grams:
                save_grams(store, grams)
            store.write_analysis(*findings.to_documents())
    except (PermissionError, StoreLockedError) as exc:
        warnings.warn(f"{store.path}: analysis results not saved in the store ({exc}); "
                      "`gradforensics report` will need a re-analysis.", stacklevel=3)


__all__ = ["EngineOptions", "analyze", "parse_options", "select_analyses"]
