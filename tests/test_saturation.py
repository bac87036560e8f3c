"""Saturation: bimodality statistics against analytic values, planted polarising modules, healthy controls."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds import saturation as S
from gradforensics.errors import SpecError
from gradforensics.testing.contracts import AnalysisContract
from gradforensics.testing.planted_units import planted_saturation_store, run_analysis

SMALL = {"n_records": 48, "onset": 16, "tokens": 64, "units": 40}


def test_bimodality_coefficient_analytic_values() -> None:
    rng = np.random.default_rng(0)
    assert S.bimodality_coefficient(rng.normal(size=200_000)) == pytest.approx(1 / 3, abs=0.01)
    assert S.bimodality_coefficient(rng.uniform(size=200_000)) == pytest.approx(5 / 9, abs=0.01)
    two_points = np.r_[np.zeros(5000), np.ones(5000)]
    assert S.bimodality_coefficient(two_points) == pytest.approx(1.0, abs=0.01)


def test_two_camps_finds_the_camps_and_ignores_unimodal_shapes() -> None:
    rng = np.random.default_rng(1)
    split = np.r_[rng.normal(-0.9, 0.05, 300), rng.normal(0.8, 0.05, 200)]
    c = S.two_camps(split)
    assert c.two_camps and c.means == pytest.approx((-0.9, 0.8), abs=0.02)
    assert c.weights == pytest.approx((0.6, 0.4), abs=0.02)
    assert c.separation == pytest.approx(np.sqrt(2) * 1.7 / np.sqrt(2 * 0.05 ** 2), rel=0.1)
    assert not S.two_camps(rng.normal(-0.5, 0.1, 500)).two_camps
    assert not S.two_camps(-1 + rng.gamma(2.0, 0.1, 500)).two_camps          # skewed, unimodal
    tight = np.r_[rng.normal(0.0, 0.002, 300), rng.normal(0.03, 0.002, 300)]
    assert not S.two_camps(tight).two_camps                                   # separated, but no gap
    assert not S.two_camps(np.r_[rng.normal(-0.9, 0.05, 480), rng.normal(0.8, 0.05, 20)]).two_camps


def test_onset_record_of_a_step() -> None:
    rng = np.random.default_rng(2)
    p = np.r_[np.full(30, 0.02), np.full(34, 0.5)] + rng.normal(0, 0.01, 64)
    assert S.onset_record(p, 0.02, 0.48, 0.01) in range(28, 33)
    assert S.onset_record(np.full(64, 0.02), 0.02, 0.0) is None


@pytest.fixture(scope="module")
def relu_store(tmp_path_factory):
    p = planted_saturation_store(tmp_path_factory.mktemp("relu") / "s.zarr", "relu", **SMALL)
    return p, *run_analysis(p.path, "saturation")


def test_lazy_reductions_match_numpy(relu_store) -> None:
    p = relu_store[0]
    store = gf.open_store(p.path)
    import dask

    lz = dict(zip(*(lambda d: (list(d), dask.compute(*d.values())))(S.lazy(store)), strict=True))
    edges = S.window_edges(store.n_records)
    for m in store.act_modules:
        low, high = store.act(m, "frac_low"), store.act(m, "frac_high")
        np.testing.assert_allclose(lz[f"dead|{m}"], (low >= S.POLE).mean(axis=1))
        np.testing.assert_allclose(lz[f"saturated|{m}"], (high >= S.POLE).mean(axis=1))
        want = np.stack([high[a:b].mean(axis=0) for a, b in itertools.pairwise(edges)])
        np.testing.assert_allclose(lz[f"high_w|{m}"], want, rtol=1e-6)


@pytest.mark.parametrize("act", ["relu", *(pytest.param(a, marks=pytest.mark.slow) for a in ("gelu", "silu", "tanh",
                                                                                         "sigmoid"))])
def test_planted_polarising_module_is_the_only_one_flagged(tmp_path, act: str) -> None:
    p = planted_saturation_store(tmp_path / f"{act}.zarr", act, **SMALL)
    result, flags = run_analysis(p.path, "saturation")
    assert {f.tensor for f in flags if f.severity > 0.5} == set(p.sick)
    assert all(f.severity <= 0.5 for f in flags if f.tensor in p.healthy)
    f = next(f for f in flags if f.tensor == p.sick[0])
    assert f.sources == ("code",)
    n = SMALL["n_records"]
    assert p.onset <= f.records[0] <= p.onset + (n - p.onset) // 2 + 4
    assert p.sick[0] in f.summary and "'code'" in f.summary and f"record {f.records[0]}" in f.summary
    row = result.table[(result.table.tensor == p.sick[0]) & (result.table.source == "")].iloc[0]
    assert row["rise"] > 0.3 and row["trend_p"] < 0.01
    if act == "tanh":      # both camps sit at a bound of tanh: all saturated, none dead
        assert row["saturated_share"] > 0.5 and row["dead_share"] < 0.05
    elif act == "sigmoid":
        assert row["two_camps"] and row["camp_low"] < -0.5 < 0.5 < row["camp_high"]
    else:                  # unbounded: the three quarters pushed down die for good; the quarter pushed up is not polar
        assert 0.4 <= row["units_dead_last"] <= 0.8 and f.evidence["died"] == 1.0     # most of the 3/4 pushed down
        assert row["units_polar_last"] == row["units_dead_last"]


@pytest.mark.parametrize("act", ["relu", pytest.param("silu", marks=pytest.mark.slow)])
def test_units_above_the_range_of_an_unbounded_activation_are_not_polar(tmp_path, act: str) -> None:
    """Every unit of a ReLU/SiLU pushed *up* (above its healthy range on every token, on every source): in the
    linear part of the activation, passing its gradient - no finding, though the capture states them saturated."""
    p = planted_saturation_store(tmp_path / f"{act}.zarr", act, dying=0.0, others=1.0, **SMALL)
    result, flags = run_analysis(p.path, "saturation")
    row = result.table[(result.table.tensor == p.sick[0]) & (result.table.source == "")].iloc[0]
    assert row["units_saturated_last"] >= 0.85 and row["units_polar_last"] == 0.0
    assert max((f.severity for f in flags), default=0.0) < 0.5


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "drift"), [(0, 0.0), (1, 0.0), (2, 0.5), (3, 1.0)])
def test_healthy_control_raises_nothing_above_half(tmp_path, seed: int, drift: float) -> None:
    """Fixed biases, and pre-activations whose scale grows up to 2-fold over the run."""
    p = planted_saturation_store(tmp_path / "h.zarr", polarise=False, seed=seed, drift=drift, **SMALL)
    _, flags = run_analysis(p.path, "saturation")
    assert max((f.severity for f in flags), default=0.0) <= 0.5


@pytest.mark.slow
@pytest.mark.parametrize(("act", "others"), [("tanh", 0.4), ("gelu", 1.0)])
def test_replay_mode_has_no_trend_but_still_sees_the_poles(tmp_path, act: str, others: float) -> None:
    """A bounded activation's poles from the shares; a GELU's from units dead on every batch of the closing
    records (three quarters of them, pushed down on every source's batches: dead on one source's inputs only
    is selective, not dead; the quarter pushed up is above the range, not polar)."""
    p = planted_saturation_store(tmp_path / "r.h5", act, mode="replay", others=others, **SMALL)
    result, flags = run_analysis(p.path, "saturation")
    rows = result.table[result.table.source == ""]
    assert rows["trend_p"].isna().all() and rows["onset_record"].isna().all()
    assert {f.tensor for f in flags if f.severity > 0.5} == set(p.sick)


def test_source_rows_weight_mixed_batches_by_their_mixture() -> None:
    polar = np.array([0.9, 0.1, 0.5, 0.1])
    mix = np.array([[1, 0], [0, 1], [0.5, 0.5], [0, 1]], dtype=float)
    pure = np.array([0, 1, -1, 1])
    rows = S.source_rows("m", polar, polar, 0 * polar, mix, pure, ("a", "b"), 0)
    a = next(r for r in rows if r["source"] == "a")
    assert a["polar_share"] == pytest.approx((0.9 + 0.5 * 0.5) / 1.5)
    assert a["polar_share_others"] == pytest.approx((0.1 + 0.5 * 0.5 + 0.1) / 2.5)


def test_plot_draws_the_polarity_map(relu_store) -> None:
    from matplotlib.figure import Figure

    p, result, flags = relu_store
    fig = Figure()
    ax = fig.subplots()
    S.plot(result, flags[0], ax)
    assert ax.get_xlabel() == "record" and "polarity" in ax.get_ylabel() and p.sick[0] in ax.get_title()
    assert ax.collections and ax.lines


def test_options_are_validated() -> None:
    with pytest.raises(SpecError, match="min_camp"):
        S.SaturationOptions.parse({"min_camp": 0.7})
    with pytest.raises(SpecError, match="bad options"):
        S.SaturationOptions.parse({"pole": 0.9})


@pytest.mark.slow
def test_engine_runs_saturation_in_its_single_pass(tmp_path) -> None:
    pytest.importorskip("gradforensics.analysis.engine")
    p = planted_saturation_store(tmp_path / "e.zarr", "gelu", **SMALL)
    findings = gf.analyze(p.path, only="saturation", progress=False)
    assert [f.tensor for f in findings.flags if f.severity > 0.5] == list(p.sick)
    assert findings.table("saturation") is not None


class TestSaturationContract(AnalysisContract):
    analysis_name = "saturation"
    factory = staticmethod(lambda path, seed: planted_saturation_store(path, "gelu", seed=seed, **SMALL))
