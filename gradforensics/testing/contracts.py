"""``AnalysisContract``: the pytest suite every analysis's tests opt into.

A test module subclasses it and sets two things::

    from gradforensics.testing.contracts import AnalysisContract
    from gradforensics.testing.planted import noise_store

    class TestNoiseContract(AnalysisContract):
        analysis_name = "noise"
        factory = staticmethod(noise_store)      # (path, seed) -> store with planted trouble

and gets, run on a planted store and on healthy controls (both built once per
class): severities in [0, 1] and sorted; deterministic results (two passes give
the same table and flags); table columns ``tensor``, ``head`` first with
``head`` empty (NA) on whole-tensor rows; the planted store raises at least one
flag of its kind above 0.5; a healthy store raises no flag above 0.5 (over
``healthy_seeds`` x ``healthy_snrs``); the plot draws on the Axes it is given.

Override ``healthy_factory`` (default :func:`~gradforensics.testing.planted.healthy_store`),
``healthy_seeds``, ``healthy_snrs``, ``store_suffix`` or ``options`` where an
analysis needs something else.

The registry contract (:func:`parametrize_with_checks`, in the manner of
scikit-learn's ``parametrize_with_checks``) runs :data:`REGISTRY_CHECKS` for *every*
registered analysis, each on that analysis's planted-trouble store
(:class:`PlantedStores`)::

    from gradforensics.testing.contracts import PlantedStores, parametrize_with_checks

    @pytest.fixture(scope="module")
    def planted(tmp_path_factory):
        return PlantedStores(tmp_path_factory.mktemp("contracts"), {"noise": noise_store, ...})

    @parametrize_with_checks()
    def test_registered_analysis(analysis, check, planted):
        check(analysis, planted)

The checks: every declared evidence key (``Advice.evidence_keys``) is carried, as a
finite number, by a flag of its kind on the planted store, and the summary quotes it;
every key has a label; an analysis that declares ``long_history`` runs above ``N₀``
(forced with the engine option ``long_history=0``) and gives a table, one that does not
is refused in one line; and a pass makes exactly one ``dask.compute`` (none for an
analysis that reads nothing but ``batches/*``), counted with
:class:`~gradforensics.testing.counting.CountingScheduler`.  Importing this module
needs pytest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from gradforensics.testing.counting import CountingScheduler
from gradforensics.testing.planted import healthy_store

__all__ = [
    "REGISTRY_CHECKS",
    "AnalysisContract",
    "Pass",
    "PlantedCase",
    "PlantedStores",
    "check_evidence_keys_carried",
    "check_evidence_labels",
    "check_long_history",
    "check_one_compute",
    "parametrize_with_checks",
]



def _artists(ax: Any) -> int:
    return len(ax.lines) + len(ax.collections) + len(ax.patches) + len(ax.images) + len(ax.texts)


class AnalysisContract:
    """Base class of an analysis's contract tests (subclass it in a ``Test*`` class)."""

    analysis_name: ClassVar[str]
    factory: ClassVar[Callable[..., Any]]
    healthy_factory: ClassVar[Callable[..., Any]] = staticmethod(healthy_store)
    healthy_seeds: ClassVar[tuple[int, ...]] = (0, 1)
    healthy_snrs: ClassVar[tuple[float, ...]] = (0.5, 4.0)
    store_suffix: ClassVar[str] = ".zarr"
    options: ClassVar[dict[str, Any] | None] = None
    expect_planted_flag: ClassVar[bool] = True

    # ------------------------------------------------------------ fixtures
    @classmethod
    def _analyze(cls, path: Any) -> Any:
        from gradforensics.analysis.engine.run import analyze

        opts = {"engine": {"persist": False}, **(cls.options or {})}
        return analyze(str(path), only=[cls.analysis_name], options=opts, progress=False)

    @pytest.fixture(scope="class")
    @classmethod
    def planted(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
        path = tmp_path_factory.mktemp(f"planted-{cls.analysis_name}") / f"store{cls.store_suffix}"
        store = cls.factory(path, 0)
        return store, cls._analyze(path)

    @pytest.fixture(scope="class")
    @classmethod
    def healthy(cls, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, Any]]:
        out = []
        for seed in cls.healthy_seeds:
            for snr in cls.healthy_snrs:
                path = tmp_path_factory.mktemp(f"healthy-{cls.analysis_name}") / f"store{cls.store_suffix}"
                cls.healthy_factory(path, seed, snr=snr)
                out.append((seed, snr, cls._analyze(path)))
        return out

    # --------------------------------------------------------------- tests
    def test_registered(self) -> None:
        from gradforensics.analysis import REGISTRY

        a = REGISTRY[self.analysis_name]
        assert a.name == self.analysis_name
        assert callable(a.compute) and callable(a.flags) and callable(a.plot)
        assert all(advice.title and advice.phrase for advice in a.kinds.values())

    def test_severity_in_unit_interval_and_sorted(self, planted: tuple[Any, Any]) -> None:
        flags = planted[1].flags
        sev = [f.severity for f in flags]
        assert all(0.0 <= s <= 1.0 for s in sev)
        assert sev == sorted(sev, reverse=True)
        assert all(f.kind for f in flags)

    def test_planted_trouble_is_flagged(self, planted: tuple[Any, Any]) -> None:
        if not self.expect_planted_flag:
            pytest.skip("this contract subclass declares no planted flag (expect_planted_flag = False)")
        top = [f for f in planted[1].flags if f.severity > 0.5]
        assert top, f"{self.analysis_name}: no flag above 0.5 on the planted store"

    def test_deterministic(self, planted: tuple[Any, Any]) -> None:
        import pandas as pd

        store, first = planted
        again = self._analyze(store)
        pd.testing.assert_frame_equal(first.table(self.analysis_name), again.table(self.analysis_name))
        assert [f.to_dict() for f in first.flags] == [f.to_dict() for f in again.flags]

    def test_table_columns_tensor_head_first(self, planted: tuple[Any, Any]) -> None:
        table = planted[1].table(self.analysis_name)
        assert table is not None
        assert list(table.columns[:2]) == ["tensor", "head"]
        assert len(table) > 0
        heads = table["head"]
        assert heads.isna().any(), "whole-tensor rows must have an empty head"
        assert all(float(h).is_integer() for h in heads.dropna())

    def test_healthy_store_raises_no_flag_above_half(self, healthy: list[tuple[int, float, Any]]) -> None:
        loud = [(seed, snr, f.tensor, f.head, round(f.severity, 3))
                for seed, snr, findings in healthy for f in findings.flags if f.severity > 0.5]
        assert not loud, f"{self.analysis_name}: healthy stores raised {loud}"

    def test_plot_draws_on_given_axes(self, planted: tuple[Any, Any]) -> None:
        from matplotlib.figure import Figure

        from gradforensics.analysis import REGISTRY

        findings = planted[1]
        flags = [f for f in findings.flags if f.kind in REGISTRY[self.analysis_name].kinds] or findings.flags
        if not flags:
            pytest.skip("no flag on the planted store to plot")
        fig = Figure()
        ax = fig.add_subplot()
        REGISTRY[self.analysis_name].plot(findings.results[self.analysis_name], flags[0], ax)
        assert _artists(ax) > 0
        assert fig.axes == [ax]

    def test_no_nan_from_nonfinite_records(self, tmp_path: Path) -> None:
        """Records with NaN gradients must not turn a column NaN that is defined on the healthy twin."""
        from gradforensics.testing.planted import nonfinite_store

        def all_nan_columns(path: Path) -> set[str]:
            table = self._analyze(path).table(self.analysis_name)
            num = table.select_dtypes(include=[np.number])
            return {c for c in num.columns if len(num) and num[c].isna().all()}

        nonfinite_store(tmp_path / f"nf{self.store_suffix}", 0)
        healthy_store(tmp_path / f"ok{self.store_suffix}", 0)
        extra = all_nan_columns(tmp_path / f"nf{self.store_suffix}") - all_nan_columns(tmp_path / f"ok{self.store_suffix}")
        assert not extra, f"{self.analysis_name}: columns NaN throughout once a record holds NaN: {sorted(extra)}"


# ======================================================================== the registry contract
@dataclass(frozen=True)
class PlantedCase:
    """How to build one analysis's planted-trouble store: ``factory(path, seed)``, analysed with *options*."""

    factory: Callable[..., Any]
    options: Mapping[str, Any] | None = None
    suffix: str = ".zarr"


@dataclass
class Pass:
    """One pass over a planted store: its findings and how many computes it made."""

    findings: Any
    computes: int


class PlantedStores:
    """Each analysis's planted store, built under *root* on first use; its passes cached.

    Parameters
    ----------
    root
        A directory for the stores (a pytest ``tmp_path_factory.mktemp(...)``).
    cases
        ``{analysis name: PlantedCase}`` (a bare factory ``(path, seed) -> store`` is
        a case with no options): a store on which the analysis raises a flag of every
        kind it declares.
    """

    def __init__(self, root: Path, cases: Mapping[str, PlantedCase | Callable[..., Any]]) -> None:
        self.root = Path(root)
        self.cases = {k: v if isinstance(v, PlantedCase) else PlantedCase(v) for k, v in cases.items()}
        self._paths: dict[str, Path] = {}
        self._passes: dict[tuple[str, bool], Pass] = {}

    def case(self, name: str) -> PlantedCase:
        if name not in self.cases:
            pytest.fail(f"{name}: no planted store in the registry contract's cases: add a PlantedCase whose store "
                        "raises a flag of every kind it declares.")
        return self.cases[name]

    def path(self, name: str) -> Path:
        """The planted store of analysis *name* (built on first use, seed 0)."""
        if name not in self._paths:
            case = self.case(name)
            path = self.root / name / f"store{case.suffix}"
            path.parent.mkdir(parents=True, exist_ok=True)
            case.factory(path, 0)
            self._paths[name] = path
        return self._paths[name]

    def run(self, name: str, *, long: bool = False, only: Iterable[str] | None = None) -> Pass:
        """A pass of *name* (with *only* instead when given) over its planted store, its computes counted.

        ``long``: forced into the long-history regime (engine option ``long_history=0``).
        Not cached; :meth:`passed` is.
        """
        from gradforensics.analysis.engine.run import analyze

        case = self.case(name)
        engine = {"persist": False, **({"long_history": 0} if long else {})}
        options = {**(case.options or {}), "engine": engine}
        counter = CountingScheduler()
        with counter.counting():
            findings = analyze(str(self.path(name)), only=list(only or [name]), options=options, progress=False)
        return Pass(findings, counter.calls)

    def passed(self, name: str, *, long: bool = False) -> Pass:
        """:meth:`run` of *name* alone (above ``N₀``: with ``nonfinite`` for an analysis that needs no Gram
        pass, so the pass is in the long-history regime), cached."""
        from gradforensics.analysis.contract.model import Need
        from gradforensics.analysis.contract.registry import REGISTRY

        key = (name, long)
        if key not in self._passes:
            only = [name]
            if long and Need.GRAM not in REGISTRY[name].needs:
                only.append("nonfinite")            # the regime exists only in a pass with the Gram pass
            self._passes[key] = self.run(name, long=long, only=only)
        return self._passes[key]


def _finite_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v))


def check_evidence_labels(analysis: Any, stores: PlantedStores) -> None:
    """Every declared evidence key of every kind has a label: a non-empty one-line string."""
    for kind, advice in analysis.kinds.items():
        for key in advice.evidence_keys:
            label = advice.label(key)
            assert isinstance(label, str) and label.strip() and label.isprintable(), (
                f"{analysis.name}: kind {kind!r} evidence key {key!r} has no readable label ({label!r})")


def check_evidence_keys_carried(analysis: Any, stores: PlantedStores) -> None:
    """On its planted store the analysis raises every kind it declares, and each declared evidence key is
    carried as a finite number by at least one flag of its kind; the summary quotes the evidence."""
    if not analysis.kinds:
        return
    from gradforensics.reporting.summary import evidence_phrase

    flags = stores.passed(analysis.name).findings.flags
    for kind, advice in analysis.kinds.items():
        mine = [f for f in flags if f.kind == kind]
        assert mine, (f"{analysis.name}: its planted store raises no flag of kind {kind!r}; the contract cannot "
                      "check that kind's evidence keys (use a store that raises it)")
        missing = [k for k in advice.evidence_keys if not any(_finite_number(f.evidence.get(k)) for f in mine)]
        carried = sorted({k for f in mine for k, v in f.evidence.items() if _finite_number(v)})
        assert not missing, (f"{analysis.name}: kind {kind!r} declares evidence key(s) {missing} that no flag carries "
                             f"as a number; its flags carry {carried}")
        if advice.evidence_keys:
            assert any(evidence_phrase(kind, [f]) for f in mine), (
                f"{analysis.name}: the summary quotes no evidence for any flag of kind {kind!r}")


def check_long_history(analysis: Any, stores: PlantedStores) -> None:
    """Declared: a pass above ``N₀`` runs and gives the table the exact pass gives (rows, columns tensor, head).
    Not declared: that pass is refused in one line naming the analysis and ``N₀``."""
    from gradforensics.errors import SpecError

    if not analysis.long_history:
        with pytest.raises(SpecError, match=rf"{analysis.name}.*above N₀ = 0") as info:
            stores.run(analysis.name, long=True)
        assert "\n" not in str(info.value)
        return
    long = stores.passed(analysis.name, long=True).findings
    assert long.header["regime"]["name"] == "long-history", long.header["regime"]
    exact = stores.passed(analysis.name).findings.table(analysis.name)
    table = long.table(analysis.name)
    assert table is not None and list(table.columns[:2]) == list(exact.columns[:2]) == ["tensor", "head"]
    if len(exact):
        assert len(table), f"{analysis.name}: an empty table above N₀ where the exact pass has {len(exact)} rows"


def check_one_compute(analysis: Any, stores: PlantedStores) -> None:
    """A pass of the analysis calls ``dask.compute`` exactly once (none when it reads only ``batches/*``),
    in the exact regime and, where declared, the long-history one: one pass over the bytes."""
    want = 1 if analysis.needs else 0
    got = stores.passed(analysis.name).computes
    assert got == want, f"{analysis.name}: the pass made {got} dask computes; one pass over the bytes is {want}"
    if analysis.long_history:
        got = stores.passed(analysis.name, long=True).computes
        assert got == 1, f"{analysis.name}: the pass above N₀ made {got} dask computes, not 1"


#: The checks :func:`parametrize_with_checks` runs for every registered analysis: ``check(analysis, stores)``.
REGISTRY_CHECKS: tuple[Callable[[Any, PlantedStores], None], ...] = (
    check_evidence_labels, check_evidence_keys_carried, check_long_history, check_one_compute)


def parametrize_with_checks(names: Iterable[str] | None = None,
                            checks: Iterable[Callable[[Any, PlantedStores], None]] = REGISTRY_CHECKS,
                            expected_failures: Mapping[str, str] | None = None) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize(("analysis", "check"), ...)`` over every registered analysis (or *names*) × check.

    The test receives the :class:`~gradforensics.analysis.contract.model.Analysis` and the check, and calls
    ``check(analysis, stores)`` with a :class:`PlantedStores`; ids read ``<analysis>-<check>`` (the check's
    name without ``check_``).  *expected_failures* maps such ids to the reason a known breach is not fixed
    yet: that case is a strict ``xfail`` (it fails the run once fixed, so the entry is removed).
    """
    from gradforensics.analysis.contract.registry import REGISTRY

    chosen = list(names) if names is not None else list(REGISTRY)
    known = dict(expected_failures or {})
    params = []
    for n in chosen:
        for c in checks:
            ident = f"{n}-{c.__name__.removeprefix('check_')}"
            marks = [pytest.mark.xfail(strict=True, reason=known.pop(ident))] if ident in known else []
            params.append(pytest.param(REGISTRY[n], c, id=ident, marks=marks))
    if known:
        raise ValueError(f"parametrize_with_checks: expected_failures name no case: {sorted(known)}.")
    return pytest.mark.parametrize(("analysis", "check"), params)
