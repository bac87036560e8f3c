"""The types every analysis shares: :class:`Analysis` (with its :class:`Need`), :class:`Flag`,
:class:`Context`, :class:`AnalysisResult`, :class:`Findings`; an analysis's options and its kinds'
advice: :mod:`~gradforensics.analysis.contract.options`, :mod:`~gradforensics.analysis.contract.advice`.

An analysis is one module exposing ``ANALYSIS = Analysis(...)`` (see
``gradforensics/analysis/__init__.py`` for the registry).  The engine parses each
selected analysis's options once, builds one :class:`Context` per pass (batch
metadata, the Gram matrix of every tensor and head, and the values of each
analysis's own graphs, all computed in one ``dask.compute``), calls
``compute(ctx)`` and ``flags(result, ctx)`` of each analysis, and gathers
everything in :class:`Findings`, which the report reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.grams import GramResult, LongHistory, SlabReduction
from gradforensics.analysis.contract.options import NoOptions, Options, OptionsT
from gradforensics.analysis.contract.timeline import NAME as TIMELINE
from gradforensics.analysis.contract.timeline import timeline_document

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.series import SeriesGroup
    from gradforensics.store.reader import Store
    from gradforensics.store.schema import StoreMeta

class Need(StrEnum):
    """What an analysis needs the engine to do for it before ``compute(ctx)``.

    Every analysis gets ``batches/*`` (loss, step, mixture, ...): the engine reads
    them once for every pass, so they are not a need.

    * ``GRAM`` - the Gram pass: ``ctx.grams[(tensor, head)]`` (one streaming read of
      every gradient; skipped when no selected analysis needs it);
    * ``GRADS`` - reductions of stored gradients run inside that same read of each
      slab: the engine calls the analysis's ``slab_reductions(store)``;
    * ``ACTS``, ``WEIGHTS`` - reductions of ``acts/*`` or ``weights/*`` snapshots:
      the engine calls the analysis's ``lazy(store)`` and computes its graphs in
      the pass's single ``dask.compute``.

    :class:`Analysis` checks the hooks against the needs: ``slab_reductions``
    if and only if ``GRADS``, ``lazy`` if and only if ``ACTS`` or ``WEIGHTS``.
    """

    GRAM = "gram"
    GRADS = "grads"
    ACTS = "acts"
    WEIGHTS = "weights"


@dataclass(frozen=True)
class Flag:
    """One finding about one tensor (or head, module, series), as in ``flags.json``.

    ``severity`` is in [0, 1] and comparable across kinds: a healthy run yields
    no flag above 0.5.  ``records`` is the inclusive record range the finding
    covers (``[since, last]``).
    """

    kind: str
    tensor: str
    head: int | None
    sources: tuple[str, ...]
    severity: float
    records: tuple[int, int]
    evidence: Mapping[str, Any]
    summary: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"Flag kind must be a non-empty string; got {self.kind!r}.")
        if not (0.0 <= self.severity <= 1.0) or math.isnan(self.severity):
            raise ValueError(f"Flag severity must be in [0, 1]; got {self.severity!r} ({self.kind}, {self.tensor}).")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "tensor": self.tensor,
            "head": None if self.head is None else int(self.head),
            "sources": list(self.sources), "severity": round(float(self.severity), 4),
            "records": [int(self.records[0]), int(self.records[1])],
            "evidence": {k: _plain(v) for k, v in self.evidence.items()},
            "summary": self.summary,
        }


def _plain(v: Any) -> Any:
    """JSON-safe value: numpy scalars to Python, NaN/inf to None."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@dataclass
class Context:
    """Everything an analysis's ``compute`` and ``flags`` may use; built once per pass.

    ``grams`` holds the Gram matrices (when a selected analysis needs
    :attr:`Need.GRAM`): a read-only mapping ``{(tensor, head): GramResult}``.  On a
    big pass its matrices wait on disk and each ``grams[key]`` reads one back
    (:mod:`~gradforensics.analysis.engine.spill`), so take one unit at a time
    (``for key in grams: g = grams[key]``) and do not keep them all in a list;
    ``computed[name]`` the values of analysis *name*'s
    ``lazy`` graphs and ``slab_reductions`` (by their keys); ``options[name]`` its
    parsed options (read them with :meth:`options_for`).

    The series pass (:func:`~gradforensics.analysis.engine.run.analyze_series`,
    behind ``gradforensics loss``) builds one for the ``flags`` of the analyses
    with a ``series`` hook: ``meta`` and ``options`` as above, no Gram matrices,
    and ``store`` None (``batches`` empty) when the series come from a log.

    Above ``N₀`` records (the long-history regime) ``grams`` is empty and ``long``
    holds, per tensor and head, the band test's window moments, the super-record Gram
    matrix and the non-finite records
    (:class:`~gradforensics.analysis.contract.grams.LongHistory`).

    ``run_log`` holds the run's own logs joined to the records by step (``analyze --logs DIR``,
    :meth:`~gradforensics.runlog.RunLog.join`), named as an import with ``--logs`` names them in
    ``batches/*`` (``loss_scale``, ``logged_grad_norm``, ``lr``, ``skipped``), NaN (False) where a
    record's step was not logged; empty without logs.  Only the timeline reads it.
    """

    store: Store | None
    meta: StoreMeta
    batches: dict[str, np.ndarray]
    grams: Mapping[tuple[str, int | None], GramResult]
    computed: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    long: LongHistory | None = None
    run_log: dict[str, np.ndarray] = field(default_factory=dict)
    #: what several analyses derive alike from this context, computed once (the loss-curve
    #: analyses' series, by axis: :func:`~gradforensics.analysis.toolkit.series.from_context`)
    shared: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def options_for(self, name: str, cls: type[OptionsT]) -> OptionsT:
        """The options of analysis *name*: what the engine parsed, or *cls*'s defaults.

        Raises
        ------
        TypeError
            ``options[name]`` is not a parsed *cls* (whoever built the context
            must parse it: ``cls.parse(raw, name)``).
        """
        value = self.options.get(name)
        if value is None:
            return cls()
        if not isinstance(value, cls):
            raise TypeError(f"Context.options[{name!r}] must be a parsed {cls.__name__} ({cls.__name__}.parse(raw, "
                            f"{name!r})); got {type(value).__name__}.")
        return value

    def super_records(self) -> Context:
        """This context seen through the long-history super-records (what drift, conflict and noise compute on).

        Requires :attr:`long`: the per-window, per-source mean gradients replace the
        records (``meta.n_records``, ``batches``, ``grams``), and ``long`` is cleared.
        """
        import dataclasses

        if self.long is None:
            raise ValueError("super_records() is for the long-history regime (ctx.long is None).")
        long = self.long
        meta = dataclasses.replace(self.meta, n_records=int(long.kept().size))
        return dataclasses.replace(self, meta=meta, batches=long.super_batches(self.batches),
                                   grams=long.super_grams(), long=None)

    def require_store(self) -> Store:
        """The store of this pass.

        Raises
        ------
        SpecError
            There is none: the series pass on a training log (an analysis whose
            ``flags`` reads the store cannot run on a log).
        """
        if self.store is None:
            from gradforensics.errors import SpecError

            raise SpecError("this analysis reads the store, and it runs on series from a log (no store); "
                            "run it with `gradforensics analyze STORE`.")
        return self.store

    @property
    def n_records(self) -> int:
        return int(self.meta.n_records)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.meta.sources)

    def source_of_record(self) -> np.ndarray:
        """Index of each record's source, or -1 where the batch mixes sources."""
        mix = self.batches["mixture"]
        idx = np.argmax(mix, axis=1)
        pure = np.isclose(mix.max(axis=1), 1.0)
        return np.where(pure, idx, -1)


@dataclass(frozen=True)
class NotJudged:
    """What an analysis could not judge on this store: a kind of flag that could not have fired.

    ``kind`` is the flag kind, ``reason`` what the store holds too little of (``"2 records per
    source (zh 2, en 2)"``), ``needed`` what would let it judge (``"≥ 4 records per source"``).
    The report's verdict and ``flags.json`` (``not_judged``) carry it, so a run with too little
    evidence never reads as an all-clear.
    """

    kind: str
    reason: str
    needed: str

    def __post_init__(self) -> None:
        for name in ("kind", "reason", "needed"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"NotJudged {name} must be a non-empty string; got {getattr(self, name)!r}.")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason, "needed": self.needed}

    def sentence(self) -> str:
        """``conflict (too few records per source: zh 2, en 2; needs ≥ 4 records per source)``."""
        return f"{self.kind} ({self.reason}; needs {self.needed})"


@dataclass
class AnalysisResult:
    """What one analysis produced: its table, per-record evidence series, and what it could not judge.

    ``table`` becomes ``DIR/tables/<name>.csv``: a row per tensor (and head, and
    source or source pair where the statistic has one), columns ``tensor``,
    ``head`` first; ``head`` is empty on a whole-tensor row.  ``series`` holds
    small arrays the figures need (keys are free-form, e.g.
    ``"projection/<tensor>/<head>"``); they are saved in the store.
    ``not_judged``: the kinds it could not have flagged on this store, with why
    (:class:`NotJudged`; too few records per source, too short a history, ...).
    """

    table: pd.DataFrame
    series: dict[str, np.ndarray] = field(default_factory=dict)
    not_judged: list[NotJudged] = field(default_factory=list)


@dataclass(frozen=True)
class Analysis:
    """One analysis: everything the engine and the report need to know about it.

    An analysis is one module ending in ``ANALYSIS = Analysis(...)``; its line in
    ``gradforensics/analysis/__init__.py`` (or :func:`gradforensics.analysis.register`
    for one defined elsewhere) registers it.  Everything is checked here, once.

    Parameters
    ----------
    name
        Table name (``DIR/tables/<name>.csv``), ``--only`` key and ``options`` key:
        a lower-case identifier.
    needs
        What the engine does for it before ``compute``: :class:`Need` values (or
        their strings, ``"gram"``, ``"grads"``, ``"acts"``, ``"weights"``).
    compute
        ``compute(ctx) -> AnalysisResult``; pure over the context.
    flags
        ``flags(result, ctx) -> list[Flag]``; every flag of one of ``kinds``.
    plot
        ``plot(result, flag, ax)`` draws the evidence of *flag* on the given Axes.
    kinds
        The flag kinds it emits, each with its :class:`Advice` (what the report
        says about a flag of that kind); empty for an analysis that only reports
        a table.  A kind is emitted by one registered analysis.
    options
        Its options class (a frozen dataclass subclassing :class:`Options`); the
        engine parses ``options[name]`` with it once and hands the result in
        ``ctx.options[name]``.
    lazy
        ``lazy(store) -> {key: dask collection}``, required with :attr:`Need.ACTS`
        or :attr:`Need.WEIGHTS` (and only then): reductions of ``acts/*``,
        ``weights/*`` (never ``grads/*``) that the engine computes in the pass's
        single ``dask.compute``; the values arrive as ``ctx.computed[name][key]``.
    slab_reductions
        ``slab_reductions(store) -> {key: SlabReduction}``
        (:class:`gradforensics.analysis.contract.grams.SlabReduction`), required with
        :attr:`Need.GRADS` (and only then): per-slab reductions of stored gradients
        that the engine runs inside the Gram pass's read of each slab, so every
        gradient byte is still read once; each value arrives as
        ``ctx.computed[name][key]`` next to those of ``lazy``.
    series
        ``series(groups, options) -> AnalysisResult | None``, optional: the
        analysis run on per-step series (:class:`~gradforensics.analysis.toolkit.series.SeriesGroup`,
        from a store's ``batches/*`` or a training log) with its parsed options
        (an instance of ``options``); None when the series give it nothing to
        do (no table).  ``gradforensics loss`` runs every registered analysis
        that has one, then its ``flags`` (see :class:`Context`).
    long_history
        It runs in the long-history regime: above ``N₀`` records ``ctx.grams`` is
        empty and ``ctx.long`` holds the band test's window moments and the
        super-record Gram matrices
        (:class:`~gradforensics.analysis.contract.grams.LongHistory`), and its
        ``compute`` reads them.  False (default): above ``N₀`` the engine refuses to
        run it (one ``SpecError`` line naming it and ``N₀``) rather than hand it a
        context without the Gram matrices it reads.  The regime exists only when a
        selected analysis needs :attr:`Need.GRAM`; every built-in declares True.

    Raises
    ------
    SpecError
        A field has the wrong type or value (the message names the analysis,
        the field, what is allowed and what was given).
    """

    name: str
    needs: tuple[Need, ...]
    compute: Callable[[Context], AnalysisResult]
    flags: Callable[[AnalysisResult, Context], list[Flag]]
    plot: Callable[[AnalysisResult, Flag, Axes], None]
    kinds: Mapping[str, Advice] = field(default_factory=dict)
    options: type[Options] = NoOptions
    lazy: Callable[[Store], dict[str, Any]] | None = None
    slab_reductions: Callable[[Store], Mapping[str, SlabReduction]] | None = None
    series: Callable[[Sequence[SeriesGroup], Any], AnalysisResult | None] | None = None
    long_history: bool = False

    def __post_init__(self) -> None:
        import dataclasses

        from gradforensics.errors import SpecError
        from gradforensics.store.names import check_analysis_name

        check_analysis_name(self.name, "Analysis")
        who = f"Analysis {self.name!r}"
        allowed = [n.value for n in Need]
        raw = (self.needs,) if isinstance(self.needs, str) else tuple(self.needs)
        bad = [n for n in raw if n not in allowed]
        if bad:
            raise SpecError(f"The 'needs' of {who} must be among {allowed}; got {bad!r}.")
        object.__setattr__(self, "needs", tuple(dict.fromkeys(Need(n) for n in raw)))
        for hook in ("compute", "flags", "plot"):
            if not callable(getattr(self, hook)):
                raise SpecError(f"The '{hook}' of {who} must be callable; got {getattr(self, hook)!r}.")
        if not (isinstance(self.options, type) and issubclass(self.options, Options)
                and dataclasses.is_dataclass(self.options)):
            raise SpecError(f"The 'options' of {who} must be a dataclass subclassing Options; got {self.options!r}.")
        fields = self.options.field_names()
        stray = sorted(k for k in self.options.constraints if k not in fields)
        if stray:
            raise SpecError(f"The 'options' of {who}: {self.options.__name__}.constraints name unknown option(s) "
                            f"{stray}; its options are {list(fields)}.")
        if not isinstance(self.kinds, Mapping) or not all(
                isinstance(k, str) and k.isidentifier() and k == k.lower() and isinstance(v, Advice)
                for k, v in self.kinds.items()):
            raise SpecError(f"The 'kinds' of {who} must map lower-case identifiers to Advice; got {self.kinds!r}.")
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))
        mapped = sorted(k for k, v in self.kinds.items() if v.records_map)
        if mapped and Need.GRAM not in self.needs:
            raise SpecError(f"{who} declares a records map for kind(s) {mapped}: the map is drawn from the saved Gram "
                            "matrices, so it goes with needs 'gram' and only then.")
        self._check_hook("slab_reductions", Need.GRADS in self.needs, "'grads'")
        self._check_hook("lazy", bool({Need.ACTS, Need.WEIGHTS} & set(self.needs)), "'acts' or 'weights'")
        if self.series is not None and not callable(self.series):
            raise SpecError(f"The 'series' of {who} must be callable or None; got {self.series!r}.")
        if not isinstance(self.long_history, bool):
            raise SpecError(f"The 'long_history' of {who} must be True or False; got {self.long_history!r}.")

    def _check_hook(self, hook: str, needed: bool, needs: str) -> None:
        from gradforensics.errors import SpecError

        fn = getattr(self, hook)
        if fn is not None and not callable(fn):
            raise SpecError(f"The '{hook}' of Analysis {self.name!r} must be callable or None; got {fn!r}.")
        if needed != (fn is not None):
            raise SpecError(f"Analysis {self.name!r} needs {[str(n) for n in self.needs]}: a '{hook}' hook goes "
                            f"with needs {needs} and only then; got {hook}={fn!r}.")


@dataclass
class Findings:
    """Everything a forensic pass found; what the report renders.

    ``analyze`` saves it in the store, and ``gradforensics report`` reads it back
    (:mod:`gradforensics.analysis.engine.results`: ``save_results``, ``read_findings``).
    """

    store: str
    n_records: int
    mode: str
    sources: tuple[str, ...]
    header: dict[str, Any]
    results: dict[str, AnalysisResult]
    flags: list[Flag]
    #: what the analyses could not judge on this store (``flags.json`` ``not_judged``)
    not_judged: list[NotJudged] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flags = sorted(self.flags, key=lambda f: (-f.severity, f.kind, f.tensor, -1 if f.head is None else f.head))

    def flags_json(self) -> dict[str, Any]:
        """The ``flags.json`` document (contract in the design); ``regime`` and ``baseline`` when the header
        states a valid one; ``timeline`` when the timeline analysis ran
        (:func:`~gradforensics.analysis.contract.timeline.timeline_document`)."""
        doc: dict[str, Any] = {"schema": 1, "store": self.store, "n_records": int(self.n_records), "mode": self.mode}
        regime = regime_of(self.header.get("regime"))
        if regime is not None:
            doc["regime"] = regime
        baseline = baseline_of(self.header.get("baseline"))
        if baseline is not None:
            doc["baseline"] = baseline
        doc["flags"] = [f.to_dict() for f in self.flags]
        doc["not_judged"] = [n.to_dict() for n in self.not_judged]
        if TIMELINE in self.results:
            doc["timeline"] = timeline_document(self.results[TIMELINE], self.flags, int(self.n_records))
        return doc

    def table(self, name: str) -> pd.DataFrame | None:
        r = self.results.get(name)
        return None if r is None else r.table


#: The fields of each analysis regime of the findings header (``flags.json`` ``regime``).
REGIME_FIELDS = {"exact": ("n0",), "long-history": ("n0", "window", "windows", "band")}


def regime_of(r: Any) -> dict[str, Any] | None:
    """The header's ``regime`` when it is well formed (a saved header from a damaged store may hold anything)."""
    if not isinstance(r, dict) or r.get("name") not in REGIME_FIELDS:
        return None
    keys = REGIME_FIELDS[r["name"]]
    if set(r) != {"name", *keys} or not all(type(r[k]) is int and r[k] >= (k in ("window", "windows")) for k in keys):
        return None
    return {"name": r["name"], **{k: r[k] for k in keys}}


#: The fields of the header's ``baseline`` (``analyze(..., baseline=STORE)``; ``flags.json`` ``baseline``).
BASELINE_FIELDS: dict[str, type] = {"store": str, "n_records": int, "reused": bool, "context": int}


def baseline_of(b: Any) -> dict[str, Any] | None:
    """The header's ``baseline`` when it is well formed, else None (findings judged against no baseline)."""
    if not isinstance(b, dict) or set(b) != set(BASELINE_FIELDS):
        return None
    if not all(type(b[k]) is t for k, t in BASELINE_FIELDS.items()) or b["n_records"] < 0 or b["context"] < 0:
        return None
    return {k: b[k] for k in BASELINE_FIELDS}


__all__ = ["BASELINE_FIELDS", "REGIME_FIELDS", "Analysis", "AnalysisResult", "Context", "Findings", "Flag", "Need",
           "NotJudged",
           "baseline_of", "regime_of"]
