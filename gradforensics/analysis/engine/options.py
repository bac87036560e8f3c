"""The pass's own options (:class:`EngineOptions`, ``options={"engine": {...}}``) and the analyses it runs.

:func:`select_analyses` turns ``only=`` into registered analyses; :func:`split_options`
parses the engine's options and every selected analysis's, once, before the store is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gradforensics.analysis.contract.model import Analysis
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.contract.registry import REGISTRY
from gradforensics.analysis.engine.gram import DEFAULT_SLAB_BYTES, DEFAULT_SPLIT_EVERY, PRECISIONS
from gradforensics.analysis.engine.longhistory import BAND, N_WINDOWS, threshold
from gradforensics.errors import SpecError

__all__ = ["ENGINE_KEY", "GRAM_SAVES", "UNIT_PLACES", "EngineOptions", "select_analyses", "split_options"]

UNIT_PLACES = ("auto", "workers", "client")
"""Values of the engine option ``unit_statistics``."""

GRAM_SAVES = ("flagged", "all", "none")
"""Values of the engine option ``save_grams``."""

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
    save_grams
        Which units' N×N Gram matrices the save keeps (exact regime): ``"flagged"``
        (default) the units of the flags the report's records map is drawn for (the
        direction kinds: conflict, oscillation, drift; ``registry.records_map_kinds``), ``"all"``
        every tensor and head, ``"none"`` none.  Nothing but the records map reads them
        back; every unit's matrix is ``8 N²`` bytes, far more than a narrow head's own data.
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
    save_grams: str = "flagged"
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
        if self.save_grams not in GRAM_SAVES:
            raise SpecError(f"engine option save_grams must be one of {GRAM_SAVES}; got {self.save_grams!r}.")
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


