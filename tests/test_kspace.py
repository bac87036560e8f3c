"""Oracle tests of the K-space helpers (kspace, drift's and oscillation's): each against a direct NumPy computation
on X, at rtol 1e-9 to 1e-10 (a few float64 products of well-conditioned 24 x 40 data)."""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.contract.model import Flag
from gradforensics.analysis.kinds.drift import stats as dst
from gradforensics.analysis.kinds.oscillation import stats as ost
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit.flagging import dedupe_heads, involved_heads, significance
from gradforensics.analysis.toolkit.units import SeriesPack, decode_names, encode_names, unit_series, units
from gradforensics.errors import SpecError
from gradforensics.store.names import layer_of
from gradforensics.testing import planted_directions as P


@pytest.fixture
def X() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal((24, 40)) + rng.standard_normal(40)


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def test_cosines_match_direct_on_one_k_and_on_a_stack(X: np.ndarray) -> None:
    K = X @ X.T
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((3, 24)), rng.standard_normal((2, 24))
    want = np.array([[_cos(a @ X, b @ X) for b in B] for a in A])
    np.testing.assert_allclose(dst.cosines(K, A, B), want, rtol=1e-10)
    Y = 2.0 * X[::-1]
    stack = dst.cosines(np.stack([K, Y @ Y.T]), A, B)
    np.testing.assert_allclose(stack[0], want, rtol=1e-10)
    np.testing.assert_allclose(stack[1], [[_cos(a @ Y, b @ Y) for b in B] for a in A], rtol=1e-10)


def test_record_and_consecutive_cosines(X: np.ndarray) -> None:
    K = X @ X.T
    a = dst.mean_coefficients(24, np.arange(5))
    m = X[:5].mean(axis=0)
    np.testing.assert_allclose(dst.record_cosines(K, a), [_cos(x, m) for x in X], rtol=1e-10)
    loo = [_cos(X[i], np.delete(X[:5], i, axis=0).mean(axis=0)) for i in range(5)]
    np.testing.assert_allclose(dst.opening_cosines(K, np.arange(5)), loo + [_cos(x, m) for x in X[5:]], rtol=1e-10)
    np.testing.assert_allclose(ost.consecutive_cosines(K), [_cos(X[i], X[i + 1]) for i in range(23)], rtol=1e-10)


def test_zero_vector_gives_nan_not_error() -> None:
    X = np.zeros((4, 3))
    X[1] = 1.0
    c = dst.cosines(X @ X.T, np.eye(4))
    assert np.isnan(c[0, 1]) and c[1, 1] == pytest.approx(1.0)


def test_window_coefficients_are_window_means(X: np.ndarray) -> None:
    W = dst.window_coefficients(24, 5)              # 5,5,5,5 and a 4-record tail kept (4 >= 2.5)
    assert W.shape == (5, 24)
    np.testing.assert_allclose(W @ X, [X[i:i + 5].mean(axis=0) for i in range(0, 24, 5)], rtol=1e-12)
    W2 = dst.window_coefficients(22, 5)             # tail of 2 < 2.5 merges into the last window
    assert W2.shape == (4, 22)
    np.testing.assert_allclose(W2[-1] @ X[:22], X[15:22].mean(axis=0), rtol=1e-12)
    assert ks.window_size(128) == 8 and ks.window_size(20) == 4 and ks.window_size(50, 7) == 7


def test_u_statistic_and_debiased_cosine() -> None:
    rng = np.random.default_rng(2)
    d, n = 2000, 200
    G = rng.standard_normal(d)
    H = rng.standard_normal(d)
    H -= (H @ G) / (G @ G) * G
    G2 = np.cos(1.0) * G + np.sin(1.0) * H * np.linalg.norm(G) / np.linalg.norm(H)
    X = np.r_[G + 8 * rng.standard_normal((n, d)), G2 + 8 * rng.standard_normal((n, d))]
    K = X @ X.T
    rows = np.arange(n)
    sub = X[rows]
    direct = (np.sum(sub.sum(axis=0) ** 2) - np.sum(sub**2)) / (n * (n - 1))
    assert dst.u_statistic_norms(K, rows) == pytest.approx(direct, rel=1e-10)
    # raw cosine of the sample means is attenuated by the noise; the debiased one finds cos(1 rad)
    raw = _cos(X[:n].mean(0), X[n:].mean(0))
    deb = dst.debiased_cosines(K, np.arange(n), np.arange(n, 2 * n))
    assert raw < np.cos(1.0) - 0.1
    assert deb == pytest.approx(np.cos(1.0), abs=0.05)


def test_least_squares_source_means_match_lstsq() -> None:
    p = P.planted_mixture(seed=3)
    X = p.unit_matrix(P.q_name(0), 1)
    A = p.mixture.astype(np.float64)
    K = X @ X.T
    fit = ks.fit_sources(A)
    M, *_ = np.linalg.lstsq(A, X, rcond=None)
    np.testing.assert_allclose(fit.C @ X, M, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(ks.source_gram(K, fit), M @ M.T, rtol=1e-8)
    E = X - A @ M
    np.testing.assert_allclose(ost.residual_gram(K, fit), E @ E.T, rtol=1e-8, atol=1e-8)
    h = np.diag(A @ np.linalg.pinv(A.T @ A) @ A.T)
    np.testing.assert_allclose(ks.noise_energy(K, fit), np.sum(E**2, axis=1) / (1 - h), rtol=1e-8)
    # the recovered means point where the planted ones do
    true = p.truth["means"][(P.q_name(0), 1)]
    assert min(_cos(m, t) for m, t in zip(M, true)) > 0.95


def test_debiased_source_gram_removes_noise_floor() -> None:
    p = P.planted_mixture(seed=0, snr=0.05, n=400)
    X = p.unit_matrix(P.mlp_name(0), None)
    K = X @ X.T
    fit = ks.fit_sources(p.mixture)
    true = p.truth["means"][(P.mlp_name(0), None)]
    want = true @ true.T
    raw, deb = ks.source_gram(K, fit), ks.source_gram(K, fit, debias=True)
    assert np.all(np.diag(raw) > 1.2 * np.diag(want))                  # noise inflates the raw norms
    assert np.abs(deb - want).mean() < 0.4 * np.abs(raw - want).mean()   # the debiased Gram removes most of it


def test_block_is_ix_on_one_k_and_on_a_stack(X: np.ndarray) -> None:
    Ks = np.stack([X @ X.T, X[::-1] @ X[::-1].T])
    for rows, cols in ((np.arange(24), None), (np.arange(2, 20, 3), np.arange(5)), (np.array([5, 1, 9]), np.arange(0, 24, 2))):
        c = rows if cols is None else cols
        np.testing.assert_array_equal(ks.block(Ks[0], rows, cols), Ks[0][np.ix_(rows, c)])
        np.testing.assert_array_equal(ks.block(Ks, rows, cols), Ks[:, rows][:, :, c])
        assert ks.block(Ks, rows, cols).flags.c_contiguous


def test_fit_sources_drops_absent_source() -> None:
    A = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 1, 0]], float)
    fit = ks.fit_sources(A)
    assert list(fit.index) == [0, 1] and fit.rank_ok
    np.testing.assert_allclose(fit.C, [[0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]])


def test_centred_pca_scores_match_svd(X: np.ndarray) -> None:
    K = X @ X.T
    Xc = X - X.mean(axis=0)
    np.testing.assert_allclose(ost.centred(K), Xc @ Xc.T, rtol=1e-9, atol=1e-9)
    lam, U = ost.top_components(ost.centred(K), 2)
    _, s, vt = np.linalg.svd(Xc, full_matrices=False)
    np.testing.assert_allclose(lam, s[:2] ** 2, rtol=1e-9)
    for k in range(2):
        scores = U[:, k] * np.sqrt(lam[k])
        direct = Xc @ vt[k]
        np.testing.assert_allclose(np.abs(scores @ direct), direct @ direct, rtol=1e-9)
        # the uncentred projection of each record on v_k, from K only
        v = Xc.T @ U[:, k] / np.sqrt(lam[k])
        np.testing.assert_allclose(K @ U[:, k] / np.sqrt(lam[k]), X @ v, rtol=1e-9, atol=1e-9)


def test_units_exclude_nonfinite_and_sum_heads() -> None:
    p = P.with_nonfinite(P.healthy_directions(seed=0, n=40, n_layers=1), P.q_name(0), [3, 7])
    ctx = p.context()
    del ctx.grams[(P.q_name(0), None)]                     # the whole-tensor K is rebuilt from the heads
    us = {(u.tensor, u.head): u for u in units(ctx)}
    whole = us[(P.q_name(0), None)]
    X = p.unit_matrix(P.q_name(0), None)
    keep = np.setdiff1d(np.arange(40), [3, 7])
    assert whole.n_heads == 4 and whole.n_excluded == 2 and list(whole.records) == list(keep)
    np.testing.assert_allclose(whole.gram, X[keep] @ X[keep].T, rtol=1e-6)
    # head 1's rows [8, 16) hold no NaN, but whole records are excluded everywhere the engine says so
    assert us[(P.q_name(0), 1)].n_excluded == 0
    assert us[(P.q_name(0), 0)].n_excluded == 2
    assert us[(P.mlp_name(0), None)].layer == 0


def test_units_follow_step_order() -> None:
    p = P.healthy_directions(seed=0, n=20, n_layers=1)
    p.step = np.r_[np.arange(10, 20), np.arange(10)]
    u = units(p.context())[0]
    assert list(u.records[:3]) == [10, 11, 12]


@pytest.mark.parametrize(("name", "layer"), [
    ("model.layers.5.self_attn.q_proj.weight", 5), ("transformer.h.11.attn.c_attn.weight", 11),
    ("encoder.layer.3.attention.self.query.weight", 3), ("blocks.0.mlp.fc1.weight", 0),
    ("lm_head.weight", None), ("model.embed_tokens.weight", None),
])
def test_layer_of(name: str, layer: int | None) -> None:
    assert layer_of(name) == layer


def test_significance_map() -> None:
    assert significance(1e-3, 1) == pytest.approx(0.5)
    assert significance(1e-4, 1) == pytest.approx(1.0)
    assert significance(1e-4, 10) == pytest.approx(0.5)     # Bonferroni over the store
    assert significance(0.01, 1) == 0.0
    assert significance(float("nan"), 1) == 0.0
    assert significance(0.0, 5) == 1.0


def _flag(head: int | None, src: tuple[str, ...] = ()) -> Flag:
    return Flag("conflict", "t", head, src, 0.9, (0, 1), {}, "s")


def test_dedupe_heads() -> None:
    some = dedupe_heads([_flag(None), _flag(1), _flag(2)], {"t": 4})
    assert sorted(f.head for f in some) == [1, 2]                     # localised: heads only
    assert "whole tensor: severity 0.90" in some[0].summary
    everyone = dedupe_heads([_flag(None), *[_flag(h) for h in range(4)]], {"t": 4})
    assert [f.head for f in everyone] == [None]                       # tensor-wide: the whole tensor
    # heads 0 and 3 show it only nominally (not flagged): still tensor-wide
    nominal = dedupe_heads([_flag(None), _flag(1), _flag(2)], {"t": 4}, {("t", ()): {0, 3}}, by_sources=False)
    assert [f.head for f in nominal] == [None]
    alone = dedupe_heads([_flag(None)], {"t": 4})
    assert [f.head for f in alone] == [None]
    heads_only = dedupe_heads([_flag(1)], {"t": 4})
    assert [f.head for f in heads_only] == [1] and "whole tensor" not in heads_only[0].summary
    pairs = dedupe_heads([_flag(None, ("a", "b")), _flag(1, ("a", "c"))], {"t": 4})
    assert len(pairs) == 2                                            # different pairs, different stories


def test_involved_heads_from_table() -> None:
    import pandas as pd

    t = pd.DataFrame({"tensor": ["t"] * 5, "head": pd.array([None, 0, 1, 2, 3], dtype="Int64"),
                      "source_a": ["a"] * 5, "source_b": ["b"] * 5})
    got = involved_heads(t, [True, True, False, True, False], by_sources=True)
    assert got == {("t", ("a", "b")): {0, 2}}
    assert involved_heads(t, [True] * 5) == {("t", ()): {0, 1, 2, 3}}


def test_names_roundtrip_and_options() -> None:
    raw = encode_names(["zh", "en", "代码"])
    assert raw.dtype == np.uint8 and decode_names(raw, 3) == ["zh", "en", "代码"]
    assert decode_names(None, 2) == ["0", "1"]
    from gradforensics.analysis.kinds.conflict.unit import ConflictOptions

    with pytest.raises(SpecError, match="unknown key"):
        ConflictOptions.parse({"perms": 5}, "conflict")
    with pytest.raises(SpecError, match="'permutations' option of conflict must be an int >= 19; got 5"):
        ConflictOptions.parse({"permutations": 5}, "conflict")


def test_series_pack_roundtrip_with_padding() -> None:
    pack = SeriesPack()
    pack.add("t", None, np.arange(3.0))
    pack.add("t", 2, np.arange(5.0))
    pack.add("u", None, np.ones((2, 2)))
    ser = pack.to_series("x")
    assert set(ser) == {"x", "x_units"} and ser["x"].shape == (3, 5, 2)
    np.testing.assert_array_equal(unit_series(ser, "x", "t", 2)[:, 0], np.arange(5.0))
    got = unit_series(ser, "x", "t", None)[:, 0]
    np.testing.assert_array_equal(got[:3], np.arange(3.0))
    assert np.isnan(got[3:]).all()
    assert unit_series(ser, "x", "t", 7) is None and unit_series(ser, "y", "t", 2) is None
    assert SeriesPack().to_series("x") == {}
