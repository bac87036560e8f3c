"""Conflict: oracle tests (means, cosines, permutation p) against NumPy on X, planted conflict, controls."""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.kinds.conflict import permtest as pt
from gradforensics.analysis.kinds.conflict import unit as cu
from gradforensics.analysis.toolkit.units import head_of, unit_series
from gradforensics.testing import planted_directions as P
from gradforensics.testing.contracts import AnalysisContract

Q1, M2 = P.q_name(1), P.mlp_name(2)
PLANTED = {(Q1, 1), (Q1, 2), (M2, None)}


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def _sequential(null: np.ndarray, t: float, B: int, h: int | None = 10) -> tuple[float, int]:
    """Besag & Clifford's p of one pair by a direct count over its draws *null* (in draw order), and the draws
    it used: ``h / L`` at the draw ``L < B`` where the h-th draw reaches *t*, else ``(1 + #) / (B + 1)``."""
    reach = null <= t
    L = int(np.argmax(np.cumsum(reach) >= h)) + 1 if h is not None and reach.sum() >= h else B + 1
    return (h / L, L) if h is not None and L < B else ((1 + reach.sum()) / (B + 1), B)


@pytest.mark.parametrize("mixed", [False, True])
def test_cosines_and_permutation_p_match_numpy_oracle(mixed: bool) -> None:
    p = P.planted_conflict(seed=3, n=60, mixed=mixed, snr=0.3)
    X = p.unit_matrix(Q1, 1)
    A = p.mixture.astype(np.float64)
    opts = cu.ConflictOptions(permutations=59, seed=7)
    rows, cos, _ = cu.conflict_unit(X @ X.T, A, opts, training=False)
    M, *_ = np.linalg.lstsq(A, X, rcond=None)                        # per-source means, straight from X
    want = np.array([[_cos(a, b) for b in M] for a in M])
    np.testing.assert_allclose(cos, want, rtol=1e-9)
    perms = pt.permutations(60, 59, 7, None)
    for r in rows:
        a, b = r["a"], r["b"]
        null = []
        for pi in perms:                                              # brute force: refit on shuffled labels
            Mp, *_ = np.linalg.lstsq(A[pi], X, rcond=None)
            null.append(Mp[a] @ Mp[b])                                # the statistic: the means' inner product
        null = np.array(null)
        t = M[a] @ M[b]
        assert r["cosine"] == pytest.approx(want[a, b])
        want_p, L = _sequential(null, t + 1e-9 * abs(t), 59)
        assert r["p_value"] == pytest.approx(want_p) and r["draws"] == L
        assert r["z"] == pytest.approx((null[:L].mean() - t) / null[:L].std(), rel=1e-6)
    zh_en = next(r for r in rows if (r["a"], r["b"]) == (0, 1))
    assert zh_en["cosine"] < 0 and zh_en["p_value"] == pytest.approx(1 / 60)


def test_nearly_opposite_sources_in_training_mode_are_significant() -> None:
    """Two sources pointing nearly opposite ways, every record dominated by its source's mean.

    Relabelling the records within blocks gives groups whose means are ±(k−m)/(k+m) of one
    direction, so their *cosine* is near −1 for most relabellings: a cosine statistic had
    z ≈ 1.6 here (severity 0 after correction, found through the what-if tests). The inner
    product shrinks towards the shared mean under relabelling and resolves it.
    """
    rng = np.random.default_rng(0)
    n, d = 36, 64
    mu = rng.standard_normal(d)
    mu /= np.linalg.norm(mu)
    src = np.arange(n) % 3                                            # zh, en, code round robin
    means = np.stack([mu, -0.98 * mu + 0.2 * _unit_orthogonal(rng, mu), _unit_orthogonal(rng, mu)])
    X = means[src] * rng.uniform(0.8, 1.2, size=(n, 1)) + 0.02 * rng.standard_normal((n, d))
    rows, _, _ = cu.conflict_unit(X @ X.T, np.eye(3)[src], cu.ConflictOptions(), training=True)
    zh_en = next(r for r in rows if (r["a"], r["b"]) == (0, 1))
    assert zh_en["cosine"] < -0.95
    assert zh_en["p_value"] == pytest.approx(1 / 1000) and zh_en["z"] > 6
    assert cu.severity_p(zh_en["p_value"], zh_en["z"], 999) < 1e-8
    others = [r for r in rows if (r["a"], r["b"]) != (0, 1)]
    assert all(r["p_value"] > 0.01 for r in others)                  # orthogonal pairs: not less aligned


def _unit_orthogonal(rng: np.random.Generator, v: np.ndarray) -> np.ndarray:
    w = rng.standard_normal(v.size)
    w -= (w @ v) * v
    return w / np.linalg.norm(w)


def test_permuted_source_grams_match_direct() -> None:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 12))
    A = rng.dirichlet(np.ones(3), size=30)
    Q = np.linalg.pinv(A.T @ A)
    perms = pt.permutations(30, 5, 1, None)
    got = pt.permuted_source_grams(X @ X.T, A, Q, perms, chunk=2)
    for g, pi in zip(got, perms):
        Mp = Q @ A[pi].T @ X
        np.testing.assert_allclose(g, Mp @ Mp.T, rtol=1e-9, atol=1e-12)


def test_block_permutations_stay_in_their_blocks() -> None:
    perms = pt.permutations(50, 200, 0, 8)
    blocks = np.arange(50) // 8
    assert (blocks[perms] == blocks[None, :]).all()
    assert all(sorted(p) == list(range(50)) for p in perms[:5])
    assert len({tuple(p) for p in perms}) == 200                        # distinct
    np.testing.assert_array_equal(perms, pt.permutations(50, 200, 0, 8))  # seeded


@pytest.mark.parametrize(("mode", "mixed"), [("replay", False), ("replay", True), ("training", False)])
def test_conflict_is_localised_to_the_planted_heads(mode: str, mixed: bool) -> None:
    p = P.planted_conflict(seed=4, mode=mode, mixed=mixed)
    ctx = p.context()
    res = cf.compute(ctx)
    fl = cf.flags(res, ctx)
    hot = [f for f in fl if f.severity > 0.5]
    assert {(f.tensor, f.head) for f in hot} == PLANTED                # exactly those heads, no whole-tensor echo
    assert all(f.sources == ("zh", "en") for f in fl)                   # the consistent source is never named
    for f in hot:
        assert f.evidence["cosine"] == pytest.approx(-0.6, abs=0.1)
        assert f.evidence["p_value"] == pytest.approx(1 / 1000)
        assert f.evidence["depth_band"] == [1, 2]
        assert "'zh' and 'en' gradients point opposite ways" in f.summary and "p < 0.001" in f.summary
    assert next(f for f in hot if f.head == 1).evidence["heads"] == [1, 2]
    t = res.table
    code = t[(t.source_a == "code") | (t.source_b == "code")]
    assert code.severity.max() == 0.0                                   # differs from both, conflicts with neither
    planted_or_holding = PLANTED | {(Q1, None)}                         # the whole q_proj holds heads 1, 2
    keys = [(tensor, head_of(h)) for tensor, h in zip(t.tensor, t["head"])]
    healthy = t[[k not in planted_or_holding for k in keys]]
    assert len(healthy) == 3 * (3 * 6 - 4) and healthy.severity.max() <= 0.5


def test_table_contract_columns_and_rows() -> None:
    ctx = P.planted_conflict(seed=0, n_layers=3).context()
    t = cf.compute(ctx).table
    assert list(t.columns[:2]) == ["tensor", "head"]
    assert {"source_a", "source_b", "cosine", "p_value"} <= set(t.columns)
    q = t[t.tensor == Q1]
    assert len(q) == 5 * 3                                              # (whole + 4 heads) x 3 pairs
    assert q["head"].isna().sum() == 3
    assert set(zip(q.source_a, q.source_b)) == {("zh", "en"), ("zh", "code"), ("en", "code")}
    assert t.severity.between(0, 1).all()


@pytest.mark.slow
def test_healthy_control_raises_no_flag_above_half() -> None:
    for seed in range(3):
        for snr in (0.05, 1.0, 10.0):
            for mode, mixed in (("replay", False), ("training", True)):
                ctx = P.healthy_directions(seed=seed, snr=snr, mode=mode, mixed=mixed).context()
                res = cf.compute(ctx)
                assert res.table.severity.max() <= 0.5, (seed, snr, mode)


def test_single_source_and_nonfinite_records() -> None:
    ctx = P.healthy_directions(seed=0, sources=("en",)).context()
    res = cf.compute(ctx)
    assert len(res.table) == 0 and cf.flags(res, ctx) == []
    p = P.with_nonfinite(P.planted_conflict(seed=1), M2, [0, 1, 2])
    res = cf.compute(p.context())
    row = res.table[(res.table.tensor == M2) & (res.table.source_a == "zh") & (res.table.source_b == "en")].iloc[0]
    assert row.n_excluded == 3 and row.n_records == p.n - 3 and row.severity > 0.5


def test_depth_profile_series_and_plot() -> None:
    from matplotlib.figure import Figure

    ctx = P.planted_conflict(seed=2).context()
    res = cf.compute(ctx)
    prof = res.series["depth/zh|en"]
    assert list(prof[:, 0]) == [0, 1, 2] and list(prof[:, 2]) == [0, 3, 1]   # q_proj whole + heads 1, 2; mlp 2
    M = unit_series(res.series, "cosine_matrix", Q1, 1)
    assert M.shape == (3, 3) and M[0, 1] < 0 < M[0, 2]
    flag = next(f for f in cf.flags(res, ctx) if f.head == 1)
    fig = Figure()
    ax = fig.add_subplot()
    cf.plot(res, flag, ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["zh", "en", "code"]
    assert "conflict" in ax.get_title() and "zh and en" in ax.get_title()
    assert len(ax.texts) == 9 and ax.get_xlabel() == "source"


# ------------------------------------------------------------- end to end (engine)
class TestConflictContract(AnalysisContract):
    analysis_name = "conflict"
    store_suffix = ".h5"
    factory = staticmethod(lambda path, seed: P.planted_conflict(seed=seed).write(path))


def test_engine_pass_localises_conflict_in_heads(tmp_path) -> None:
    import gradforensics as gf

    p = P.planted_conflict(seed=6, mixed=True)
    store = p.write(tmp_path / "conflict.zarr")
    found = gf.analyze(store.path, only="conflict", options={"engine": {"persist": False}}, progress=False)
    assert {(f.tensor, f.head) for f in found.flags if f.severity > 0.5} == PLANTED
    assert all(f.sources == ("zh", "en") for f in found.flags)
    want = cf.compute(p.context()).table
    got = found.table("conflict")
    for col in ("cosine", "cosine_debiased"):
        np.testing.assert_allclose(got[col], want[col], atol=1e-4, err_msg=col)


def test_findings_persisted_in_the_store_still_plot(tmp_path) -> None:
    from matplotlib.figure import Figure

    import gradforensics as gf
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.store.reader import Store

    store = P.planted_conflict(seed=1, n_layers=3).write(tmp_path / "c.h5")
    gf.analyze(store.path, only="conflict", progress=False)
    back = read_findings(Store(store.path))
    flag = next(f for f in back.flags if f.kind == "conflict" and f.head == 1)
    ax = Figure().add_subplot()
    cf.plot(back.results["conflict"], flag, ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["zh", "en", "code"] and len(ax.texts) == 9


def test_each_unit_draws_its_own_reproducible_permutations() -> None:
    a = pt.permutations(40, 50, cu.unit_seed(0, "model.layers.1.q.weight", 2), None)
    b = pt.permutations(40, 50, cu.unit_seed(0, "model.layers.1.q.weight", 3), None)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, pt.permutations(40, 50, cu.unit_seed(0, "model.layers.1.q.weight", 2), None))
    assert cu.unit_seed(0, "t", None) == (0, 2238339752, 0)          # crc32: the same on every platform


def test_streams_tensor_gives_a_tensors_heads_the_tensors_permutations() -> None:
    whole = cu.unit_seed(0, "model.layers.1.q.weight", None)
    assert cu.unit_seed(0, "model.layers.1.q.weight", 3, "tensor") == whole
    assert cu.unit_seed(0, "model.layers.2.q.weight", 3, "tensor") != whole
    with pytest.raises(ValueError, match="streams"):
        cu.unit_seed(0, "t", 1, "head")


@pytest.mark.parametrize("streams", ["unit", "tensor"])
def test_compute_with_either_stream_finds_the_planted_heads(streams: str) -> None:
    """The option through ``compute``: the same planted heads flagged with either stream."""
    p = P.planted_conflict(seed=4, mode="training")
    ctx = p.context({"conflict": {"streams": streams}})
    res = cf.compute(ctx)
    hot = {(f.tensor, f.head) for f in cf.flags(res, ctx) if f.severity > 0.5}
    assert hot == PLANTED


def _documented_draws(n: int, B: int, seed: tuple[int, ...], block: int | None) -> np.ndarray:
    """The permutations as the module documents them, straight from NumPy: uniform keys from
    ``default_rng([*seed, n, block or 0])``, the block index added, ``argsort`` row by row."""
    keys = np.random.default_rng([*seed, n, block or 0]).random((B, n))
    if block:
        keys += (np.arange(n) // block)[None, :]
    return np.argsort(keys, axis=1)


@pytest.mark.parametrize(("mode", "mixed"), [("replay", False), ("training", True)])
def test_table_p_values_are_a_brute_force_permutation_test_of_each_unit(mode: str, mixed: bool) -> None:
    """Every unit of ``compute``'s table (all units at once, each seeded by its name) against NumPy on its raw
    gradients: the per-source means by least squares, their cosine (to 1e-9), and the one-sided sequential
    permutation p-value of the inner product over the documented draws, by a direct count: ``h / L`` where
    the 10th reaching draw is the L-th (< B), else ``(1 + #{t_π <= t}) / (B + 1)`` (equal counts: a tie margin
    of 1e-9 |t| keeps rounding out of it); some pairs stop early, some run to B."""
    from gradforensics.analysis.toolkit.kspace import window_size

    p = P.planted_conflict(seed=6, n=48, mode=mode, mixed=mixed)
    B = 99
    ctx = p.context({"conflict": {"permutations": B, "seed": 3}})
    table = cf.compute(ctx).table
    A = p.mixture.astype(np.float64)
    n = A.shape[0]
    block = window_size(n) if mode == "training" else None
    checked = stopped = 0
    for r in table.itertuples(index=False):
        head = head_of(r.head)
        X = p.unit_matrix(r.tensor, head)
        M, *_ = np.linalg.lstsq(A, X, rcond=None)
        a, b = p.sources.index(r.source_a), p.sources.index(r.source_b)
        t = M[a] @ M[b]
        np.testing.assert_allclose(r.cosine, _cos(M[a], M[b]), rtol=1e-9)
        null = []
        for pi in _documented_draws(n, B, cu.unit_seed(3, r.tensor, head), block):
            Mp, *_ = np.linalg.lstsq(A[pi], X, rcond=None)
            null.append(Mp[a] @ Mp[b])
        null = np.array(null)
        if np.min(np.abs(null - t)) < 1e-9 * abs(t):
            continue                                   # a near-tie could count either way
        want_p, L = _sequential(null, t, B)
        assert r.p_value == want_p and r.draws == L, (r.tensor, head, r.source_a, r.source_b)
        checked += 1
        stopped += L < B
    assert checked > 20 and 0 < stopped < checked
