"""Saturation judged on the capture's facts: units dead (saturated) on every batch, their rise, the physics.

A ReLU/GELU layer's units always split into a camp near zero and a spread of positive values; that is
the family baseline.  What counts is a unit dead on *every* position of every batch of the closing
records (it gets no gradient through the activation and cannot come back), against the run's own
opening level.  Oracles: NumPy on the stored facts, and planted stores whose truth is known.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradforensics.analysis.kinds import saturation as S
from gradforensics.testing.planted_units import activation, run_analysis


def test_persistent_counts_units_dead_throughout_the_windows() -> None:
    rng = np.random.default_rng(0)
    dead_w = rng.random((8, 200)) < 0.3
    sat_w = ~dead_w & (rng.random((8, 200)) < 0.1)
    f = S.Facts(np.zeros(10), np.zeros(10), dead_w, sat_w)
    got = S.persistent(f)
    polar = dead_w | sat_w
    unbounded = S.persistent(f, bounded=False)       # ReLU/GELU/SiLU: only dead units are polar
    assert unbounded["units_polar_last"] == pytest.approx(dead_w[-1].mean())
    assert unbounded["units_died_count"] == int((dead_w[-1] & ~dead_w[0]).sum())
    assert unbounded["units_saturated_last"] == pytest.approx(sat_w[-1].mean())
    assert got["units_polar_first"] == pytest.approx(polar[0].mean())
    assert got["units_dead_last"] == pytest.approx(dead_w[-1].mean())
    assert got["units_died_count"] == int((polar[-1] & ~polar[0]).sum())
    assert got["died_rel"] == pytest.approx((polar[-1] & ~polar[0]).mean() / (1 - polar[0].mean()))


def _relu_store(path, *, die: bool, n: int = 48, units: int = 64, tokens: int = 64, seed: int = 0) -> None:
    """A ReLU layer whose pre-activations ``z + b_u`` have biases spread wide (N(0, 1.5²)): a third of its
    units fire on few tokens (zero-inflated, two camps of polarity) from the first record on.  With *die*,
    half the units' biases fall by 8 from record 12 to 24 and stay there: those units die for good."""
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    bias = rng.normal(0.0, 1.5, units)
    falls = rng.permutation(units) < units // 2
    with gf.Recorder(path, sources=("a",), mode="training", background=False) as rec:
        for i in range(n):
            shift = 8.0 * np.clip((i - 12) / 12, 0, 1) * falls if die else 0.0
            pre = rng.normal(size=(tokens, units)) + bias - shift
            rec.record(step=i, loss=1.0, source="a", n_samples=tokens,
                       activations={"mlp.act": activation("relu", pre).astype(np.float32)})


def test_lazy_facts_match_the_stored_dead_flags(tmp_path) -> None:
    import gradforensics as gf

    _relu_store(tmp_path / "d.zarr", die=True)
    store = gf.open_store(tmp_path / "d.zarr")
    lz = {k: np.asarray(v.compute() if hasattr(v, "compute") else v) for k, v in S.lazy(store).items()}
    dead = store.read("acts/mlp.act/dead").astype(bool)
    np.testing.assert_allclose(lz["fact_dead|mlp.act"], dead.mean(axis=1))
    edges = S.window_edges(store.n_records, S.WINDOWS)
    want = np.stack([dead[a:b].all(axis=0) for a, b in itertools.pairwise(edges)])
    np.testing.assert_array_equal(lz["fact_dead_w|mlp.act"], want)


def test_a_zero_inflated_relu_layer_is_the_baseline_and_dying_units_are_the_finding(tmp_path) -> None:
    _relu_store(tmp_path / "h.zarr", die=False)
    result, flags = run_analysis(tmp_path / "h.zarr", "saturation")
    row = result.table[result.table.source == ""].iloc[0]
    assert not row["bounded"] and row["units_died_count"] <= 1
    assert max((f.severity for f in flags), default=0.0) < 0.5

    _relu_store(tmp_path / "d.zarr", die=True)
    result, flags = run_analysis(tmp_path / "d.zarr", "saturation")
    row = result.table[result.table.source == ""].iloc[0]
    assert row["units_died_count"] >= 28 and row["died_rel"] > 0.4        # half the units, most of them alive at first
    (f,) = flags
    assert f.severity == 1.0 and f.evidence["died"] == 1.0
    assert "died" in f.summary and "no gradient" in f.summary


@pytest.mark.parametrize(("row", "part", "want"), [
    ({"units_polar_last": 0.75}, "level", 1.0),                     # three quarters of the layer dead
    ({"units_polar_last": 0.5}, "level", 0.5),
    ({"died_rel": 0.2, "units_died_count": 5}, "died", 0.5),
    ({"died_rel": 0.2, "units_died_count": 1}, "died", 0.0),         # one unit is no trend
    ({"rise_rel": 0.2, "trend_p": 1e-4, "bounded": True}, "trend", 0.5),
    ({"rise_rel": 0.4, "trend_p": 1e-4}, "trend", S.CONTEXT),        # unbounded: the per-batch rise is context
    ({"rise_rel": 0.2, "trend_p": 0.2}, "trend", 0.0),
    ({"two_camps": True, "separation": 4.0}, "camps", 0.0),          # unbounded: two camps are the baseline
    ({"two_camps": True, "separation": 4.0, "bounded": True}, "camps", 1.0),
])
def test_severity_parts(row, part, want) -> None:
    base = {"bounded": False, "polar_share": 0.0, "rise": 0.0, "rise_rel": 0.0, "trend_p": 1e-4, "two_camps": False,
            "separation": 0.0, "camp_low": -1.0, "camp_high": 1.0, "units_polar_last": 0.0, "died_rel": 0.0,
            "units_died_count": 0}
    _, parts = S.severity(base | row)
    assert parts[part] == pytest.approx(want)
