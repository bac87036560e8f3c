"""The forensic pass: one ``dask.compute`` over the store, then every analysis.

:func:`analyze` opens the store, reads the small ``batches/*`` arrays once,
parses every selected analysis's options once, builds the Gram-matrix graph of
every tensor (:mod:`gradforensics.analysis.engine.gram`) when an analysis needs
:attr:`~gradforensics.analysis.contract.model.Need.GRAM`, with the gradient
reductions of every analysis that needs ``GRADS`` (``Analysis.slab_reductions``)
folded into the same slab reads, and the reductions of ``acts/*`` and
``weights/*`` of every analysis that needs ``ACTS`` or ``WEIGHTS``
(``Analysis.lazy``, never over gradients), and computes all of them in **one**
``dask.compute`` - so each byte of the
store is read once and reads are shared.  With threads (the default) BLAS is
pinned to one thread per dask worker thread (threadpoolctl); under a
``dask.distributed`` client it is pinned on every worker.  Memory stays
bounded by slab size x workers, not by store size.

Then it builds the :class:`~gradforensics.analysis.contract.model.Context`, calls each
analysis's ``compute`` and ``flags`` in registry order, gathers
:class:`~gradforensics.analysis.contract.model.Findings` and persists them, with the Gram
matrices, under the store's ``analysis/`` group, so ``gradforensics report``
never re-reads gradients.

:func:`analyze_series` is the other entry, behind ``gradforensics loss``: every
registered analysis with a ``series`` hook, on per-step series from a store's
``batches/*`` or a training log, no gradients read.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import Design, LongHistory
from gradforensics.analysis.contract.model import (
    Analysis,
    AnalysisResult,
    Context,
    Findings,
    Flag,
    GramResult,
    Need,
    Options,
)
from gradforensics.analysis.contract.registry import REGISTRY
from gradforensics.analysis.engine.gram import (
    DEFAULT_SLAB_BYTES,
    DEFAULT_SPLIT_EVERY,
    PRECISIONS,
    SlabReduction,
    flatten_grams,
    gram_graph,
    slab_outputs,
)
from gradforensics.analysis.engine.longhistory import BAND, N_WINDOWS, check_supported, design, long_graph, threshold
from gradforensics.analysis.engine.plan_small import OneSlab, fused_output, fused_outputs, one_slab
from gradforensics.analysis.engine.results import save_results
from gradforensics.analysis.engine.spill import GramSpill, SpilledGrams
from gradforensics.analysis.toolkit.parallel import unit_threads, worker_lost, workers_add_cores
from gradforensics.errors import EmptyStoreError, SpecError, WriteRefusedError
from gradforensics.store import remote
from gradforensics.store.backends import locate
from gradforensics.store.location import Location
from gradforensics.store.reader import Store

if TYPE_CHECKING:
    from distributed import Client

    from gradforensics.analysis.toolkit.series import SeriesGroup
    from gradforensics.store.schema import StoreMeta

ENGINE_KEY = "engine"


@dataclass(frozen=True)
class EngineOptions(Options):
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
    long_history
        ``N₀``: above this many records the pass never forms the N×N Gram matrix
        and computes the banded Gram and window-source sums instead
        (:mod:`~gradforensics.analysis.engine.longhistory`); 0 forces that regime.
        Default (None): ``min(4096, √(512 MiB / (8 · units)))``, units = the largest
        tensor's whole + heads (the Gram matrices held at once: the others are spilled,
        see ``spill``), so one tensor's Gram matrices fit 512 MiB.
    band
        Lags ``L`` of the banded Gram (long-history regime).
    windows
        Windows of the window-source sums (long-history regime): ``W = ceil(N / windows)``.
    spill
        Where the Gram matrices wait for the analyses (the exact regime's N×N ones, or the
        long-history regime's super-record ones): True on disk (a private directory under
        ``TMPDIR``, removed when the pass ends), False in memory, None (default) on disk
        when they exceed 64 MiB in all (:mod:`~gradforensics.analysis.engine.spill`).
    unit_statistics
        Under a ``dask.distributed`` client, where the per-unit statistics of conflict,
        oscillation and drift run: ``"workers"`` (shipped in batches), ``"client"`` (the
        client's threads), ``"auto"`` (default: on the workers when they bring cores the
        client lacks, :func:`~gradforensics.analysis.toolkit.parallel.workers_add_cores`).
    """

    slab_bytes: int = DEFAULT_SLAB_BYTES
    split_every: int = DEFAULT_SPLIT_EVERY
    precision: str = "float32"
    num_workers: int | None = None
    persist: bool = True
    long_history: int | None = None
    band: int = BAND
    windows: int = N_WINDOWS
    spill: bool | None = None
    unit_statistics: str = "auto"

    def __post_init__(self) -> None:
        if int(self.slab_bytes) < 1 << 16:
            raise SpecError(f"engine option slab_bytes must be >= 65536; got {self.slab_bytes}.")
        if int(self.split_every) < 2:
            raise SpecError(f"engine option split_every must be >= 2; got {self.split_every}.")
        if self.precision not in PRECISIONS:
            raise SpecError(f"engine option precision must be one of {PRECISIONS}; got {self.precision!r}.")
        if self.num_workers is not None and int(self.num_workers) < 1:
            raise SpecError(f"engine option num_workers must be >= 1; got {self.num_workers}.")
        if self.long_history is not None and int(self.long_history) < 0:
            raise SpecError(f"engine option long_history must be >= 0; got {self.long_history}.")
        if not 1 <= int(self.band) <= 1024:
            raise SpecError(f"engine option band must be in [1, 1024]; got {self.band}.")
        if not 4 <= int(self.windows) <= 4096:
            raise SpecError(f"engine option windows must be in [4, 4096]; got {self.windows}.")
        if self.spill is not None and not isinstance(self.spill, bool):
            raise SpecError(f"engine option spill must be true, false or null; got {self.spill!r}.")
        if self.unit_statistics not in UNIT_PLACES:
            raise SpecError(f"engine option unit_statistics must be one of {UNIT_PLACES}; "
                            f"got {self.unit_statistics!r}.")

    def n0(self, n_units: int) -> int:
        """``N₀`` of a store whose largest tensor has *n_units* units, whole + heads (:func:`~gradforensics.analysis.engine.longhistory.threshold`)."""
        return threshold(n_units, self.long_history)

    def long_regime(self, n_records: int, n_units: int = 1) -> bool:
        """Whether a pass over *n_records* records, largest tensor of *n_units* units, runs in the long-history regime."""
        return int(n_records) > self.n0(n_units)


def select_analyses(only: str | Iterable[str] | None, flag: str = "only=") -> list[Analysis]:
    """The analyses to run, in registry order; *only* restricts them (names or ``"a,b"``).

    *flag* is how the refusal names the restriction: ``only=`` for Python callers,
    ``--only`` for the command line.
    """
    if only is None:
        return list(REGISTRY.values())
    names = [s.strip() for s in only.split(",")] if isinstance(only, str) else [str(s).strip() for s in only]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(REGISTRY), n=1) if unknown else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise SpecError(f"{flag} must name analyses among {sorted(REGISTRY)}; got {unknown or names!r}{hint}.")
    return [a for name, a in REGISTRY.items() if name in names]


def split_options(options: Mapping[str, Any] | None,
                  selected: list[Analysis]) -> tuple[EngineOptions, dict[str, Options]]:
    """Split ``options`` into :class:`EngineOptions` and every selected analysis's parsed options.

    Each analysis's ``options[name]`` is parsed once, here, by its options class
    (:meth:`Options.parse`), before the store is read; those of analyses not
    selected are checked too.  Returns ``(engine, {name: options})`` with an entry
    for every selected analysis (its defaults where none were given).

    Raises
    ------
    SpecError
        A key that is neither ``"engine"`` nor a registered analysis, an unknown
        engine option, or bad options of an analysis.
    """
    options = dict(options or {})
    engine = EngineOptions.parse(options.pop(ENGINE_KEY, None), ENGINE_KEY)
    unknown = [k for k in options if k not in REGISTRY]
    if unknown:
        raise SpecError(f"options keys must be 'engine' or analyses among {sorted(REGISTRY)}; got {unknown!r}.")
    parsed = {k: REGISTRY[k].options.parse(v, k) for k, v in options.items()}
    return engine, {a.name: parsed[a.name] if a.name in parsed else a.options() for a in selected}


def analyze(path: str | os.PathLike[str] | Location | Store, client: Client | None = None,
            only: str | Iterable[str] | None = None, options: Mapping[str, Any] | None = None,
            progress: bool = True, *, storage_options: Mapping[str, Any] | None = None) -> Findings:
    """Run the forensic pass over a store and return its :class:`Findings`.

    Parameters
    ----------
    path
        A ``*.zarr`` / ``*.h5`` store written by :class:`gradforensics.Recorder`,
        an fsspec URL of a Zarr store (``s3://bucket/dump.zarr``), its
        :class:`~gradforensics.store.location.Location`, or an open
        :class:`~gradforensics.store.reader.Store`.
    client
        A ``dask.distributed.Client`` to run on (a LocalCluster, SLURM, ...).
        Default: the local threaded scheduler (or a default client, if one is set).
    only
        Names of the analyses to run (default: all, in registry order).
    options
        ``{"engine": {...}}`` (see :class:`EngineOptions`) and ``{name: {...}}``
        per analysis, parsed once by its options class before the store is read
        and handed to it as ``ctx.options[name]``.
    progress
        Show a progress bar (on stderr for threads; ``distributed.progress`` under a client).
    storage_options
        For a store at a URL: options of its file system (s3fs: ``endpoint_url``,
        ``key``, ``secret``, ``anon``, ...), used for every read, for the dask
        tasks and for writing the results back (as ``--storage-option`` on the
        command line).  A :class:`Store` given as *path* keeps the options it was
        opened with.

    Returns
    -------
    Findings
        Tables, series and flags of every analysis; also saved in the store.

    Raises
    ------
    SpecError
        An unknown analysis or option, or *storage_options* with a local path or an open :class:`Store`.
    EmptyStoreError
        The store holds no committed record.
    WriteRefusedError
        The exact regime was asked for (engine option ``long_history``), or an analysis
        that runs in no other is selected, and its Gram matrices do not fit the free
        space under ``TMPDIR`` (otherwise the pass falls back to the long-history regime
        then, with a one-line warning); or, in the long-history regime, spilling was asked
        for (engine option ``spill = true``) and its super-record Gram matrices do not fit
        there (otherwise they are held in memory, with a one-line warning).
    """
    with GramSpill() as spill:      # the Gram matrices spilled (either regime) on disk until the pass ends, error or not
        return _analyze(path, client, only, options, progress, storage_options, spill)


def _analyze(path: str | os.PathLike[str] | Location | Store, client: Client | None,
             only: str | Iterable[str] | None, options: Mapping[str, Any] | None, progress: bool,
             storage_options: Mapping[str, Any] | None, spill: GramSpill) -> Findings:
    t0 = time.perf_counter()
    client = client if client is not None else _default_client()    # resolved once: the pass, units and header agree
    store = _open(path, storage_options)
    writer = store.writer        # a store being written: analyse the committed prefix, say so in the header
    if store.n_records == 0:
        if writer is not None:
            raise EmptyStoreError(f"{store.path}: the store holds no complete record yet: it is being written by "
                                  f"{writer.describe()}; try again when records are committed.")
        raise EmptyStoreError(f"{store.path}: the store holds no complete record; nothing to analyze.")
    selected = select_analyses(only)
    engine, per_analysis = split_options(options, selected)
    batches = store.batches()
    grams, computed, long = _compute(store, selected, engine, client, progress, batches=batches, spill=spill)
    if progress:            # what follows the bar's 100 % takes a while on a big store: say what it is
        print("gradient pass done; computing the findings ...", file=sys.stderr,
              flush=True)
    ctx = Context(store=store, meta=store.meta, batches=batches, grams=grams, computed=computed,
                  options=per_analysis, long=long)
    results, flags = {}, []
    # the per-unit statistics on the pass's threads, or on the workers of the pass's client
    with unit_threads(engine.num_workers, _units_client(engine, client)):
        for a in selected:
            res = a.compute(ctx)
            results[a.name] = res
            flags.extend(_checked_flags(a, a.flags(res, ctx)))
    header = _header(store, batches, client, engine, time.perf_counter() - t0, long)
    if writer is not None:
        # the writer holds the lock the results are saved under: they are returned, not saved (no warning)
        header["partial"] = {"writer": writer.describe(), "pid": writer.pid, "host": writer.host,
                             "n_records": store.n_records, "saved": False}
    findings = Findings(store=store.path, n_records=store.n_records, mode=store.mode, sources=store.sources,
                        header=header, results=results, flags=flags)
    if engine.persist and writer is None:
        _persist(store, findings, grams, long is not None)
    return findings


def _open(path: str | os.PathLike[str] | Location | Store, storage_options: Mapping[str, Any] | None) -> Store:
    """*path* opened as a :class:`Store` (with *storage_options* for a URL), or the Store given."""
    if isinstance(path, Store):
        if storage_options is not None:
            raise SpecError("analyze(): storage_options are for a store at a URL (s3://bucket/dump.zarr); got an "
                            "open Store (it keeps the options it was opened with).")
        return path
    where = path.path if isinstance(path, Location) else os.fspath(path)
    if storage_options is not None and not remote.is_url(where):
        raise SpecError("analyze(): storage_options are for a store at a URL (s3://bucket/dump.zarr); got "
                        f"the local path {where!r}.")
    return Store(locate(path, storage_options))


def _checked_flags(a: Analysis, flags: list[Flag]) -> list[Flag]:
    """*flags* of analysis *a*, each of a kind it declares (else a ``ValueError``: a bug in *a*)."""
    for f in flags:
        if f.kind not in a.kinds:
            raise ValueError(f"analysis {a.name!r} returned a flag of kind {f.kind!r}; it declares kinds "
                             f"{sorted(a.kinds)} (Analysis(kinds=...)).")
    return flags


def analyze_series(groups: Sequence[SeriesGroup], meta: StoreMeta, options: Mapping[str, Any] | None = None, *,
                   store: Store | None = None,
                   batches: Mapping[str, np.ndarray] | None = None) -> tuple[dict[str, AnalysisResult], list[Flag]]:
    """Run every registered analysis that has a ``series`` hook on *groups*; its tables and flags.

    In registry order, each such analysis gets its own ``options[name]``, parsed
    once by its options class, then ``series(groups, options)``; a ``None``
    result (nothing to do on these series) gives no table and no flags.  Its
    ``flags(result, ctx)`` get a :class:`Context` holding *meta*, *store*,
    *batches* and the parsed options (no Gram matrices).

    Parameters
    ----------
    groups
        The series (:mod:`gradforensics.analysis.toolkit.series`: ``from_batches``; :mod:`gradforensics.logs`: ``read_logs``).
    meta
        The store's metadata, or for a log one made up for it (its ``mode`` decides
        what is flagged: no time-axis flags in ``replay``).
    options
        ``{name: {...}}`` per analysis (as for :func:`analyze`; no ``"engine"``).
    store, batches
        The store the series were read from and its ``batches/*``, when they were.

    Returns
    -------
    results, flags
        ``{name: AnalysisResult}`` and every flag, each of a kind its analysis declares.

    Raises
    ------
    SpecError
        An unknown analysis or option.
    """
    selected = [a for a in REGISTRY.values() if a.series is not None]
    _, per_analysis = split_options(options, selected)
    ctx = Context(store=store, meta=meta, batches=dict(batches or {}), grams={}, options=per_analysis)
    results: dict[str, AnalysisResult] = {}
    flags: list[Flag] = []
    for a in selected:
        res = a.series(groups, per_analysis[a.name]) if a.series is not None else None
        if res is not None:
            results[a.name] = res
            flags.extend(_checked_flags(a, a.flags(res, ctx)))
    return results, flags


# ------------------------------------------------------------------ the pass
def compute_pass(store: Store, selected: list[Analysis], engine: EngineOptions, client: Client | None,
                 progress: bool, grams: bool = True) -> tuple[dict[tuple[str, int | None], GramResult],
                                                            dict[str, Any]]:
    """Build every graph of *selected* over *store* and compute them all in one ``dask.compute``.

    Per tensor, one slab pass feeds its Gram matrices (when an analysis needs
    them and *grams*) and every analysis's slab reductions of that tensor.
    :func:`analyze` calls it once; tests and :mod:`gradforensics.testing` call it
    to run one analysis's reductions alone (``grams=False``).

    Returns
    -------
    grams, computed
        ``{(tensor, head): GramResult}`` and ``{analysis: {key: value}}`` of every
        ``lazy`` / ``slab_reductions`` result (what ``Context.grams`` and ``Context.computed`` hold).

    Raises
    ------
    SpecError
        An analysis returns the same key from ``lazy`` and ``slab_reductions``.
    """
    g, lazy, _ = _compute(store, selected, engine, client if client is not None else _default_client(), progress, grams)
    return dict(g), lazy


def _compute(store: Store, selected: list[Analysis], engine: EngineOptions, client: Client | None,
             progress: bool, grams: bool = True, batches: dict[str, np.ndarray] | None = None,
             spill: GramSpill | None = None,
             ) -> tuple[Mapping[tuple[str, int | None], GramResult], dict[str, Any], LongHistory | None]:
    """:func:`compute_pass`, plus the long-history results above ``N₀`` records (then no Gram matrix).

    With *spill* the exact regime's Gram matrices go to its directory as they are
    computed (:mod:`~gradforensics.analysis.engine.spill`) and the mapping returned
    reads them back one unit at a time.  *client* is the one the pass runs on, already
    resolved (None: the local threads; dask's default client is looked up once, by the caller).
    """
    keys: list[tuple[str, ...]] = []
    collections: list[Any] = []
    want_gram = grams and any(Need.GRAM in a.needs for a in selected)
    reductions = _slab_reductions(store, selected)
    opts: dict[str, Any] = {"slab_bytes": engine.slab_bytes, "split_every": engine.split_every, "precision": engine.precision}
    long_design = None
    n0 = first_n0 = engine.n0(units_at_once(store))
    if want_gram and store.n_records <= n0 and spill is not None:
        n0 = _start_spill(store, selected, engine, spill, n0)     # below N records: no room on disk
    if want_gram and store.n_records > n0:
        check_supported(selected, store.n_records, n0)    # before anything is read
        mix = (batches if batches is not None else store.batches())["mixture"]
        long_design = design(mix, engine.band, engine.windows)
        if spill is not None:
            _start_long_spill(store, engine, spill, long_design, fell_back=n0 < first_n0)
    sink = spill if spill is not None and spill.on_disk else None
    small: list[tuple[int, OneSlab]] = []      # one-slab tensors: read and reduced many a task (plan_small)
    for tensor in store.tensors if want_gram else sorted(reductions):
        mine = reductions.get(tensor, [])
        # a spilled pass fuses too under the local scheduler: the fused task writes each tensor's spill files
        one = None if long_design is not None or (sink is not None and client is not None) \
            else one_slab(store, tensor, [r for _, _, r in mine], want_gram, engine.slab_bytes,
                          None if sink is None or sink.directory is None else (sink.directory, len(keys)))
        if one is not None:
            small.append((len(keys), one))
            keys += ([("gram", tensor)] if want_gram else []) + [("lazy", a, k) for a, k, _ in mine]
            continue
        if long_design is not None:
            if mine and tensor not in store.grads:
                raise SpecError(f"{store.path}: slab reductions of {tensor} need grads/{tensor}.")
            out_l: Any = long_graph(store, tensor, long_design, tuple(r for _, _, r in mine),
                                    slab_bytes=engine.slab_bytes, split_every=engine.split_every)
            keys.append(("gram", tensor))
            collections.append(_spilled(out_l[0], sink, len(keys) - 1, client))
            for j, (aname, rkey, r) in enumerate(mine):
                keys.append(("lazy", aname, rkey))
                collections.append(out_l[1][j] if r.finish is None else r.finish(out_l[1][j]))
            continue
        if not mine:
            keys.append(("gram", tensor))
            collections.append(_spilled(gram_graph(store, tensor, **opts), sink, len(keys) - 1, client))
            continue
        g, parts = slab_outputs(store, tensor, [r for _, _, r in mine], gram=want_gram, **opts)
        if g is not None:
            keys.append(("gram", tensor))
            collections.append(_spilled(g, sink, len(keys) - 1, client))
        for j, (aname, rkey, r) in enumerate(mine):
            keys.append(("lazy", aname, rkey))
            collections.append(parts[j] if r.finish is None else r.finish(parts[j]))
    taken = {k for k in keys if k[0] == "lazy"}      # a set: a list's `in` per lazy key was keys x lazy keys
    for a in selected:
        if a.lazy is None:
            continue
        for name, coll in dict(a.lazy(store)).items():
            if ("lazy", a.name, name) in taken:
                raise SpecError(f"{a.name}: key {name!r} is returned by both lazy and slab_reductions.")
            keys.append(("lazy", a.name, name))
            collections.append(coll)
    arrive = {i: sink for i, k in enumerate(keys) if k[0] == "gram"} if sink is not None and client is not None \
        else None                                   # under a client: spilled as they come back
    fused = {first + j for first, one in small for j in range(one.n_outputs)}
    slots: list[int | list[int]] = [i for i in range(len(keys)) if i not in fused]   # one collection each
    slots, collections = _with_fused(small, slots, collections, engine.precision)
    values = _spread(_run(collections, client, progress, engine.num_workers, arrive) if collections else [],
                     slots, len(keys))
    gram_lists: dict[str, list[Any]] = {}
    lazy: dict[str, dict[str, Any]] = {a.name: {} for a in selected
                                       if a.lazy is not None or a.slab_reductions is not None}
    for key, val in zip(keys, values, strict=True):
        if key[0] == "gram":
            gram_lists[key[1]] = val
        else:
            lazy[key[1]][key[2]] = val
    if long_design is not None:
        longs = {(g.tensor, g.head): g for res in gram_lists.values() for g in res}
        return {}, lazy, LongHistory(long_design, longs, n0)
    return (flatten_grams(gram_lists) if sink is None else sink.grams(gram_lists)), lazy, None


def _with_fused(small: list[tuple[int, OneSlab]], slots: list[int | list[int]], collections: list[Any],
                precision: str) -> tuple[list[int | list[int]], list[Any]]:
    """*collections* with the fused tasks of the one-slab tensors *small* appended; *slots*: where each
    collection's value goes among the pass's keys (a fused task's list of values: one key each, -1 for a
    reduction's aggregate that goes on through its ``finish``, a collection of its own appended after)."""
    where = dict((id(one), first) for first, one in small)
    finished: list[tuple[int, Any]] = []
    for coll, group in fused_outputs([one for _, one in small], precision):
        slot: list[int] = []
        for one in group:
            for j in range(one.n_outputs):
                r = one.reductions[j - int(one.gram)] if j >= int(one.gram) else None
                if r is not None and r.finish is not None:
                    finished.append((where[id(one)] + j, r.finish(fused_output(coll, len(slot)))))
                    slot.append(-1)
                else:
                    slot.append(where[id(one)] + j)
        collections.append(coll)
        slots.append(slot)
    for at, coll in finished:
        collections.append(coll)
        slots.append(at)
    return slots, collections


def _spread(values: list[Any], slots: list[int | list[int]], n: int) -> list[Any]:
    """The value of each of the pass's *n* keys from the collections' *values* (placed by *slots*)."""
    out: list[Any] = [None] * n
    for slot, val in zip(slots, values, strict=True):
        if isinstance(slot, list):
            for i, v in zip(slot, val, strict=True):
                if i >= 0:
                    out[i] = v
        else:
            out[slot] = val
    return out


def _spilled(collection: Any, sink: GramSpill | None, slot: int, client: Client | None) -> Any:
    """One tensor's Gram collection, written to *sink* by a task of its own under the local scheduler."""
    return collection if sink is None or client is not None else sink.wrap(collection, slot)


def _start_spill(store: Store, selected: list[Analysis], engine: EngineOptions, spill: GramSpill, n0: int) -> int:
    """``N₀`` of the pass: *n0*, or - ``TMPDIR`` lacks room for the exact Gram matrices - the records it has room for.

    Falls back (with a one-line warning) only where nothing asked for the exact regime and
    every selected analysis runs in the long one; otherwise refuses in one line.
    """
    short = spill.start(n_units(store), store.n_records, engine.spill)
    if short is None:
        return n0
    what, fit = short
    bad = [a.name for a in selected if not a.long_history]
    if engine.long_history is not None or bad:
        why = (f"{', '.join(bad)} cannot run in the long-history regime" if bad
               else f"the exact regime was asked for (engine option long_history = {engine.long_history:,})")
        raise WriteRefusedError(f"{store.path}: {what}, and {why}; point TMPDIR at a disk with room, or hold "
                                "them in memory with options={'engine': {'spill': False}}.")
    warnings.warn(f"{store.path}: {what}: running the long-history regime instead (N₀ = {fit:,} for this "
                  "pass); point TMPDIR at a disk with room for the exact one.", stacklevel=5)
    return min(n0, fit)


def _start_long_spill(store: Store, engine: EngineOptions, spill: GramSpill, d: Design, fell_back: bool) -> None:
    """Spill the long-history regime's super-record Gram matrices (``m²`` float64 a unit) where they are large.

    Where ``TMPDIR`` lacks the room they stay in memory, with a one-line warning
    (silently where the pass just fell back from the exact regime for the same lack,
    and said so); where spilling was asked for (engine option ``spill = true``) the
    pass refuses in one line instead, before anything is read.
    """
    kept = int(np.count_nonzero(d.weights() > 0))
    short = spill.start(n_units(store), kept, engine.spill, what="the long-history regime's super-record Gram "
                        "matrices", rows="super-records")
    if short is None or fell_back:
        return
    what = short[0]
    if engine.spill:
        raise WriteRefusedError(f"{store.path}: {what}, and spilling them was asked for (engine option spill = "
                                "true); point TMPDIR at a disk with room, or hold them in memory with "
                                "options={'engine': {'spill': False}}.")
    warnings.warn(f"{store.path}: {what}: holding them in memory instead; point TMPDIR at a disk with room.",
                  stacklevel=5)


def n_units(store: Store) -> int:
    """Tensors and heads of *store* the Gram pass covers (one Gram matrix each in the exact regime)."""
    return sum(_units_of(store, t) for t in store.tensors)


def units_at_once(store: Store) -> int:
    """Units (whole + heads) of *store*'s largest tensor: the Gram matrices the exact regime holds at once per thread."""
    return max((_units_of(store, t) for t in store.tensors), default=1)


def _units_of(store: Store, tensor: str) -> int:
    info = store.grads[tensor] if tensor in store.grads else store.sketches[tensor]
    return 1 + (int(info.shape[1]) if info.heads is not None else 0)


def _slab_reductions(store: Store, selected: list[Analysis]) -> dict[str, list[tuple[str, str, SlabReduction]]]:
    """Every selected analysis's slab reductions, grouped by tensor: ``{tensor: [(analysis, key, reduction)]}``."""
    out: dict[str, list[tuple[str, str, SlabReduction]]] = {}
    for a in selected:
        if a.slab_reductions is None:
            continue
        for key, r in dict(a.slab_reductions(store)).items():
            out.setdefault(r.tensor, []).append((a.name, key, r))
    return out


def _run(collections: list[Any], client: Client | None, progress: bool, num_workers: int | None,
         arrive: Mapping[int, GramSpill] | None = None) -> list[Any]:
    """One compute of all *collections*, on *client* or the local scheduler.

    Under a client, the results of the collections in *arrive* are handed to their
    spill as each comes back (one at a time), never gathered all together.
    """
    import dask

    # dask 2026.8 (dask.compute and Client.compute alike) returns the results of mixed
    # Array / Delayed collections grouped by type, not in the order given, when it
    # optimizes the graph; keep the order by not optimizing a mixed list.
    optimize = len({type(c) for c in collections}) <= 1
    # Delayed graphs (the Gram and slab passes) are built with exactly the tasks they need:
    # culling thousands of their layers cost more than running a small store's pass.
    from dask.delayed import Delayed

    if all(isinstance(c, Delayed) for c in collections):
        optimize = False
    if client is not None:
        client.run(_pin_blas)
        futures = client.compute(collections, optimize_graph=optimize)
        if progress:
            from distributed import progress as dprogress

            dprogress(futures)
        from distributed.scheduler import KilledWorker

        try:
            if arrive:
                return _gather_spilling(futures, arrive)
            return list(client.gather(futures))
        except KilledWorker as exc:            # killed past its memory limit, say: one line, not dask's traceback
            raise worker_lost(exc, "the Gram pass") from None
    from threadpoolctl import threadpool_limits

    kwargs: dict[str, Any] = {}
    if dask.config.get("scheduler", None) is None:
        # the threaded scheduler itself, not its name: dask looks a name up only after importing
        # distributed to ask for a client (0.4-0.5 s), and _default_client found none
        from dask.threaded import get as threaded_get

        kwargs["scheduler"] = threaded_get
        if num_workers:
            kwargs["num_workers"] = int(num_workers)
    with threadpool_limits(limits=1), _progress_bar(progress):
        return list(dask.compute(*collections, optimize_graph=optimize, **kwargs))


def _gather_spilling(futures: list[Any], arrive: Mapping[int, GramSpill]) -> list[Any]:
    """The values of *futures* as they complete; those in *arrive* written to their spill first."""
    from distributed import as_completed

    at: dict[str, list[int]] = {}
    for i, f in enumerate(futures):
        at.setdefault(f.key, []).append(i)
    values: list[Any] = [None] * len(futures)
    for fut in as_completed(futures):
        val = fut.result()
        for i in at.pop(fut.key, []):
            values[i] = arrive[i].arrive(i, val) if i in arrive else val
            futures[i] = None          # the worker may drop it now
        del fut, val
    return values


def _progress_bar(progress: bool) -> AbstractContextManager[Any]:
    if not progress:
        return nullcontext()
    from dask.diagnostics import ProgressBar

    return ProgressBar(minimum=1.0, out=sys.stderr)


UNIT_PLACES = ("auto", "workers", "client")
"""Values of the engine option ``unit_statistics``."""


def _units_client(engine: EngineOptions, client: Client | None) -> Client | None:
    """The client :func:`map_units` ships the per-unit statistics to, or None (the client's threads)."""
    if client is None or engine.unit_statistics == "client":
        return None
    return client if engine.unit_statistics == "workers" or workers_add_cores(client) else None


def _default_client() -> Client | None:
    """The client dask would use anyway (one set as default), if distributed is loaded.

    A ``Client`` made the default sets dask's ``scheduler`` to ``"dask.distributed"``; any
    other scheduler set in dask's config (``"synchronous"``, ``"threads"``, a callable) is
    respected: no client then.
    """
    import dask

    if "distributed" not in sys.modules or dask.config.get("scheduler", None) not in (None, "dask.distributed",
                                                                                       "distributed"):
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
            seconds: float, long: LongHistory | None = None) -> dict[str, Any]:
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
        "regime": long.header() if long is not None else {"name": "exact", "n0": engine.n0(units_at_once(store))},
        "seconds": round(seconds, 3), "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    import dask
    import zarr

    from gradforensics._version import __version__

    return {"gradforensics": __version__, "python": sys.version.split()[0], "numpy": np.__version__,
            "dask": dask.__version__, "zarr": zarr.__version__, "h5py": _h5py_version()}


def _h5py_version() -> str:
    """``h5py.__version__`` without importing h5py for a Zarr store (0.15-0.4 s): its installed version."""
    if "h5py" not in sys.modules:
        from importlib import metadata

        try:
            return metadata.version("h5py")
        except metadata.PackageNotFoundError:
            pass
    import h5py

    return str(h5py.__version__)


def _persist(store: Store, findings: Findings, grams: Mapping[tuple[str, int | None], GramResult],
             long: bool = False) -> None:
    """Save findings and Gram matrices under ``analysis/``, holding the store's writer lock.

    In the long-history regime no per-record Gram matrix exists: an empty Gram
    index is saved (``load_grams`` then returns ``{}``) so none from an earlier
    pass is left behind.  A spilled pass's files are removed as their matrices are
    written into the store (the pass's disk holds one copy of them at a time; the
    analyses are done by then).

    A store that is read-only, or that a live writer still holds, only warns: the
    findings are returned and reported either way.
    """
    from gradforensics.errors import StoreLockedError

    try:
        save_results(store.location, findings, grams, n_records=store.n_records, empty_grams=long,
                     release=grams.release if isinstance(grams, SpilledGrams) else None)
    except (PermissionError, StoreLockedError) as exc:
        warnings.warn(f"{store.path}: analysis results not saved in the store ({exc}); "
                      "`gradforensics report` will need a re-analysis.", stacklevel=3)


__all__ = ["EngineOptions", "analyze", "analyze_series", "compute_pass", "select_analyses", "split_options"]
