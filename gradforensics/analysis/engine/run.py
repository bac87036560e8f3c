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

import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import GramResult, LongHistory
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Findings, Flag
from gradforensics.analysis.contract.registry import REGISTRY
from gradforensics.analysis.engine.options import EngineOptions, select_analyses, split_options
from gradforensics.analysis.engine.plan import plan_pass, units_at_once
from gradforensics.analysis.engine.results import grams_to_save, save_results
from gradforensics.analysis.engine.schedule import compute_collections, default_client, units_client
from gradforensics.analysis.engine.spill import GramSpill, SpilledGrams
from gradforensics.analysis.toolkit.parallel import unit_threads
from gradforensics.errors import EmptyStoreError, SpecError
from gradforensics.store import remote
from gradforensics.store.backends import locate
from gradforensics.store.location import Location
from gradforensics.store.reader import Store

if TYPE_CHECKING:
    from distributed import Client

    from gradforensics.analysis.contract.series import SeriesGroup
    from gradforensics.runlog import RunLog
    from gradforensics.store.schema import StoreMeta

Grams = Mapping[tuple[str, int | None], GramResult]


def analyze(path: str | os.PathLike[str] | Location | Store, client: Client | None = None,
            only: str | Iterable[str] | None = None, options: Mapping[str, Any] | None = None,
            progress: bool = True, *, storage_options: Mapping[str, Any] | None = None,
            baseline: str | os.PathLike[str] | Location | Store | None = None,
            logs: str | os.PathLike[str] | None = None) -> Findings:
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
        ``{"engine": {...}}`` (:class:`~gradforensics.analysis.engine.options.EngineOptions`) and
        ``{name: {...}}`` per analysis, parsed once before the store is read (``ctx.options[name]``).
    progress
        Show a progress bar (on stderr for threads; ``distributed.progress`` under a client).
    storage_options
        For a store at a URL: options of its file system (s3fs: ``endpoint_url``,
        ``key``, ``secret``, ``anon``, ...), used for every read, for the dask
        tasks and for writing the results back (as ``--storage-option`` on the
        command line).  A :class:`Store` given as *path* keeps the options it was
        opened with.
    baseline
        An earlier healthy window or run of the same model (a store, as *path*; a URL takes
        *storage_options* too): each finding is judged against the baseline's same finding, and
        one it shows as strongly is context, below 0.5 (:mod:`~gradforensics.analysis.engine.baseline`).
        Its saved results are used when current, else it is analysed with the same analyses and
        options.  The header (and ``flags.json``) records it.
    logs
        The run's own logs (a directory of TensorBoard event files, one event file, or a
        ``trainer_state.json``: :func:`~gradforensics.runlog.read_run_log`), read before the store:
        their loss scale, gradient norm, learning rate and skipped iterations are joined to the
        records by step for the timeline only (``Context.run_log``; the store is not modified, the
        baseline pass does not get them).

    Returns
    -------
    Findings
        Tables, series and flags of every analysis; also saved in the store.

    Raises
    ------
    SpecError
        An unknown analysis or option, or *storage_options* with a local path or an open :class:`Store`.
    LogReadError
        *logs* unreadable, or holding none of the series it is read for (one line).
    EmptyStoreError
        The store holds no committed record.
    ModelMismatchError
        The baseline shares no gradient tensor with the store (another model).
    WriteRefusedError
        The exact regime was asked for (engine option ``long_history``), or an analysis
        that runs in no other is selected, and its Gram matrices do not fit the free
        space under ``TMPDIR`` (otherwise the pass falls back to the long-history regime
        then, with a one-line warning); or, in the long-history regime, spilling was asked
        for (engine option ``spill = true``) and its super-record Gram matrices do not fit
        there (otherwise they are held in memory, with a one-line warning).
    """
    run_log = None
    if logs is not None:            # outside input: read (and refused) before the store is opened
        from gradforensics.runlog import read_run_log

        run_log = read_run_log(logs)
    store = _open(path, storage_options)
    judge = None
    if baseline is not None:
        judge = _baseline_judge(store, baseline, storage_options, client, only, options, progress)
    with GramSpill() as spill:      # the Gram matrices spilled (either regime) on disk until the pass ends, error or not
        return _analyze(store, client, only, options, progress, None, spill, judge, run_log)


def _baseline_judge(store: Store, baseline: str | os.PathLike[str] | Location | Store,
                    storage_options: Mapping[str, Any] | None, client: Client | None,
                    only: str | Iterable[str] | None, options: Mapping[str, Any] | None,
                    progress: bool) -> Callable[[Findings], Findings]:
    """The baseline opened and checked (before any gradient is read); the function that judges the findings."""
    from gradforensics.analysis.engine import baseline as judged

    where = baseline.path if isinstance(baseline, Location) else None if isinstance(baseline, Store) \
        else os.fspath(baseline)
    base = _open(baseline, storage_options if where is not None and remote.is_url(where) else None)
    judged.check_tensors(store, base)

    def pass_(s: Store) -> Findings:
        return analyze(s, client=client, only=only, options=options, progress=progress)

    def judge(findings: Findings) -> Findings:
        base_findings, reused = judged.findings_of(base, set(findings.results), pass_, options)
        return judged.judge(findings, base_findings, judged.name_of(base), store=base.path, reused=reused)

    return judge


def _analyze(path: str | os.PathLike[str] | Location | Store, client: Client | None,
             only: str | Iterable[str] | None, options: Mapping[str, Any] | None, progress: bool,
             storage_options: Mapping[str, Any] | None, spill: GramSpill,
             judge: Callable[[Findings], Findings] | None = None, run_log: RunLog | None = None) -> Findings:
    t0 = time.perf_counter()
    client = client if client is not None else default_client()    # resolved once: the pass, units and header agree
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
    grams, computed, long = run_pass(store, selected, engine, client, progress, batches=batches, spill=spill)
    if progress:            # what follows the bar's 100 % takes a while on a big store: say what it is
        print(f"gradient pass done; computing the findings of {os.path.basename(store.path.rstrip('/')) or store.path}"
              " ...", file=sys.stderr, flush=True)
    ctx = Context(store=store, meta=store.meta, batches=batches, grams=grams, computed=computed,
                  options=per_analysis, long=long, run_log=_joined(run_log, batches, store.n_records))
    results, flags = {}, []
    # the per-unit statistics on the pass's threads, or on the workers of the pass's client
    with unit_threads(engine.num_workers, units_client(engine, client)):
        for a in selected:
            res = a.compute(ctx)
            results[a.name] = res
            flags.extend(_checked_flags(a, a.flags(res, ctx)))
    header = _header(store, batches, client, engine, time.perf_counter() - t0, long)
    if writer is not None:
        # the writer holds the lock the results are saved under: they are returned, not saved (no warning)
        header["partial"] = {"writer": writer.describe(), "pid": writer.pid, "host": writer.host,
                             "n_records": store.n_records, "saved": False}
    header["analyses"] = {a.name: header["finished"] for a in selected}     # which analysis ran when
    findings = Findings(store=store.path, n_records=store.n_records, mode=store.mode, sources=store.sources,
                        header=header, results=results, flags=flags,
                        not_judged=[n for name in sorted(results) for n in results[name].not_judged])
    if judge is not None:                   # analyze(..., baseline=): each finding against the baseline's
        findings = judge(findings)
    if engine.persist and writer is None:
        _persist(store, merged(store, findings, selected), grams, long is not None, engine.save_grams)
    return findings


def _joined(run_log: RunLog | None, batches: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """The run's logs joined to the *n* records by ``batches/step``, named as ``import --logs`` names them
    (``Context.run_log``); empty without logs."""
    if run_log is None:
        return {}
    steps = np.asarray(batches.get("step", np.arange(n)), np.int64)
    names = {"grad_norm": "logged_grad_norm"}
    return {names.get(k, k): v for k, v in run_log.join(steps).items() if k != "loss"}


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
    grams_, computed, _ = run_pass(store, selected, engine, client if client is not None else default_client(),
                                   progress, grams)
    return dict(grams_), computed


def run_pass(store: Store, selected: list[Analysis], engine: EngineOptions, client: Client | None,
             progress: bool, grams: bool = True, batches: dict[str, np.ndarray] | None = None,
             spill: GramSpill | None = None) -> tuple[Grams, dict[str, Any], LongHistory | None]:
    """:func:`compute_pass`, plus the long-history results above ``N₀`` records (then no Gram matrix).

    Plan (:func:`~gradforensics.analysis.engine.plan.plan_pass`), one compute
    (:func:`~gradforensics.analysis.engine.schedule.compute_collections`), unpack
    (:meth:`~gradforensics.analysis.engine.plan.Plan.unpack`).  With *spill* the exact
    regime's Gram matrices go to its directory as they are computed
    (:mod:`~gradforensics.analysis.engine.spill`) and the mapping returned reads them back
    one unit at a time.  *client* is the one the pass runs on, already resolved (None: the
    local threads; dask's default client is looked up once, by the caller).
    """
    plan = plan_pass(store, selected, engine, client, grams, batches, spill)
    values = compute_collections(plan.collections, client, progress, engine.num_workers, plan.arrive) \
        if plan.collections else []
    return plan.unpack(values)


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
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def merged(store: Store, findings: Findings, selected: list[Analysis]) -> Findings:
    """*findings* of a partial pass (``only=``) merged into the results the store holds committed.

    The analyses that ran replace their own tables, series, flags and ``not_judged``; every other
    analysis the committed results hold is kept, with the time it ran (header ``analyses``).  Nothing
    is kept when the committed results describe another store state (another record count or mode),
    when there are none, or when they cannot be read (the new pass replaces them, as before).
    """
    ran = {a.name for a in selected}
    if ran >= set(REGISTRY):
        return findings
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.errors import GradforensicsError

    try:
        old = read_findings(store)
    except (GradforensicsError, OSError, KeyError, ValueError):
        return findings                     # none committed, or unreadable: the new pass replaces them
    if old.n_records != findings.n_records or old.mode != findings.mode:
        return findings
    kept = {name: res for name, res in old.results.items() if name not in ran}
    if not kept:
        return findings
    kinds_ran = {k for a in selected for k in a.kinds}
    flags = findings.flags + [f for f in old.flags if f.kind not in kinds_ran]
    when = old.header.get("analyses")
    when = when if isinstance(when, dict) else {}
    header = dict(findings.header)
    header["analyses"] = {**{name: str(when.get(name, old.header.get("finished", "before"))) for name in kept},
                          **findings.header.get("analyses", {})}
    results = {**kept, **findings.results}
    return Findings(store=findings.store, n_records=findings.n_records, mode=findings.mode,
                    sources=findings.sources, header=header, results=results, flags=flags,
                    not_judged=[n for name in sorted(results) for n in results[name].not_judged])


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
             long: bool = False, which: str = "flagged") -> None:
    """Save findings and Gram matrices under ``analysis/``, holding the store's writer lock.

    Of the Gram matrices, those *which* says (engine option ``save_grams``: by default
    the units of the flags the records map is drawn for, :func:`grams_to_save`); the
    index saved lists those, so none from an earlier pass is left behind.  In the
    long-history regime no per-record Gram matrix exists: an empty Gram index is saved
    (``load_grams`` then returns ``{}``).  A spilled pass's files are removed as their
    matrices are written into the store, the rest when the pass ends (the pass's disk
    holds one copy of them at a time; the analyses are done by then).

    A store that is read-only, or that a live writer still holds, only warns: the
    findings are returned and reported either way.
    """
    from gradforensics.errors import StoreLockedError

    try:
        save_results(store.location, findings, grams_to_save(grams, findings, which), n_records=store.n_records,
                     empty_grams=long,
                     release=grams.release if isinstance(grams, SpilledGrams) else None)
    except (PermissionError, StoreLockedError) as exc:
        warnings.warn(f"{store.path}: analysis results not saved in the store ({exc}); "
                      "`gradforensics report` will need a re-analysis.", stacklevel=3)


__all__ = ["analyze", "analyze_series", "compute_pass", "run_pass"]
