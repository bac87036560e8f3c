"""Oscillation: oracle tests, null calibration of the alternation test, planted flips, controls."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.kinds.oscillation import stats as ost
from gradforensics.analysis.toolkit.units import unit_series
from gradforensics.testing import planted_directions as P
from gradforensics.testing.contracts import AnalysisContract


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def test_periodogram_shares_follow_their_beta_law() -> None:
    """Under i.i.d. Gaussian records I_j/SS ~ Beta(1, (n-3)/2); at Nyquist Beta(1/2, (n-2)/2)."""
    rng = np.random.default_rng(0)
    n = 64
    x = rng.standard_normal((4000, n))
    xc = x - x.mean(axis=1, keepdims=True)
    F = np.fft.rfft(xc, axis=1)
    ss = (xc**2).sum(axis=1)
    interior = 2 * np.abs(F[:, 5]) ** 2 / n / ss
    nyquist = np.abs(F[:, n // 2]) ** 2 / n / ss
    assert stats.kstest(interior, stats.beta(1.0, (n - 3) / 2).cdf).pvalue > 1e-3
    assert stats.kstest(nyquist, stats.beta(0.5, (n - 2) / 2).cdf).pvalue > 1e-3


def _periodogram_test(x: np.ndarray) -> tuple[float, float]:
    period, p = ost.periodogram_tests(x[None, :])
    return float(period[0]), float(p[0])


def test_periodogram_p_is_scipy_beta_sf_of_the_detrended_shares() -> None:
    """The test's p from its definition (quadratic trend by np.linalg.lstsq, scipy.stats.beta.sf as the tail);
    rtol 1e-9: the detrending differs only by rounding (QR projection against lstsq)."""
    rng = np.random.default_rng(2)
    for n in (8, 9, 31, 64, 129):
        X = rng.standard_normal((5, n)) + np.cos(np.pi * np.arange(n)) * 0.5
        period, p = ost.periodogram_tests(X, 3, n - 1)
        t = np.linspace(-1.0, 1.0, n)
        T = np.c_[np.ones(n), t, t * t]
        j = np.arange(3, n // 2 + 1)
        dof = np.where(2 * j == n, 1.0, 2.0)
        for x, got_period, got_p in zip(X, period, p, strict=True):
            xc = x - T @ np.linalg.lstsq(T, x, rcond=None)[0]
            F = np.abs(np.fft.rfft(xc)[j]) ** 2
            share = np.clip(np.where(dof == 1.0, F, 2.0 * F) / n / float(xc @ xc), 0.0, 1.0)
            tail = stats.beta.sf(share, dof / 2.0, np.maximum(n - 3 - dof, 1.0) / 2.0)
            best = int(np.argmin(tail))
            assert got_period == n / float(j[best])
            np.testing.assert_allclose(got_p, min(1.0, tail[best] * j.size), rtol=1e-9)


def test_top_components_are_numpy_eigh_s() -> None:
    """Eigenvalues rtol 1e-10 and eigenvectors (sign fixed: largest entry positive) atol 1e-8 against
    np.linalg.eigh, dense and Lanczos (eigsh tol 1e-8) sizes."""
    rng = np.random.default_rng(3)
    for n, d in ((12, 40), (100, 30), (ost.LANCZOS_MIN, 20)):
        X = rng.standard_normal((n, d)) * np.linspace(3.0, 0.5, d)
        Kc = ost.centred(X @ X.T)
        lam, U = ost.top_components(Kc, 3)
        w, V = np.linalg.eigh((X - X.mean(axis=0)) @ (X - X.mean(axis=0)).T)
        w, V = w[::-1][:3], V[:, ::-1][:, :3]
        V = V * np.sign(V[np.argmax(np.abs(V), axis=0), np.arange(3)])
        np.testing.assert_allclose(lam, w, rtol=1e-10)
        np.testing.assert_allclose(U, V, atol=1e-8)


def test_periodogram_test_is_calibrated_and_finds_periods() -> None:
    rng = np.random.default_rng(1)
    ps = ost.periodogram_tests(rng.standard_normal((3000, 96)))[1]
    # valid: P(p < a) <= a up to Monte-Carlo error (3 standard errors) ...
    for a in (0.05, 0.01):
        assert np.mean(ps < a) <= a + 3 * np.sqrt(a * (1 - a) / ps.size), a
    assert np.mean(ps < 0.05) >= 0.03                                    # ... and not uselessly conservative
    t = np.arange(96)
    for period in (2, 3, 8, 16, 32):
        x = P.square_wave(96, period) + 0.8 * rng.standard_normal(96)
        est, p = _periodogram_test(x)
        assert est == pytest.approx(period, rel=0.05) and p < 1e-6, period
    # a trend (fewer than 3 cycles) is not a period
    est, p = _periodogram_test(t / 96 + 0.05 * rng.standard_normal(96))
    assert p > 0.01


def test_two_means_split_is_the_best_split() -> None:
    rng = np.random.default_rng(3)
    x = np.r_[rng.normal(-2, 1, 20), rng.normal(1, 0.5, 13)]
    upper = ost.two_means_split(x)
    xs = np.sort(x)

    def between(c: int) -> float:
        return c * (33 - c) * (xs[:c].mean() - xs[c:].mean()) ** 2

    best = max(range(1, 33), key=between)
    assert upper.sum() == 33 - best and x[upper].min() > x[~upper].max()


def test_unit_statistics_match_numpy_oracle() -> None:
    p = P.planted_oscillation(seed=4, period=2, heads=(1,))
    X = p.unit_matrix(P.q_name(0), 1)
    K = X @ X.T
    cc = ost.consecutive_cosines(K)
    [(row, comp)] = ost.oscillation_slab([(K, p.mixture.astype(float), cc)], False, osc.OscillationOptions(), p.sources)
    assert row["consec_cos"] == pytest.approx(np.mean([_cos(X[i], X[i + 1]) for i in range(p.n - 1)]))
    Xc = X - X.mean(axis=0)
    _, s, vt = np.linalg.svd(Xc, full_matrices=False)
    assert comp is not None and comp.k == 0
    np.testing.assert_allclose(np.abs(comp.scores), np.abs(Xc @ vt[0]), rtol=1e-6)
    np.testing.assert_allclose(np.abs(comp.proj), np.abs(X @ vt[0]), rtol=1e-6)
    assert row["explained"] == pytest.approx(s[0] ** 2 / np.sum(s**2))
    v = vt[0] * np.sign(comp.proj @ (X @ vt[0]))                      # same orientation as the K-space one
    up = (Xc @ v) > 0                                                # the two clusters are cleanly apart
    poles = sorted([(X @ v)[up].mean(), (X @ v)[~up].mean()])
    assert [row["pole_neg"], row["pole_pos"]] == pytest.approx(poles, abs=1e-6)
    assert row["period_records"] == 2.0 and row["reversal"] > 0.9


@pytest.mark.parametrize(("period", "where"), [(2, (P.q_name(0), 1)), (16, (P.q_name(0), 1)),
                                               (16, (P.mlp_name(1), None)), (2, (P.mlp_name(0), None))])
def test_planted_oscillation_is_flagged_where_planted(period: int, where: tuple[str, int | None]) -> None:
    tensor, head = where
    p = P.planted_oscillation(seed=6, period=period, tensor=tensor, heads=None if head is None else (head,),
                              amplitude=1.5)
    ctx = p.context()
    res = osc.compute(ctx)
    fl = osc.flags(res, ctx)
    assert {(f.tensor, f.head) for f in fl if f.severity > 0.5} == {where}
    f = next(f for f in fl if (f.tensor, f.head) == where)
    assert f.evidence["period_records"] == pytest.approx(period, rel=0.05)
    assert f.evidence["pole_pos"] > 0 > f.evidence["pole_neg"]
    assert f.sources == ()                     # sources interleave by 3: the flip is not theirs
    assert f"every {float(period):.1f} records" in f.summary
    others = res.table[(res.table.tensor != tensor)]
    assert others.severity.max() <= 0.5


def test_iid_noise_and_healthy_controls_do_not_fire() -> None:
    for seed in range(3):
        for snr in (0.01, 0.3, 3.0):
            for mode in ("training", "replay"):
                ctx = P.healthy_directions(seed=seed, snr=snr, mode=mode, noise_decay=float(seed)).context()
                res = osc.compute(ctx)
                assert res.table.severity.max() <= 0.5, (seed, snr, mode)


def test_drift_is_not_an_oscillation() -> None:
    ctx = P.planted_drift(seed=1, snr=2.0).context()
    res = osc.compute(ctx)
    assert res.table.severity.max() <= 0.5


def test_interleaved_conflicting_sources_in_replay_are_left_to_conflict() -> None:
    """Replay, zh/en alternating round-robin and pulling opposite ways: a period-2 pattern, but the
    sources explain it, so oscillation stays quiet (conflict flags it)."""
    p = P.planted_conflict(seed=1, mode="replay", sources=("zh", "en"))
    res = osc.compute(p.context())
    assert res.table.severity.max() <= 0.5


def test_interleaved_conflicting_sources_in_training_are_an_oscillation_with_sources() -> None:
    p = P.planted_conflict(seed=1, mode="training", sources=("zh", "en"))
    ctx = p.context()
    res = osc.compute(ctx)
    fl = [f for f in osc.flags(res, ctx) if f.severity > 0.5]
    assert {(f.tensor, f.head) for f in fl} == {(P.q_name(1), 1), (P.q_name(1), 2), (P.mlp_name(2), None)}
    for f in fl:
        assert set(f.sources) == {"zh", "en"} and f.evidence["source_r2"] > 0.9
        assert "data order explains" in f.summary


def test_table_layout_series_and_nonfinite() -> None:
    p = P.with_nonfinite(P.planted_oscillation(seed=2, period=2), P.q_name(0), [10])
    ctx = p.context()
    res = osc.compute(ctx)
    t = res.table
    assert list(t.columns[:2]) == ["tensor", "head"]
    assert t[(t.tensor == P.q_name(0)) & (t["head"] == 0)].n_excluded.item() == 1
    proj = unit_series(res.series, "projection", P.q_name(0), 1)
    assert proj.shape == (p.n,) and np.isfinite(proj).sum() == p.n
    assert np.isnan(unit_series(res.series, "projection", P.q_name(0), 0)[10])
    assert any(f.head == 1 and f.severity > 0.5 for f in osc.flags(res, ctx))


def test_plot_draws_the_evidence() -> None:
    from matplotlib.figure import Figure

    ctx = P.planted_oscillation(seed=2, period=16).context()
    res = osc.compute(ctx)
    flag = osc.flags(res, ctx)[0]
    ax = Figure().add_subplot()
    osc.plot(res, flag, ax)
    assert ax.get_xlabel() == "record" and "projection" in ax.get_ylabel()
    assert "oscillation" in ax.get_title() and "period 16.0" in ax.get_title()
    assert len(ax.collections) == 1 and len(ax.collections[0].get_offsets()) == 128


# ------------------------------------------------------------- end to end (engine)
class TestOscillationContract(AnalysisContract):
    analysis_name = "oscillation"
    factory = staticmethod(lambda path, seed: P.planted_oscillation(seed=seed, period=2).write(path))


def test_engine_pass_finds_square_wave_in_its_head(tmp_path) -> None:
    import gradforensics as gf

    p = P.planted_oscillation(seed=5, period=16, tensor=P.q_name(1), heads=(3,), amplitude=1.5)
    store = p.write(tmp_path / "osc.zarr")
    found = gf.analyze(store.path, only="oscillation", options={"engine": {"persist": False}}, progress=False)
    hot = [f for f in found.flags if f.severity > 0.5]
    assert [(f.tensor, f.head) for f in hot] == [(P.q_name(1), 3)]
    assert hot[0].evidence["period_records"] == pytest.approx(16.0)
    want = osc.compute(p.context()).table
    np.testing.assert_allclose(found.table("oscillation")["consec_cos"], want["consec_cos"], atol=1e-4)
