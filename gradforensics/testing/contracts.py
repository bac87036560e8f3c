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
analysis needs something else.  Importing this module needs pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from gradforensics.testing.planted import healthy_store


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
        from gradforensics.analysis.engine import analyze

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
