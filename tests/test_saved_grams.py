"""Which Gram matrices ``analyze`` saves (engine option ``save_grams``): by default only the units the
report's records map can be drawn for, each the pass's own matrix bit for bit, and the same map drawn."""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.registry import records_map_kinds
from gradforensics.analysis.engine.results import load_grams, read_findings
from gradforensics.errors import SpecError
from gradforensics.reporting import recordsmap
from gradforensics.store.reader import Store
from gradforensics.testing.planted_directions import planted_conflict


def _analyze(path, which=None):
    engine = {"spill": True} if which is None else {"spill": True, "save_grams": which}
    return gf.analyze(path, options={"engine": engine}, progress=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same planted store analysed with every unit saved, then with the default."""
    d = tmp_path_factory.mktemp("saved")
    path = d / "s.zarr"
    planted_conflict(0, n=48).write(path)
    _analyze(path, "all")
    every = load_grams(Store(path))
    every_map, _ = recordsmap.records_map(read_findings(Store(path)), Store(path))
    findings = _analyze(path)
    return path, findings, every, every_map


def test_default_saves_the_units_of_the_direction_flags_only(saved) -> None:
    path, _, every, _ = saved
    store = Store(path)
    kept = load_grams(store)
    kinds = set(records_map_kinds())
    wanted = {(f.tensor, f.head) for f in read_findings(store).flags if f.kind in kinds}
    assert wanted and set(kept) == wanted < set(every)           # some units flagged, not all of them
    for key, g in kept.items():
        assert np.array_equal(g.gram, every[key].gram) and np.array_equal(g.nonfinite, every[key].nonfinite)
    assert store.arrays["analysis/gram/k"].shape[0] == len(wanted)


def test_the_records_map_is_the_one_drawn_from_every_saved_unit(saved) -> None:
    path, findings, _, every_map = saved
    m, why = recordsmap.records_map(findings, Store(path))
    assert why is None and m is not None and every_map is not None
    assert (m.tensor, m.head, m.kind) == (every_map.tensor, every_map.head, every_map.kind)
    assert np.array_equal(m.xy, every_map.xy) and np.array_equal(m.records, every_map.records)


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_none_saves_an_empty_index_and_the_report_says_why(tmp_path, suffix) -> None:
    path = tmp_path / f"s{suffix}"
    planted_conflict(1, n=32).write(path)
    _analyze(path, "all")
    assert load_grams(Store(path))                          # some saved, then replaced by none: nothing stale
    findings = _analyze(path, "none")
    assert load_grams(Store(path)) == {}
    m, why = recordsmap.records_map(findings, Store(path))
    assert m is None and why is not None and "save_grams" in why


def test_a_bad_value_is_refused_in_one_line(tmp_path) -> None:
    path = tmp_path / "s.zarr"
    planted_conflict(2, n=16).write(path)
    with pytest.raises(SpecError, match="save_grams must be one of"):
        gf.analyze(path, options={"engine": {"save_grams": "some"}}, progress=False)
