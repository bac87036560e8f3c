"""Gradient noise scale: estimators against McCandlish's formulas and planted truth,
detection of a planted noisy tensor and source, calibration on healthy controls."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import AnalysisResult, Context
from gradforensics.analysis.kinds.noise.findings import flags, run_severity, severity
from gradforensics.analysis.kinds.noise.scale import mixture_parts, noise_estimate, noise_parts, robust_z
from gradforensics.analysis.kinds.noise.table import MODEL, noise_table
from gradforensics.analysis.toolkit.kspace import fit_sources, noise_energy
from gradforensics.store.heads import HeadSpec
from gradforensics.store.schema import new_meta
from gradforensics.testing.contracts import AnalysisContract
from gradforensics.testing.planted import TENSORS, noise_store, unit_mean, write_store

OPTS = {"engine": {"persist": False}}


def _rows(findings, head=False):
    t = findings.table("noise")
    t = t[(t["source"] == "") & (t["tensor"] != MODEL)]
    return t if head else t[t["head"].isna()]


# ------------------------------------------------------------- estimators
def test_equal_batches_reduce_to_the_two_batch_size_estimator() -> None:
    """|G|² and tr(Σ) equal McCandlish eq. A.2-A.3 with B_small = B, B_big = N B."""
    rng = np.random.default_rng(0)
    n, b = 40, 16
    x = rng.standard_normal((n, 300)) * 0.3 + rng.standard_normal(300) * 0.1
    k = x @ x.T
    est = noise_estimate(k, np.full(n, b))
    small, big = np.mean(np.sum(x * x, axis=1)), np.sum(x.mean(axis=0) ** 2)
    b_small, b_big = b, n * b
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    tr = (small - big) / (1 / b_small - 1 / b_big)
    assert math.isclose(est["g2"], g2, rel_tol=1e-10)
    assert math.isclose(est["trace_sigma"], tr, rel_tol=1e-10)
    assert math.isclose(est["b_simple"], tr / g2, rel_tol=1e-10)
    assert math.isclose(est["snr"], g2 / (tr / b), rel_tol=1e-10)


def test_jackknife_closed_form_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    n = 15
    bs = rng.integers(4, 64, n)
    x = rng.standard_normal((n, 80)) / np.sqrt(bs)[:, None] + 0.2
    k = x @ x.T
    est = noise_estimate(k, bs)
    bref = bs.mean()
    loo = []
    for m in range(n):
        keep = np.arange(n) != m
        e = noise_estimate(k[np.ix_(keep, keep)], bs[keep])
        loo.append(e["g2"] * bref / e["trace_sigma"])     # same reference batch size
    loo = np.array(loo)
    se = np.sqrt((n - 1) / n * np.sum((loo - loo.mean()) ** 2))
    assert math.isclose(est["snr_se"], se, rel_tol=1e-9)


def test_degenerate_inputs_do_not_raise() -> None:
    assert math.isnan(noise_estimate(np.ones((1, 1)), np.array([8]))["snr"])
    two = noise_estimate(np.array([[2.0, 1.0], [1.0, 2.0]]), np.array([8, 8]))
    assert math.isclose(two["g2"], 1.0) and math.isnan(two["snr_se"])
    no_signal = noise_estimate(np.eye(5), np.full(5, 4))        # orthogonal records: |G|² = 0
    assert no_signal["g2"] == 0 and math.isnan(no_signal["b_simple"]) and math.isnan(no_signal["snr"])
    assert no_signal["snr_note"] == "below resolution" and no_signal["snr_upper"] == 0.0
    assert no_signal["b_simple_lo"] == math.inf       # B_simple unbounded: no measurable signal


def test_jackknife_interval_covers_truth() -> None:
    """The 90% interval covers the true SNR in about 90% of synthetic runs."""
    rng = np.random.default_rng(2)
    d, n, b, snr_true = 256, 64, 32, 1.0
    g = rng.standard_normal(d)
    g /= np.linalg.norm(g)
    hits = 0
    reps = 200
    for _ in range(reps):
        x = g + rng.standard_normal((n, d)) * np.sqrt(1 / (snr_true * d))
        e = noise_estimate(x @ x.T, np.full(n, b))
        hits += e["snr_lo"] <= snr_true <= e["snr_hi"]
    assert 0.8 <= hits / reps <= 0.97


# --------------------------------------------------------- planted truth
@pytest.mark.parametrize("n_samples", [32, "mixed"])
def test_b_simple_within_ten_percent_of_truth(tmp_path, n_samples) -> None:
    ns = (lambda i: (8, 16, 32, 64)[i % 4]) if n_samples == "mixed" else n_samples
    store = noise_store(tmp_path / "n.zarr", 4, n_records=256, n_samples=ns)
    f = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False)
    t = _rows(f, head=True)
    truth = store.truth["b_simple"]
    assert len(t) == len(truth) == 12
    for _, r in t.iterrows():
        key = r["tensor"] if pd.isna(r["head"]) else f"{r['tensor']}#{int(r['head'])}"
        assert abs(r["b_simple"] / truth[key] - 1) < 0.10, (key, r["b_simple"], truth[key])
        assert r["n"] == 256
    # the whole model: |G|² and tr(Σ) summed over the whole tensors
    model = f.table("noise")
    model = model[(model["tensor"] == MODEL) & (model["source"] == "")].iloc[0]
    whole = [k for k in truth if "#" not in k]
    b_model = sum(store.truth["trace_sigma"][k] for k in whole) / sum(store.truth["g2"][k] for k in whole)
    assert abs(model["b_simple"] / b_model - 1) < 0.10


def test_planted_noisy_tensor_is_the_one_flagged(tmp_path) -> None:
    store = noise_store(tmp_path / "n.h5", 1, n_records=64)
    f = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False)
    loud = [x for x in f.flags if x.severity > 0.5]
    assert [(x.tensor, x.head) for x in loud] == [("layers.1.mlp.up.weight", None)]
    # the noisy tensor dominates the model's summed tr(Σ): a run-level note below 0.5, nothing else
    assert sorted(x.tensor for x in f.flags) == ["layers.1.mlp.up.weight", MODEL]
    assert max(x.severity for x in f.flags if x.tensor == MODEL) < 0.5
    ev = loud[0].evidence
    assert ev["snr_hi"] < 1 and ev["b_simple"] > ev["batch_size"]
    assert "B_simple" in loud[0].summary and loud[0].sources == ()


def test_planted_noisy_source_is_named(tmp_path) -> None:
    store = noise_store(tmp_path / "n.zarr", 2, n_records=96, noisy=(), source_noise={"c": 30.0})
    f = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False)
    loud = [x for x in f.flags if x.severity > 0.5]
    assert loud and {x.tensor for x in loud} == {"layers.0.mlp.up.weight"}
    assert all(x.sources == ("c",) for x in loud)


def test_table_columns_per_source_rows(tmp_path) -> None:
    store = noise_store(tmp_path / "n.zarr", 3, n_records=30)
    t = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False).table("noise")
    assert list(t.columns[:3]) == ["tensor", "head", "source"]
    assert {"b_simple", "snr", "n", "g2", "trace_sigma", "snr_lo", "snr_hi"} <= set(t.columns)
    whole = t[(t["tensor"] == "layers.0.mlp.up.weight") & t["head"].isna()]
    assert list(whole["source"]) == ["", "a", "b", "c"]
    assert list(whole["n"]) == [30, 10, 10, 10]


# ------------------------------------------------------------ calibration
def _healthy_grams(rng: np.random.Generator, snr: float, n: int, sources: int) -> dict:
    grams = {}
    for t, shape in TENSORS.items():
        d = int(np.prod(shape))
        g = rng.standard_normal(d)
        g /= np.linalg.norm(g)
        x = g + rng.standard_normal((n, d)) * np.sqrt(1 / (snr * d))
        nf = np.zeros(n, np.int64)
        grams[(t, None)] = GramResult(t, None, x @ x.T, nf, d)
        if "attn" in t:
            blocks = np.stack([HeadSpec(4).split(r.reshape(shape)) for r in x])   # (n, 4, 8, 16)
            for h in range(4):
                xh = blocks[:, h].reshape(n, -1)
                grams[(t, h)] = GramResult(t, h, xh @ xh.T, nf, xh.shape[1])
    return grams


def healthy_severities(snrs=(0.05, 0.25, 1.0, 4.0, 16.0, 64.0), seeds=range(50), n=64) -> np.ndarray:
    """Max noise severity of each healthy synthetic model (shared G, i.i.d. noise, 3 identical sources)."""
    sources = ("a", "b", "c")
    out = []
    for snr in snrs:
        for seed in seeds:
            rng = np.random.default_rng([seed, int(snr * 1000)])
            mix = np.eye(3, dtype=np.float32)[np.arange(n) % 3]
            batches = {"n_samples": np.full(n, 32), "mixture": mix, "step": np.arange(n)}
            ctx = Context(store=None, meta=new_meta(sources, "replay"), batches=batches,  # type: ignore[arg-type]
                          grams=_healthy_grams(rng, snr, n, 3))
            table = noise_table(ctx.grams, batches["n_samples"], ctx.source_of_record(), sources, mix, "replay")
            found = flags(AnalysisResult(table=table), ctx)
            assert {f.tensor for f in found} <= {MODEL} and all(f.sources == () for f in found), found
            assert (table["snr"].dropna() > 0).all()                  # never a negative SNR
            out.append((snr, seed, max((f.severity for f in found), default=0.0)))
    return np.array(out)


@pytest.mark.slow
def test_healthy_models_never_flag_above_half() -> None:
    """Calibration: 6 SNRs (0.05-64) x 50 seeds of healthy models; no noise flag above 0.5.

    Every tensor of a low-SNR (converged) model is low: that is one run-level flag on
    ``whole model`` (< 0.5), never a flag per tensor (checked in ``healthy_severities``).
    """
    res = healthy_severities()
    assert len(res) == 300
    false_alarms = res[res[:, 2] > 0.5]
    assert len(false_alarms) == 0, false_alarms
    # low-SNR healthy models do get low-severity notes, high-SNR ones none
    assert res[res[:, 0] <= 0.25, 2].min() >= 0.15
    assert res[res[:, 0] >= 4, 2].max() == 0.0


def test_severity_shape() -> None:
    assert severity(0.5, 0.8, 8.0, 4.0, z=-2.0) == 0.0            # not an outlier of the model
    assert severity(0.5, 1.2, 8.0, 4.0, z=-9.0) == 0.0            # upper bound not below 1
    assert severity(0.5, 0.8, 3.0, 4.0, z=-9.0) == 0.0            # not outlier_ratio below the median
    assert 0.55 <= severity(0.05, 0.08, 8.0, 4.0, z=-6.0) <= 0.9
    assert severity(0.001, 0.002, 100.0, 4.0, z=-20.0) == pytest.approx(0.9)
    assert severity(math.nan, math.nan, 1.0, 4.0) == 0.0
    assert run_severity(2.0, 2.5) == 0.0 and run_severity(0.9, 1.2) == 0.15
    assert 0.30 <= run_severity(0.5, 0.8) <= run_severity(0.001, 0.002) == pytest.approx(0.45)
    assert run_severity(math.nan, 0.01) < 0.5                     # below resolution: a bound, still < 0.5


def test_robust_z() -> None:
    v = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    assert robust_z(v, 3.0) == 0.0
    assert robust_z(v, 100.0) == pytest.approx(97 / 1.4826)
    assert math.isnan(robust_z(np.array([1.0, 1.0]), 3.0))


# -------------------------------------------------- within sources: oracles
def _sources_store(tmp_path, seed=0, n=96, b=16, between=3.0, noise_b=(4.0, 1.0, 1.0), converged=None):
    """Pure-source replay, tensors w0..w3: source s has its own mean G + between * δ_s (0 for *converged*)
    and tr(Σ_s) = noise_b[s] * B in every tensor."""
    shape = (24, 16)
    rng = np.random.default_rng([seed, 7])
    g = unit_mean(shape, rng)
    means = {s: (0.0 if s == converged else 1.0) * (g + between * unit_mean(shape, rng)) for s in "abc"}
    tr = dict(zip("abc", noise_b))
    names = [f"w{j}" for j in range(4)]

    def grads(i, src, r):
        return {t: (means[src] + np.sqrt(tr[src] / np.prod(shape) / b) * r.standard_normal(shape)).astype(np.float32)
                for t in names}

    store = write_store(tmp_path / "s.zarr", grads, n, ("a", "b", "c"), seed=seed, n_samples=b, mode="replay")
    x = np.asarray(gf.open_store(store.path).read("grads/w0"), dtype=np.float64).reshape(n, -1)
    return store, x, means, tr


def test_within_source_trace_and_mixture_snr_match_numpy_oracle(tmp_path) -> None:
    """tr Σ within sources, |G|² of a mixture batch and B_simple against direct NumPy on the gradients."""
    store, x, means, tr_true = _sources_store(tmp_path)
    n, b = len(x), 16
    src = np.arange(n) % 3
    # oracle: per source, the unbiased sample covariance and the U-statistic |G_s|², cross means off the diagonal
    xs = [x[src == s] for s in range(3)]
    tr_s = [b * np.sum((v - v.mean(0)) ** 2) / (len(v) - 1) for v in xs]
    G = np.array([[xs[s].mean(0) @ xs[t].mean(0) for t in range(3)] for s in range(3)])
    for s in range(3):
        G[s, s] -= tr_s[s] / b / len(xs[s])
    pi = np.full(3, 1 / 3)
    g2_mix, tr_w = pi @ G @ pi, float(np.mean(tr_s))
    f = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False)
    row = f.table("noise")
    row = row[(row["tensor"] == "w0") & (row["source"] == "")].iloc[0]
    assert row["estimator"] == "within sources"
    assert row["trace_sigma"] == pytest.approx(tr_w, rel=1e-5)
    assert row["g2"] == pytest.approx(g2_mix, rel=1e-5)
    assert row["b_simple"] == pytest.approx(tr_w / g2_mix, rel=1e-5)
    assert row["snr"] == pytest.approx(b * g2_mix / tr_w, rel=1e-5)
    # ... and against the truth: the pooled estimate counts the spread between sources as noise
    truth_tr = np.mean(list(tr_true.values()))
    truth_g2 = float(np.sum(np.mean(list(means.values()), axis=0) ** 2))
    assert abs(row["trace_sigma"] / truth_tr - 1) < 0.15 and abs(row["g2"] / truth_g2 - 1) < 0.15
    pooled = noise_estimate(x @ x.T, np.full(n, b))
    assert pooled["trace_sigma"] > 20 * truth_tr
    # the residual of the per-source fit (kspace.noise_energy) is the same noise, for equal batch sizes
    fit = fit_sources(np.eye(3)[src])
    assert b * np.mean(noise_energy(x @ x.T, fit)) == pytest.approx(tr_w, rel=1e-9)


def test_mixture_jackknife_closed_form_matches_brute_force() -> None:
    rng = np.random.default_rng(5)
    n = 18
    bs = rng.integers(4, 40, n).astype(float)
    src = np.arange(n) % 3
    x = rng.standard_normal((n, 60)) / np.sqrt(bs)[:, None] + rng.standard_normal((3, 60))[src] * 0.3
    k = x @ x.T
    p = mixture_parts(k, bs, src, np.array([0.5, 0.3, 0.2]))
    for m in (0, 7, 17):
        keep = np.arange(n) != m
        q = mixture_parts(k[np.ix_(keep, keep)], bs[keep], src[keep], np.array([0.5, 0.3, 0.2]))
        assert p.g2_loo[m] == pytest.approx(q.g2, rel=1e-9)
        assert p.trace_loo[m] == pytest.approx(q.trace, rel=1e-9)
    one = noise_parts(k[src == 0][:, src == 0], bs[src == 0])          # one source: the pooled estimator
    q = mixture_parts(k[src == 0][:, src == 0], bs[src == 0], np.zeros(6, int), np.ones(1))
    assert q.g2 == pytest.approx(one.g2) and q.trace == pytest.approx(one.trace)


def test_noisier_source_is_named_only_when_measurably_noisier(tmp_path) -> None:
    """A converged source (mean 0, SNR ~0) with the others' noise is not 'noisier' (the 30x source of one
    tensor is: ``test_planted_noisy_source_is_named``)."""
    store, *_ = _sources_store(tmp_path, between=0.0, noise_b=(1.0, 1.0, 1.0), converged="c")
    f = gf.analyze(store.path, only=["noise"], options=OPTS, progress=False)
    assert all(x.sources == () for x in f.flags)
    t = f.table("noise")
    assert (t["snr"].dropna() > 0).all()


def test_below_resolution_is_never_a_negative_snr() -> None:
    rng = np.random.default_rng(3)
    hits = 0
    for _ in range(50):
        x = rng.standard_normal((24, 200))                              # no signal at all
        e = noise_estimate(x @ x.T, np.full(24, 8))
        assert not (e["snr"] <= 0)
        if e["snr_note"] == "below resolution":
            hits += 1
            assert math.isnan(e["snr"]) and e["snr_upper"] >= 0 and e["b_simple_lo"] > 0
    assert hits >= 40


class TestNoiseContract(AnalysisContract):
    analysis_name = "noise"
    factory = staticmethod(noise_store)
    healthy_snrs = (0.1, 1.0, 10.0)



def _raw_pooled(x: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """|G|² and tr(Σ) straight from the per-batch mean gradients *x* (rows) with batch sizes *b*, in gradient
    space: ``|G|² = Σ_{i≠j} B_i B_j <g_i, g_j> / Σ_{i≠j} B_i B_j`` and ``tr Σ = mean_i B_i (|g_i|² - |G|²)``
    (McCandlish et al. 2018, eq. A.1, unbiased for unequal batches; eq. A.2-A.3 for equal ones)."""
    s = b @ x
    cross = s @ s - np.sum(b * b * np.sum(x * x, axis=1))
    g2 = cross / (b.sum() ** 2 - np.sum(b * b))
    return float(g2), float(np.mean(b * (np.sum(x * x, axis=1) - g2)))


def test_every_units_rows_are_mccandlish_from_its_raw_gradients() -> None:
    """The noise table of many units and heads at once (the stacked estimators), per source too, with unequal
    batch sizes and a unit with non-finite records, against NumPy on each unit's raw per-batch gradients:
    |G|², tr(Σ), B_simple to 1e-8 (float64 sums of squares of O(1) numbers), the jackknife standard error of
    tr(Σ) and of the SNR by brute-force deletion to 1e-8."""
    rng = np.random.default_rng(28)
    n, S = 36, 3
    src = np.arange(n) % S
    bsz = rng.integers(4, 64, n).astype(np.float64)
    grams, raw = {}, {}
    for t in range(4):
        mean = rng.standard_normal(48) * rng.uniform(0.05, 0.5)
        x = mean + rng.standard_normal((n, 48)) / np.sqrt(bsz)[:, None]
        finite = np.ones(n, bool)
        if t == 2:
            finite[[5, 17]] = False
        name = f"model.layers.{t}.w"
        for h, cols in [(None, slice(None)), (0, slice(0, 24)), (1, slice(24, 48))]:
            xh = x[:, cols]
            grams[(name, h)] = GramResult(name, h, xh @ xh.T, (~finite).astype(np.int64), xh.shape[1])
            raw[(name, h)] = (xh, finite)
    table = noise_table(grams, bsz, src, ("a", "b", "c"), None, "training")
    checked = 0
    for r in table.to_dict("records"):
        if r["tensor"] == MODEL:
            continue
        x, finite = raw[(r["tensor"], None if pd.isna(r["head"]) else int(r["head"]))]
        sel = finite if r["source"] == "" else finite & (src == "abc".index(r["source"]))
        xs, bs = x[sel], bsz[sel]
        g2, tr = _raw_pooled(xs, bs)
        np.testing.assert_allclose([r["g2"], r["trace_sigma"]], [g2, tr], rtol=1e-8)
        if r["snr_note"] == "":
            np.testing.assert_allclose(r["b_simple"], tr / g2, rtol=1e-8)
        loo = np.array([_raw_pooled(np.delete(xs, m, 0), np.delete(bs, m)) for m in range(bs.size)])
        jk = lambda v: np.sqrt((v.size - 1) / v.size * np.sum((v - v.mean()) ** 2))  # noqa: E731
        np.testing.assert_allclose(r["trace_sigma_se"], jk(loo[:, 1]), rtol=1e-8)
        np.testing.assert_allclose(r["snr_se"], jk(loo[:, 0] * bs.mean() / loo[:, 1]), rtol=1e-8)
        checked += 1
    assert checked == len(grams) * (1 + S)


def test_small_median_is_numpys_median() -> None:
    """The siblings' median (a few values, once per head) against ``np.median``: odd and even counts, ties,
    infinities, wide scales; to 1e-15 relative (one addition and a halving)."""
    from gradforensics.analysis.kinds.noise.findings import small_median

    rng = np.random.default_rng(5)
    for t in range(500):
        v = list(rng.standard_normal(int(rng.integers(2, 40))) * 10.0 ** rng.uniform(-200, 200))
        if t % 5 == 0:
            v = [float(x) for x in np.round(np.asarray(v) / max(abs(x) for x in v) * 3)]
        if t % 7 == 0:
            v[int(rng.integers(0, len(v)))] = float(rng.choice([np.inf, -np.inf]))
        np.testing.assert_allclose(small_median(v), np.median(v), rtol=1e-15)
