"""Long histories kept as window moments: the pass's band-test statistics against a direct NumPy oracle
of the per-record computation (banded Gram, NaN-masked, per window), on a store whose tensors are split
between record blocks *and* feature columns; Chan's combination; non-finite records found exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradforensics.analysis.contract.grams import WindowMoments
from gradforensics.analysis.engine.bandstats import lag_design, oscillation_edges, periods_of
from gradforensics.analysis.engine.options import EngineOptions, select_analyses
from gradforensics.analysis.engine.run import run_pass
from gradforensics.analysis.kinds.oscillation.stats import band_oscillation
from gradforensics.store.layout import LayoutPolicy
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store

N = 1100
BAD = {"h.weight": {(40, 2), (41, 2), (333, 0)}, "c.weight": {(120, None), (121, None), (1050, None)}}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """1,100 records: a head-split tensor (4 heads of 2 x 30) and a plain 8 x 8 one, both in small on-disk chunks
    (split along their features), with a period-4 flip in head 1 over records 200-499 and non-finite records."""
    path = tmp_path_factory.mktemp("lm") / "m.zarr"
    v = np.random.default_rng(1).standard_normal((2, 30)).astype(np.float32)

    def grads(i: int, src: object, rng: np.random.Generator) -> dict[str, np.ndarray]:
        h = rng.standard_normal((4, 2, 30)).astype(np.float32) + 0.5
        if 200 <= i < 500:
            h[1] += (3.0 if i % 4 < 2 else -3.0) * v
        c = rng.standard_normal((8, 8)).astype(np.float32) + 1.0
        for (r, head) in BAD["h.weight"]:
            if r == i:
                h[head, 1, 4] = np.nan
        if i in {r for r, _ in BAD["c.weight"]}:
            c[3, 2] = np.inf
        return {"h.weight": h, "c.weight": c}

    mix = [{"x": 1.0}, {"y": 1.0}, {"x": 0.25, "y": 0.75}]
    write_store(path, grads, N, ("x", "y"), heads={"h.weight": 4}, source_of=lambda i: mix[i % 3],
                layout=LayoutPolicy(chunk_bytes=4096, small_chunk_bytes=1024))
    return str(path)


def _oracle(x: np.ndarray, band: int, edges: np.ndarray) -> dict[str, np.ndarray]:
    """The per-record computation: NaN-masked banded Gram, then per window Z = H @ B[1:] of the finite columns."""
    n = x.shape[0]
    bad = ~np.isfinite(x).all(axis=1)
    x = np.where(np.isfinite(x), x, 0.0)
    B = np.full((band + 1, n), np.nan)
    for lag in range(band + 1):
        B[lag, lag:] = np.einsum("ij,ij->i", x[lag:], x[:n - lag])
        B[lag, lag:][bad[lag:] | bad[:n - lag]] = np.nan
    H = lag_design(band, periods_of(band))
    out: dict[str, list] = {"count": [], "mean": [], "sd": [], "e0": []}
    for w in range(edges.size - 1):
        Bw = B[:, edges[w]:edges[w + 1]]
        Bw = Bw[:, np.isfinite(Bw).all(axis=0)]
        Z = H @ Bw[1:]
        out["count"].append(Bw.shape[1])
        out["mean"].append(Z.mean(axis=1) if Bw.shape[1] else np.zeros(H.shape[0]))
        out["sd"].append(Z.std(axis=1, ddof=1) if Bw.shape[1] > 1 else np.zeros(H.shape[0]))
        out["e0"].append(Bw[0].mean() if Bw.shape[1] else 0.0)
    d = np.sqrt(np.maximum(np.where(bad, np.nan, B[0]), 0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        cc = np.r_[np.nan, B[1, 1:] / (d[1:] * d[:-1])]
    res = {k: np.array(v) for k, v in out.items()}
    res["cc"] = np.clip(cc, -1.0, 1.0)
    res["bad"] = np.flatnonzero(bad)
    return res


def _p_oracle(o: dict[str, np.ndarray], min_records: int = 16) -> float:
    """The band test's p-value from the oracle's per-window statistics (Student t, Bonferroni)."""
    from scipy import stats

    tails = []
    for w in range(o["count"].size):
        k = int(o["count"][w])
        if k < min_records:
            continue
        sd = o["sd"][w]
        t = np.where(sd > 0, o["mean"][w] / np.where(sd > 0, sd, 1.0) * math.sqrt(k), 0.0)
        tails.append(stats.t.sf(t, k - 1))
    if not tails:
        return math.nan
    tails = np.concatenate(tails)
    return float(min(1.0, tails.min() * tails.size))


@pytest.mark.parametrize("slab_bytes", [pytest.param(1 << 16, marks=pytest.mark.slow),   # blocks x columns
                                        128 << 20])                                       # one slab
def test_window_moments_match_the_per_record_oracle(store: str, slab_bytes: int) -> None:
    st = Store(store)
    eng = EngineOptions(long_history=0, band=8, windows=10, slab_bytes=slab_bytes, split_every=3)
    chunks = st.lazy("grads/h.weight", slab_bytes).chunks
    if slab_bytes < 1 << 20:       # both tensors span several record blocks and feature columns (heads)
        assert len(chunks[0]) > 1 and len(chunks[1]) > 1
        assert len(st.lazy("grads/c.weight", slab_bytes).chunks[0]) > 1
        assert len(st.lazy("grads/c.weight", slab_bytes).chunks[1]) > 1
    grams, _, long = run_pass(st, select_analyses("oscillation"), eng, None, False)
    assert grams == {} and long is not None
    edges = oscillation_edges(N, 8, long.design.edges)
    assert set(long.grams) == {("c.weight", None), ("h.weight", None), *(("h.weight", h) for h in range(4))}
    for (tensor, head), g in long.grams.items():
        x = st.lazy(f"grads/{tensor}").compute()
        x = (x if head is None else x[:, head]).reshape(N, -1).astype(np.float64)
        o = _oracle(x, 8, edges)
        m = g.moments
        np.testing.assert_array_equal(m.count, o["count"])
        np.testing.assert_allclose(m.mean, o["mean"], rtol=1e-9, atol=1e-12 * np.abs(o["mean"]).max())
        sd = np.sqrt(m.m2 / np.maximum(m.count - 1, 1)[:, None])
        np.testing.assert_allclose(sd, o["sd"], rtol=1e-9)
        np.testing.assert_allclose(m.e0 / np.maximum(m.count, 1), o["e0"], rtol=1e-12)
        ok = np.isfinite(o["cc"])
        np.testing.assert_array_equal(m.cc_n.sum(), ok.sum())
        assert m.consecutive_cosine() == pytest.approx(o["cc"][ok].mean(), rel=1e-12)
        # the band test's p-value from the moments = from the per-record statistics
        p = band_oscillation(m, edges)["p_value"]
        assert p == pytest.approx(_p_oracle(o), rel=1e-9, abs=1e-300)
        # non-finite records: exact, sparse
        np.testing.assert_array_equal(g.bad, o["bad"])
        if head is None:
            np.testing.assert_allclose(g.norms2(), np.where(np.isin(np.arange(N), o["bad"]), np.nan,
                                                            (np.where(np.isfinite(x), x, 0) ** 2).sum(1)), rtol=1e-12)
    assert long.grams[("h.weight", 1)].moments is not None
    assert band_oscillation(long.grams[("h.weight", 1)], edges)["p_value"] < 1e-10       # the planted flip
    assert band_oscillation(long.grams[("h.weight", 3)], edges)["p_value"] > 1e-3


def test_chan_combination_equals_one_pass() -> None:
    rng = np.random.default_rng(0)
    z = rng.standard_normal((3, 50, 4)) * 1e3 + 5e3          # 3 windows, 50 records, 4 periods
    cut = [0, 17, 50]

    def part(sl: slice) -> WindowMoments:
        y = z[:, sl]
        k = np.full(3, y.shape[1], dtype=float)
        mu = y.mean(axis=1)
        return WindowMoments(k, mu, ((y - mu[:, None]) ** 2).sum(axis=1), y[..., 0].sum(1), k * 0.5, k)

    whole = part(slice(0, 50))
    both = part(slice(cut[0], cut[1])) + part(slice(cut[1], cut[2]))
    np.testing.assert_allclose(both.mean, whole.mean, rtol=1e-14)
    np.testing.assert_allclose(both.m2, whole.m2, rtol=1e-10)
    np.testing.assert_array_equal(both.count, whole.count)
    empty = WindowMoments.zeros(3, 4)
    for got in (empty + whole, whole + empty):                 # a window seen by one part only: taken as is
        np.testing.assert_array_equal(got.mean, whole.mean)
        np.testing.assert_array_equal(got.m2, whole.m2)


def test_nonfinite_records_exact_in_the_long_regime(store: str) -> None:
    import gradforensics as gf

    kw = {"only": ("nonfinite", "oscillation"), "progress": False}
    long = gf.analyze(store, options={"engine": {"persist": False, "long_history": 0, "slab_bytes": 1 << 16}}, **kw)
    exact = gf.analyze(store, options={"engine": {"persist": False}}, **kw)
    assert long.header["regime"]["name"] == "long-history" and exact.header["regime"]["name"] == "exact"
    tl, te = long.table("nonfinite"), exact.table("nonfinite")
    assert tl.to_csv(index=False) == te.to_csv(index=False)
    whole = tl[tl["head"].isna() & (tl["source"] == "")].set_index("tensor")
    for tensor, bad in BAD.items():
        recs = sorted({r for r, _ in bad})
        assert (whole.loc[tensor, "first_record"], whole.loc[tensor, "last_record"]) == (recs[0], recs[-1])
        assert whole.loc[tensor, "records_nonfinite"] == len(recs)
    heads = tl[(tl["tensor"] == "h.weight") & tl["head"].notna() & (tl["source"] == "")].set_index("head")
    assert heads.loc[2, "first_record"] == 40 and heads.loc[0, "first_record"] == 333
    assert heads.loc[1, "records_nonfinite"] == 0
    osc = long.table("oscillation")
    row = osc[osc["tensor"] == "c.weight"].iloc[0]
    assert row["n_excluded"] == 3 and row["n_records"] == N - 3
