"""Long histories: the banded Gram and window-source sums against NumPy, the band oscillation
test on planted stretches and drifts, planted truths above N0 (no N x N matrix anywhere) and
the exact and long-history regimes side by side at N = 2,000."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.grams import Design, WindowMoments
from gradforensics.analysis.engine.bandstats import band_products, dense_moments, lag_design
from gradforensics.analysis.engine.longhistory import threshold, window_edges_for
from gradforensics.analysis.engine.options import EngineOptions, select_analyses
from gradforensics.analysis.engine.results import load_grams
from gradforensics.analysis.engine.run import run_pass
from gradforensics.analysis.kinds.oscillation.stats import band_oscillation
from gradforensics.errors import SpecError
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store
from gradforensics.testing.planted_long import CONFLICT, DRIFT, HEALTHY, OSC, long_history_store

DIRECTIONS = "drift,oscillation,conflict,noise,nonfinite"


# ------------------------------------------------------------------ kernels
@pytest.mark.parametrize("width", [5, 200])          # shifted products / blocked BLAS products
@pytest.mark.parametrize("n_prev", [0, 3, 7])
def test_band_products_match_numpy(width: int, n_prev: int) -> None:
    rng = np.random.default_rng(0)
    z = rng.standard_normal((150 + n_prev, width)).astype(np.float32)
    prev, x = (z[:n_prev], z[n_prev:]) if n_prev else (None, z)
    got = band_products(x, prev, 7)
    K = z.astype(np.float64) @ z.T.astype(np.float64)
    for lag in range(8):
        want = np.array([K[n_prev + j, n_prev + j - lag] if n_prev + j - lag >= 0 else 0.0 for j in range(150)])
        np.testing.assert_allclose(got[lag], want, rtol=1e-5, atol=1e-4 * np.abs(K).max())


def test_lag_design_isolates_the_cosine_and_ignores_trends() -> None:
    lag = np.arange(1, 33)
    H = lag_design(32, np.array([2, 5, 16, 32]))
    for h, P in zip(H, (2, 5, 16, 32), strict=True):
        assert h @ np.cos(2 * np.pi * lag / P) == pytest.approx(1.0)
        for trend in (np.ones(32), lag, lag**2):
            assert abs(h @ trend) < 1e-8 * np.abs(h).sum() * (lag**2).max()


def test_window_edges_adapt_to_n() -> None:
    assert window_edges_for(100_000).tolist()[:3] == [0, 782, 1564]
    assert window_edges_for(100_000)[-1] == 100_000 and window_edges_for(100_000).size == 129
    assert window_edges_for(10).tolist() == list(range(11))


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """300 records, a plain tensor and a head-split one, NaN in record 7 (head 1), mixed batches."""
    path = tmp_path_factory.mktemp("lh") / "s.zarr"

    def grads(i: int, src: object, rng: np.random.Generator) -> dict[str, np.ndarray]:
        b = rng.standard_normal((4, 2, 40)).astype(np.float32)
        if i == 7:
            b[1, 0, 3] = np.nan
        return {"a.weight": rng.standard_normal((4, 3)).astype(np.float32) + 1.0, "b.weight": b}

    mix = [{"x": 1.0}, {"y": 1.0}, {"x": 0.25, "y": 0.75}]
    write_store(path, grads, 300, ("x", "y"), heads={"b.weight": 4}, source_of=lambda i: mix[i % 3])
    return str(path)


@pytest.mark.parametrize("slab_bytes", [128 << 20, 1 << 16])     # whole slabs / a split record axis
@pytest.mark.parametrize("split_every", [2, 8])
def test_long_pass_matches_numpy(small_store: str, slab_bytes: int, split_every: int) -> None:
    st = Store(small_store)
    eng = EngineOptions(long_history=0, band=5, windows=7, slab_bytes=slab_bytes, split_every=split_every)
    if slab_bytes < 1 << 20:
        assert len(st.lazy("grads/b.weight", slab_bytes).chunks[0]) > 1
    grams, _, long = run_pass(st, select_analyses("drift"), eng, None, False)
    assert grams == {} and long is not None
    d, mix = long.design, st.batches()["mixture"]
    R = np.zeros((d.m, 300))
    for w in range(d.n_windows):
        for s in range(d.n_sources):
            R[w * d.n_sources + s, d.edges[w]:d.edges[w + 1]] = mix[d.edges[w]:d.edges[w + 1], s]
    for key, lg in long.grams.items():
        x = st.lazy(f"grads/{key[0]}").compute()
        x = (x if key[1] is None else x[:, key[1]]).reshape(300, -1).astype(np.float64)
        bad = ~np.isfinite(x).all(axis=1)
        np.testing.assert_array_equal(lg.nonfinite > 0, bad)
        np.testing.assert_array_equal(lg.bad, np.flatnonzero(bad))
        x = np.where(np.isfinite(x), x, 0.0)
        K = x @ x.T
        want = np.zeros((6, 300))
        for lag in range(6):
            want[lag, lag:] = np.diag(K, -lag)
        # the band test's window moments = those of the NumPy band (float32 products: to 1e-5)
        m, w = lg.moments, dense_moments(want, bad.astype(np.int64), d)
        np.testing.assert_array_equal(m.count, w.count)
        np.testing.assert_array_equal(m.cc_n, w.cc_n)
        for a, b in ((m.mean, w.mean), (m.e0, w.e0), (m.cc_sum, w.cc_sum)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
        if key[1] is None:
            np.testing.assert_allclose(lg.norms2(), np.where(bad, np.nan, np.diag(K)), rtol=1e-5)
        # the super-records' Gram: window-source sums over their finite weights
        Y, keep = R @ x, R.sum(axis=1) > 0
        c = (R @ (~bad).astype(float))[keep]
        G = (Y @ Y.T)[np.ix_(keep, keep)] / np.outer(np.where(c > 0, c, 1.0), np.where(c > 0, c, 1.0))
        G[c == 0] = 0.0
        G[:, c == 0] = 0.0
        np.testing.assert_allclose(lg.super_gram, G, rtol=1e-5, atol=1e-5 * np.abs(G).max())
        np.testing.assert_array_equal(lg.super_bad, (c == 0).astype(np.int64))
    assert long.grams[("b.weight", None)].nonfinite[7] == 1 and long.grams[("b.weight", 0)].nonfinite[7] == 0


def _long_gram(x: np.ndarray, band: int, window: int = 200) -> WindowMoments:
    n = x.shape[0]
    K = x @ x.T
    b = np.zeros((band + 1, n))
    for lag in range(band + 1):
        b[lag, lag:] = np.diag(K, -lag)
    d = Design(n=n, edges=np.arange(0, n + 1, window), mixture=np.ones((n, 1)), band=band)
    return dense_moments(b, np.zeros(n, dtype=np.int64), d)


@pytest.mark.slow
def test_band_test_locates_a_middle_stretch_and_ignores_a_drift() -> None:
    rng = np.random.default_rng(3)
    n, d = 6000, 6
    edges = np.arange(0, n + 1, 200)
    m, v = np.eye(d)[0], np.eye(d)[1]
    wave = np.zeros(n)
    wave[2400:3600] = np.where(np.arange(1200) % 4 < 2, 1.0, -1.0)
    osc = m + 2 * wave[:, None] * v + 0.5 * rng.standard_normal((n, d))
    res = band_oscillation(_long_gram(osc, 16), edges)
    assert res["p_value"] < 1e-20 and res["period_records"] == 4
    assert (res["record_first"], res["record_last"]) == (2400, 3599)
    theta = np.linspace(0, np.pi / 2, n)
    drift = np.cos(theta)[:, None] * m + np.sin(theta)[:, None] * v + 0.5 * rng.standard_normal((n, d))
    for x in (drift, m + 0.5 * rng.standard_normal((n, d))):
        assert band_oscillation(_long_gram(x, 16), edges)["p_value"] > 1e-3


def test_engine_options_of_the_regime_are_checked() -> None:
    for bad in ({"long_history": -1}, {"band": 0}, {"windows": 2}):
        with pytest.raises(SpecError, match=f"engine option {next(iter(bad))}"):
            EngineOptions.parse(bad, "engine")
    assert EngineOptions().long_regime(4097) and not EngineOptions().long_regime(4096)
    # N0 shrinks so that the exact regime's Gram matrices (8 N0² bytes per unit) fit 512 MiB
    for units in (1, 6, 1000):
        n0 = threshold(units)
        assert 8 * n0**2 * units <= 512 * 2**20 < 8 * (n0 + 1) ** 2 * units or n0 == 4096
    assert threshold(6) == 3344 and threshold(1000) == 259 and threshold(1000, 10) == 10
    assert EngineOptions(long_history=0).long_regime(1) and not EngineOptions().long_regime(3344, 6)


# ------------------------------------------------------------ planted truths
def _flags(findings: gf.Findings, floor: float = 0.5) -> dict[tuple[str, str], tuple[int, int]]:
    return {(f.kind, f.tensor): f.records for f in findings.flags if f.severity >= floor}


@pytest.fixture(scope="module")
def long_store(tmp_path_factory: pytest.TempPathFactory) -> object:
    return long_history_store(tmp_path_factory.mktemp("lh") / "long.zarr", n=6000)


@pytest.mark.slow
def test_planted_truths_above_n0_with_their_records(long_store: object) -> None:
    path, truth = str(long_store), long_store.truth        # type: ignore[attr-defined]
    f = gf.analyze(path, only=DIRECTIONS, progress=False)
    assert f.header["regime"]["name"] == "long-history"
    w = f.header["regime"]["window"]
    # N₀ = 4,096: six plain tensors, one Gram matrix at a time each (threshold(1); it was 3,344 for all six)
    assert f.header["regime"] == {"name": "long-history", "n0": 4096, "window": w, "windows": 128, "band": 32}
    got = _flags(f)
    for name in OSC:
        lo, hi = truth["oscillation"][name]["records"]
        first, last = got[("oscillation", name)]
        assert lo - 4 * 32 <= first <= lo + 4 * 32 and hi - 4 * 32 <= last <= hi + 4 * 32, (name, first, last)
    t = f.table("oscillation").set_index("tensor")
    assert t.loc[OSC[0], "period_records"] == 2 and t.loc[OSC[1], "period_records"] == 8
    assert ("drift", DRIFT) in got and ("oscillation", DRIFT) not in got
    first, last = got[("conflict", CONFLICT)]
    assert abs(first - truth["conflict"]["since"]) <= 6000 / 8 and last == 5999
    assert not [fl for fl in f.flags if fl.tensor in HEALTHY and fl.severity >= 0.25]
    # nothing N x N is kept: no per-record K in memory, none saved
    assert load_grams(Store(path)) == {}
    assert not Store(path).has("analysis/gram/k") or Store(path).arrays["analysis/gram/k"].shape[0] == 0


@pytest.fixture(scope="module")
def store_2000(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(long_history_store(tmp_path_factory.mktemp("lh") / "n2000.zarr", n=2000))


@pytest.mark.slow
def test_same_truths_at_2000_exact_and_long_agree(store_2000: str) -> None:
    opts = {"engine": {"persist": False}}
    exact = gf.analyze(store_2000, only=DIRECTIONS, progress=False, options=opts)
    long = gf.analyze(store_2000, only=DIRECTIONS, progress=False,
                      options={"engine": {"persist": False, "long_history": 0}})
    assert exact.header["regime"] == {"name": "exact", "n0": 4096} and long.header["regime"]["name"] == "long-history"
    want = {("oscillation", OSC[0]), ("oscillation", OSC[1]), ("drift", DRIFT), ("conflict", CONFLICT)}
    for f in (exact, long):
        got = _flags(f)
        assert want <= set(got), sorted(got)
        assert ("oscillation", DRIFT) not in got
        assert not [fl for fl in f.flags if fl.tensor in HEALTHY and fl.severity >= 0.25]
    # the statistics both regimes compute the same way agree
    ce = exact.table("oscillation").set_index("tensor")["consec_cos"]
    cl = long.table("oscillation").set_index("tensor")["consec_cos"]
    np.testing.assert_allclose(cl[ce.index], ce, atol=1e-6)
    de, dl = (f.table("drift").set_index("tensor") for f in (exact, long))
    assert math.isclose(de.loc[DRIFT, "rotation"], dl.loc[DRIFT, "rotation"], abs_tol=0.1)
    ke, kl = (f.table("conflict").set_index("tensor") for f in (exact, long))
    assert math.isclose(ke.loc[CONFLICT, "cosine_debiased"], kl.loc[CONFLICT, "cosine_debiased"], abs_tol=0.05)
    ne, nl = (f.table("noise") for f in (exact, long))
    ne, nl = (t[(t["source"] == "") & t["head"].isna()].set_index("tensor") for t in (ne, nl))
    for name in HEALTHY:
        assert math.isclose(ne.loc[name, "b_simple"], nl.loc[name, "b_simple"], rel_tol=0.25), name
