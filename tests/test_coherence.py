"""Cross-rank coherence: the MSC null distribution, shared vs independent
components, phase and lag, alignment, and a multi-rank store through analyze()."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import coherence, lfilter

from gradforensics.analysis.kinds import coherence as co
from gradforensics.analysis.toolkit.series import Series, group
from gradforensics.testing.contracts import AnalysisContract


def ar1(n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    return lfilter([1.0], [1.0, -a], rng.standard_normal(n + 300))[300:] * np.sqrt(1 - a * a)


def rank_loss(n: int, rng: np.random.Generator, shared: np.ndarray | None = None, sigma: float = 0.05) -> np.ndarray:
    t = np.arange(n)
    y = 2 + 3 * (1 + t / 100) ** -0.7 + sigma * ar1(n, 0.5, rng)
    return y if shared is None else y + shared


def test_msc_null_formula_against_independent_segments() -> None:
    """P(C ≥ c) = (1 − c)^{K−1} (Carter et al. 1973) with K non-overlapping segments."""
    rng = np.random.default_rng(0)
    k, nper = 8, 64
    c = np.concatenate([coherence(rng.standard_normal(k * nper), rng.standard_normal(k * nper), nperseg=nper,
                                  noverlap=0, detrend=False)[1][2:-2] for _ in range(300)])
    for level in (0.3, 0.5):
        assert (c >= level).mean() == pytest.approx(co.msc_pvalue(level, k), abs=0.02)
    assert co.msc_threshold(0.01, k) == pytest.approx(1 - 0.01 ** (1 / 7))
    assert co.msc_pvalue(co.msc_threshold(0.05, 12.5), 12.5) == pytest.approx(0.05)


def test_p_values_conservative_with_overlapping_segments() -> None:
    """With 50 % overlapping Hann segments and K = N/nperseg the test is conservative:
    p < 0.05 in at most 5 % of bins (measured 0.4 %), no significant pair among 100
    independent ones."""
    ps, pairs = [], 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        pc = co.pair_coherence(rank_loss(2000, rng), rank_loss(2000, rng))
        ps.append(pc.p_value[pc.tested])
        pairs += bool((pc.p_adjusted < 0.01).any())
    ps = np.concatenate(ps)
    assert 0.0005 < (ps < 0.05).mean() <= 0.05
    assert pairs == 0


def test_shared_periodic_component_is_coherent_in_phase() -> None:
    rng = np.random.default_rng(1)
    n, period = 3000, 40
    shared = 0.05 * np.sin(2 * np.pi * np.arange(n) / period)
    pc = co.pair_coherence(rank_loss(n, rng, shared, 0.03), rank_loss(n, rng, shared, 0.03))
    k = pc.peaks[0]
    assert pc.p_adjusted[k] < 1e-6 and pc.msc[k] > 0.9
    found_period = 1 / pc.peak_freq[0]
    assert found_period == pytest.approx(period, rel=0.02)      # refined beyond the Welch bin
    assert abs(np.degrees(pc.phase[k])) < 10


def test_lagged_component_phase_gives_the_lag() -> None:
    rng = np.random.default_rng(2)
    n, period, lag = 4096, 64, 8
    t = np.arange(n)
    a = rank_loss(n, rng, 0.05 * np.sin(2 * np.pi * t / period), 0.02)
    b = rank_loss(n, rng, 0.05 * np.sin(2 * np.pi * (t - lag) / period), 0.02)
    g = group(np.concatenate([t, t]), np.concatenate([a, b]), name="loss", ranks=np.repeat(["0", "1"], n))
    row = co.analyze_series([g]).table.iloc[0]
    assert row["significant"] and row["period_steps"] == pytest.approx(period, rel=0.03)
    assert row["lag"] == pytest.approx(lag, rel=0.1)                  # b lags a: positive
    assert row["phase_deg"] == pytest.approx(-360 * lag / period, abs=8)


def test_independent_ranks_are_incoherent() -> None:
    rng = np.random.default_rng(3)
    n = 3000
    t = np.arange(n)
    g = group(np.tile(t, 3), np.concatenate([rank_loss(n, rng) for _ in range(3)]), name="loss",
              ranks=np.repeat(["0", "1", "2"], n))
    tab = co.analyze_series([g]).table
    assert len(tab) == 3 and set(zip(tab["rank_a"], tab["rank_b"])) == {("0", "1"), ("0", "2"), ("1", "2")}
    assert (tab["mean_msc"] < 0.1).all() and not tab["significant"].any()


def test_align_uses_the_common_range_and_coarser_spacing() -> None:
    a = Series("x", "x", np.arange(0.0, 100.0), np.arange(0.0, 100.0))
    b = Series("x", "x", np.arange(10.0, 200.0, 2.0), np.arange(10.0, 200.0, 2.0) * 2)
    grid, ya, yb = co.align(a, b)
    assert grid[0] == 10 and grid[-1] == 98 and np.all(np.diff(grid) == 2)
    np.testing.assert_allclose(ya, grid)
    np.testing.assert_allclose(yb, 2 * grid)
    far = Series("x", "x", np.arange(500.0, 600.0), np.zeros(100))
    assert co.align(a, far)[0].size == 0


def test_many_ranks_pair_with_the_first() -> None:
    assert len(co.rank_pairs(4)) == 6
    assert co.rank_pairs(12) == [(0, j) for j in range(1, 12)]


def test_short_overlap_and_plot() -> None:
    from matplotlib.figure import Figure

    rng = np.random.default_rng(4)
    t = np.arange(1000)
    g = group(np.concatenate([t, t + 990]), np.concatenate([rank_loss(1000, rng), rank_loss(1000, rng)]),
              name="loss", ranks=np.repeat(["0", "1"], 1000))
    assert "overlap too short" in co.analyze_series([g]).table.iloc[0]["note"]
    shared = 0.05 * np.sin(2 * np.pi * t / 20)
    g2 = group(np.tile(t, 2), np.concatenate([rank_loss(1000, rng, shared), rank_loss(1000, rng, shared)]),
               name="loss", ranks=np.repeat(["0", "1"], 1000))
    ax = Figure().add_subplot()
    co.plot_coherence(co.analyze_series([g2]), "loss", ax)
    assert len(ax.lines) == 2


def multi_rank_store(path, seed: int = 0, **_: object):
    """Four ranks, 256 steps each; ranks share a 16-step oscillation of the loss."""
    from gradforensics.recording import Recorder
    from gradforensics.testing.planted import PlantedStore

    rng = np.random.default_rng(seed)
    n, ranks = 256, 4
    shared = 0.05 * np.sin(2 * np.pi * np.arange(n) / 16)
    losses = [rank_loss(n, rng, shared, 0.02) for _ in range(ranks)]
    with Recorder(str(path), sources=["a"], mode="training") as rec:
        for step in range(n):
            for r in range(ranks):
                rec.record(step=step, rank=r, loss=float(losses[r][step]), source="a",
                           grads={"w": rng.standard_normal((4, 4)).astype(np.float32)})
    return PlantedStore(str(path), {"period": 16, "ranks": ranks})


class TestCoherenceContract(AnalysisContract):
    analysis_name = "coherence"
    factory = staticmethod(multi_rank_store)
    expect_planted_flag = False      # context for the loss spectrum: raises no flags (documented)

    def test_ranks_coherent_at_planted_period(self, planted) -> None:
        tab = planted[1].table("coherence")
        assert len(tab) == 6 and tab["significant"].all()
        assert tab["period_steps"].between(15, 17.5).all() and (tab["msc"] > 0.8).all()


def test_persisted_findings_replot_from_an_hdf5_store(tmp_path) -> None:
    """Figure arrays (pair keys with '~', no empty arrays) survive the store round trip."""
    from matplotlib.figure import Figure

    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.analysis.engine.run import analyze
    from gradforensics.analysis.kinds.loss_spectrum import plot_detrended
    from gradforensics.store.reader import Store

    path = tmp_path / "ranks.h5"
    multi_rank_store(path)
    analyze(str(path), only=["loss_spectrum", "coherence"], progress=False)
    back = read_findings(Store(str(path), check_chunks=False))
    fig = Figure()
    a1, a2 = fig.add_subplot(211), fig.add_subplot(212)
    co.plot_coherence(back.results["coherence"], "batches/loss", a1)
    plot_detrended(back.results["loss_spectrum"], "batches/loss", a2)
    assert len(a1.lines) == 7 and len(a2.lines) >= 1        # 6 pairs + the threshold line
