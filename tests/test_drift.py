"""Drift: oracle tests against NumPy on X, planted drift stores, healthy controls."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from gradforensics.analysis.kinds import drift
from gradforensics.analysis.kinds.drift.stats import drift_slab, hinge_changepoints
from gradforensics.analysis.toolkit.units import unit_series
from gradforensics.errors import SpecError
from gradforensics.testing import planted_directions as P
from gradforensics.testing.contracts import AnalysisContract


def _hinge(y: np.ndarray) -> tuple[int | None, float]:
    return hinge_changepoints([y])[0]


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def _u(X: np.ndarray) -> float:
    n = len(X)
    return float((np.sum(X.sum(0) ** 2) - np.sum(X**2)) / (n * (n - 1)))


def test_drift_statistics_match_numpy_oracle() -> None:
    p = P.planted_drift(seed=5, n=96, cause="source", snr=0.5)
    X = p.unit_matrix(P.mlp_name(1), None)
    A = p.mixture.astype(np.float64)
    [res] = drift_slab([(X @ X.T, A)], window=None)
    w = 6                                                           # max(4, ceil(96/16))
    m0 = X[:w].mean(axis=0)
    rec = [_cos(X[i], np.delete(X[:w], i, axis=0).mean(axis=0)) for i in range(w)]
    rec += [_cos(X[i], m0) for i in range(w, 96)]
    np.testing.assert_allclose(res.record_cos, rec, rtol=1e-9)
    wcos = [_cos(X[s:s + w].mean(axis=0), m0) for s in range(w, 96, w)]
    np.testing.assert_allclose(res.window_cos[1:, 1], wcos, rtol=1e-9)
    r = spearmanr(np.arange(96 - w), rec[w:], alternative="less")
    assert res.row["rho"] == pytest.approx(r.statistic) and res.row["p_value"] == pytest.approx(r.pvalue)
    k = (96 // w - 1) // 3                                          # thirds of the comparison windows
    late = X[96 - k * w:]
    assert res.row["cos_early"] == pytest.approx(np.mean(wcos[:k]))
    assert res.row["cos_late"] == pytest.approx(np.mean(wcos[-k:]))
    cross = (late @ X[:w].T).mean()
    deb = cross / np.sqrt(_u(late) * _u(X[:w]))
    assert res.row["cos_late_debiased"] == pytest.approx(np.clip(deb, -1, 1))
    assert res.row["rotation"] == pytest.approx(1 - np.clip(deb, -1, 1))
    M, *_ = np.linalg.lstsq(A, X, rcond=None)
    d = late.mean(axis=0) - m0
    al = [_cos(m, d) for m in M]
    assert res.row["align_idx"] == int(np.argmax(al)) == 1
    assert res.row["aligned_cosine"] == pytest.approx(max(al))


def test_hinge_changepoint_finds_the_knee() -> None:
    t = np.arange(100.0)
    y = np.where(t < 40, 1.0, 1.0 - 0.02 * (t - 40))
    k, slope = _hinge(y)
    assert k == 40 and slope == pytest.approx(-0.02)
    y[[3, 50]] = np.nan                                              # NaNs are skipped
    assert _hinge(y)[0] == 40
    assert _hinge(np.linspace(0, 1, 30))[0] is None   # a rise is not a fall


def test_hinge_changepoint_matches_brute_force_least_squares() -> None:
    rng = np.random.default_rng(8)
    y = np.r_[np.ones(50), 1 - 0.03 * np.arange(50)] + 0.1 * rng.standard_normal(100)
    y[7] = np.nan
    t = np.flatnonzero(np.isfinite(y)).astype(float)
    v = y[np.isfinite(y)]
    best = None
    for j in range(1, v.size - 1):
        Z = np.c_[np.ones_like(t), np.maximum(0, t - t[j])]
        c, *_ = np.linalg.lstsq(Z, v, rcond=None)
        sse = float(np.sum((v - Z @ c) ** 2))
        if c[1] < 0 and (best is None or sse < best[0]):
            best = (sse, int(t[j]), float(c[1]))
    assert best is not None
    k, slope = _hinge(y)
    assert (k, slope) == (best[1], pytest.approx(best[2]))


@pytest.mark.parametrize("cause", ["rotation", "source"])
def test_planted_drift_is_flagged_where_planted(cause: str) -> None:
    p = P.planted_drift(seed=2, cause=cause, since=64)
    ctx = p.context()
    res = drift.compute(ctx)
    fl = drift.flags(res, ctx)
    hot = {(f.tensor, f.head) for f in fl if f.severity > 0.5}
    # every head of layer 1's q_proj drifts: the whole-tensor flag tells that story
    assert hot == {(P.mlp_name(1), None), (P.q_name(1), None)}
    t = res.table
    healthy = t[t.layer == 0]
    assert healthy.severity.max() <= 0.5
    for f in fl:
        assert 64 - 8 <= f.records[0] <= 64 + 32, f.summary            # since when (the cosine falls slowly at first)
        assert f.records[1] == p.n - 1
        assert "since record" in f.summary and f.tensor in f.summary
    if cause == "source":
        assert all(f.sources == ("code",) for f in fl)
        assert "aligns with source 'code'" in fl[0].summary
    else:
        assert all(f.sources == () for f in fl)


def test_replay_mode_gives_table_but_no_flag() -> None:
    p = P.planted_drift(seed=2, mode="replay")
    ctx = p.context()
    res = drift.compute(ctx)
    assert len(res.table) == 2 * 6 and res.table["p_value"].min() < 1e-6
    assert drift.flags(res, ctx) == [] and res.table.severity.max() == 0.0


@pytest.mark.parametrize("snr", [0.05, 1.0, 10.0])
def test_healthy_control_raises_no_flag_above_half(snr: float) -> None:
    for seed in range(4):
        ctx = P.healthy_directions(seed=seed, snr=snr, noise_decay=1.0 if seed % 2 else 0.0).context()
        res = drift.compute(ctx)
        assert res.table.severity.max() <= 0.5
        assert all(f.severity <= 0.5 for f in drift.flags(res, ctx))


def test_table_layout_and_nonfinite_records_excluded() -> None:
    p = P.with_nonfinite(P.planted_drift(seed=3), P.mlp_name(1), [5, 70])
    ctx = p.context()
    res = drift.compute(ctx)
    t = res.table
    assert list(t.columns[:2]) == ["tensor", "head"]
    q = t[t.tensor == P.q_name(0)]
    assert q["head"].isna().sum() == 1 and sorted(q["head"].dropna()) == [0, 1, 2, 3]
    row = t[(t.tensor == P.mlp_name(1))].iloc[0]
    assert row.n_excluded == 2 and row.n_records == p.n - 2 and np.isfinite(row.rotation)
    cos = unit_series(res.series, "record_cosine", P.mlp_name(1), None)
    assert np.isnan(cos[[5, 70]]).all() and np.isfinite(np.delete(cos, [5, 70])).all()
    assert any(f.tensor == P.mlp_name(1) for f in drift.flags(res, ctx))


def test_too_few_records_gives_empty_statistics() -> None:
    ctx = P.healthy_directions(seed=0, n=12).context()
    res = drift.compute(ctx)
    assert res.table["p_value"].isna().all() and (res.table.severity == 0).all()


def test_options_and_determinism() -> None:
    ctx = P.planted_drift(seed=1).context({"drift": {"window": 16}})
    a, b = drift.compute(ctx), drift.compute(ctx)
    assert (a.table["window"] == 16).all()
    np.testing.assert_array_equal(a.table.severity, b.table.severity)
    with pytest.raises(SpecError, match="'window' option of drift"):
        drift.compute(P.planted_drift(seed=1).context({"drift": {"window": 1}}))


def test_plot_draws_the_evidence() -> None:
    from matplotlib.figure import Figure

    ctx = P.planted_drift(seed=2).context()
    res = drift.compute(ctx)
    flag = drift.flags(res, ctx)[0]
    ax = Figure().add_subplot()
    drift.plot(res, flag, ax)
    assert ax.get_xlabel() == "record" and "cosine" in ax.get_ylabel()
    assert "drift" in ax.get_title() and flag.tensor in ax.get_title()
    assert len(ax.lines) >= 3                                          # records, windows, change point


# ------------------------------------------------------------- end to end (engine)
class TestDriftContract(AnalysisContract):
    analysis_name = "drift"
    factory = staticmethod(lambda path, seed: P.planted_drift(seed=seed).write(path))


def test_engine_pass_matches_numpy_context(tmp_path) -> None:
    import gradforensics as gf

    p = P.planted_drift(seed=3, cause="source")
    store = p.write(tmp_path / "drift.zarr")
    found = gf.analyze(store.path, only="drift", options={"engine": {"persist": False}}, progress=False)
    want = drift.compute(p.context()).table
    got = found.table("drift")
    for col in ("cos_early", "cos_late", "rotation", "rho", "severity"):
        np.testing.assert_allclose(got[col], want[col], atol=1e-4, err_msg=col)
    assert {(f.tensor, f.head, f.sources) for f in found.flags} == {
        (P.mlp_name(1), None, ("code",)), (P.q_name(1), None, ("code",))}
