"""The types every analysis shares: :class:`Flag`, :class:`Context`,
:class:`AnalysisResult`, :class:`Analysis` and :class:`Findings`.

An analysis is one module exposing ``ANALYSIS = Analysis(...)`` (see
``gradforensics/analysis/__init__.py`` for the registry).  The engine builds one
:class:`Context` per pass (batch metadata, the Gram matrix of every tensor and
head, and the results of each analysis's own lazy graphs, all computed in one
``dask.compute``), calls ``compute(ctx)`` and ``flags(result, ctx)`` of each
analysis, and gathers everything in :class:`Findings`, which the report reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from gradforensics.analysis.engine.gram import SlabReduction
    from gradforensics.store.reader import Store
    from gradforensics.store.schema import StoreMeta

FlagKind = Literal[
    "drift", "oscillation", "saturation", "spectral", "conflict", "noise",
    "precision", "loss_spectrum", "nonfinite",
]
FLAG_KINDS: tuple[str, ...] = get_args(FlagKind)


def parse_options(cls: type[Any], raw: Any, name: str) -> Any:
    """Build the frozen options dataclass *cls* of analysis *name*, validated once.

    *raw* is ``None`` (defaults), an instance of *cls*, or a mapping of field values;
    anything else, or an unknown key, is a :class:`~gradforensics.errors.SpecError`
    naming the analysis, the bad keys and the known ones.  Value checks live in the
    dataclass's ``__post_init__``.
    """
    import dataclasses

    from gradforensics.errors import SpecError

    if raw is None:
        return cls()
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise SpecError(f"{name}: bad options {raw!r}: must be a dict; got {type(raw).__name__}.")
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SpecError(f"{name}: bad options {dict(raw)!r}: unknown key(s) {unknown}; known: {known}.")
    return cls(**raw)


class Options:
    """Mixin for an analysis's frozen options dataclass: ``Options.parse(value)``.

    Set ``analysis_name``; :func:`parse_options` does the validation.
    """

    analysis_name = ""

    @classmethod
    def parse(cls, value: Any) -> Any:
        return parse_options(cls, value, cls.analysis_name)


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
        if self.kind not in FLAG_KINDS:
            raise ValueError(f"Flag kind must be one of {FLAG_KINDS}; got {self.kind!r}.")
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "flag") -> Flag:
        """Inverse of :meth:`to_dict`, every field checked (:func:`gradforensics.analysis.engine.stored.parse_flag`).

        Raises
        ------
        CorruptStoreError
            A field is missing, unknown, mistyped or out of range; the message starts with *where*.
        """
        from gradforensics.analysis.engine.stored import parse_flag

        return parse_flag(d, where)


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


@dataclass(frozen=True)
class GramResult:
    """The Gram matrix of one tensor (or one head) over all records.

    ``gram[i, j] = <g_i, g_j>`` in float64, with records holding any non-finite
    value zeroed out (their rows/columns are 0); ``nonfinite[i]`` counts the
    non-finite elements of record *i*.  ``from_sketch``: computed from the
    stored sketch (inner products are then estimates).
    """

    tensor: str
    head: int | None
    gram: np.ndarray
    nonfinite: np.ndarray
    n_features: int
    from_sketch: bool = False

    @property
    def finite(self) -> np.ndarray:
        """Boolean mask of the records usable for direction statistics."""
        return self.nonfinite == 0


@dataclass
class Context:
    """Everything an analysis's ``compute`` may use; built once per pass."""

    store: Store
    meta: StoreMeta
    batches: dict[str, np.ndarray]
    grams: dict[tuple[str, int | None], GramResult]
    lazy: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

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


@dataclass
class AnalysisResult:
    """What one analysis produced: its table and per-record evidence series.

    ``table`` becomes ``DIR/tables/<name>.csv``: a row per tensor (and head, and
    source or source pair where the statistic has one), columns ``tensor``,
    ``head`` first; ``head`` is empty on a whole-tensor row.  ``series`` holds
    small arrays the figures need (keys are free-form, e.g.
    ``"projection/<tensor>/<head>"``); they are saved in the store.
    """

    table: pd.DataFrame
    series: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    """One registered analysis.

    Parameters
    ----------
    name
        Table name (``DIR/tables/<name>.csv``) and ``--only`` key.
    needs
        What it reads: ``"gram"``, ``"batches"``, ``"acts"``, ``"weights"``, ``"loss"``.
    compute
        ``compute(ctx) -> AnalysisResult``; pure over the context.
    flags
        ``flags(result, ctx) -> list[Flag]``.
    plot
        ``plot(result, flag, ax)`` draws the evidence of *flag* on the given Axes.
    lazy
        Optional ``lazy(store) -> dict[str, dask collection]`` of extra reductions
        the engine computes in the same single ``dask.compute`` as the Gram
        matrices; the results arrive as ``ctx.lazy[name]``.  It must not read
        ``grads/*``: gradient reductions go in ``slab_reductions``.
    slab_reductions
        Optional ``slab_reductions(store) -> {key: SlabReduction}``
        (:class:`gradforensics.analysis.engine.gram.SlabReduction`): per-slab reductions of
        stored gradients that the engine runs inside the Gram pass's read of each
        slab, so every gradient byte is still read once; each result arrives as
        ``ctx.lazy[name][key]`` next to those of ``lazy``.
    """

    name: str
    needs: tuple[str, ...]
    compute: Callable[[Context], AnalysisResult]
    flags: Callable[[AnalysisResult, Context], list[Flag]]
    plot: Callable[[AnalysisResult, Flag, Axes], None]
    lazy: Callable[[Store], dict[str, Any]] | None = None
    title: str = ""
    slab_reductions: Callable[[Store], Mapping[str, SlabReduction]] | None = None


@dataclass
class Findings:
    """Everything a forensic pass found; what the report renders."""

    store: str
    n_records: int
    mode: str
    sources: tuple[str, ...]
    header: dict[str, Any]
    results: dict[str, AnalysisResult]
    flags: list[Flag]

    def __post_init__(self) -> None:
        self.flags = sorted(self.flags, key=lambda f: (-f.severity, f.kind, f.tensor, -1 if f.head is None else f.head))

    def flags_json(self) -> dict[str, Any]:
        """The ``flags.json`` document (contract in the design)."""
        return {"schema": 1, "store": self.store, "n_records": int(self.n_records), "mode": self.mode,
                "flags": [f.to_dict() for f in self.flags]}

    def table(self, name: str) -> pd.DataFrame | None:
        r = self.results.get(name)
        return None if r is None else r.table

    # persistence in the store's analysis/ group ---------------------------
    def to_documents(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays: dict[str, np.ndarray] = {}
        docs: dict[str, Any] = {
            "findings": {"store": self.store, "n_records": self.n_records, "mode": self.mode,
                         "sources": list(self.sources), "header": self.header,
                         "flags": [f.to_dict() for f in self.flags], "analyses": sorted(self.results)},
        }
        for name, res in self.results.items():
            docs[f"tables/{name}"] = json.loads(res.table.to_json(orient="split", index=False))
            arrays[f"series/{name}"] = pack_series(res.series)
        return arrays, docs

    @classmethod
    def from_store(cls, store: Store) -> Findings:
        """The findings ``analyze`` stored in *store*'s ``analysis/`` group, parsed strictly.

        The store may come from someone else: every document is checked
        (:func:`gradforensics.analysis.engine.stored.read_findings`) before it is trusted.

        Raises
        ------
        CorruptStoreError
            A stored document is malformed (named, with what is wrong).
        MissingArrayError
            A table or series the findings name is absent.
        """
        from gradforensics.analysis.engine.stored import read_findings

        return cls(**read_findings(store))


def pack_series(series: Mapping[str, Any]) -> np.ndarray:
    """All series of one analysis as one uint8 array (an ``.npz`` image, no pickle).

    One stored array per analysis instead of one per series: a store with
    hundreds of tensors would otherwise get thousands of tiny arrays, and their
    metadata dominated the time of writing the results.
    """
    import io

    buf = io.BytesIO()
    arrays: dict[str, Any] = {f"s{i}": np.asarray(v) for i, v in enumerate(series.values())}
    arrays["__keys__"] = np.asarray(list(series.keys()), dtype=str)
    np.savez(buf, **arrays)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def unpack_series(raw: np.ndarray, where: str = "series") -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_series`; a malformed image is a :class:`~gradforensics.errors.CorruptStoreError`.

    See :func:`gradforensics.analysis.engine.stored.parse_series` for what is checked.
    """
    from gradforensics.analysis.engine.stored import parse_series

    return parse_series(raw, where)


def flag_to_json(flag: Flag) -> str:
    return json.dumps(flag.to_dict())


__all__ = [
    "FLAG_KINDS",
    "Analysis",
    "AnalysisResult",
    "Context",
    "Findings",
    "Flag",
    "FlagKind",
    "GramResult",
    "Options",
    "asdict",
    "parse_options",
]
