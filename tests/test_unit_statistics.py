"""The per-unit statistics of the direction analyses against their oracles, over stacks of units.

Oracles: NumPy on the raw gradients (cosines, principal directions, least squares), SciPy's public
functions (``spearmanr``, ``skew``/``kurtosis``), the direct products of the permutation null, and the
serial loop over units.  Tolerances: rtol 1e-9 for statistics a few float64 products away from the
oracle on well-conditioned data; p-values rtol 1e-9 (same formula, other summation order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from gradforensics.analysis.engine.bandstats import lag_design
from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.kinds import drift as dr
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.kinds.conflict import permtest as pt
from gradforensics.analysis.kinds.drift.stats import drift_slab, hinge_changepoints
from gradforensics.analysis.kinds.oscillation.stats import oscillation_slab, top_components
from gradforensics.analysis.toolkit.parallel import map_slabs, map_units, unit_threads
from gradforensics.analysis.toolkit.stacked import lstsq_each, pinv_stack
from gradforensics.analysis.toolkit.stats import average_ranks, bimodality_coefficients, rank_trends
from gradforensics.testing import planted_directions as P


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def _nan_close(got: float, want: float, rtol: float = 1e-9) -> bool:
    return (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=rtol, abs_tol=1e-300)


# ------------------------------------------------------------------ shared statistics
@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_rank_trends_are_spearmanr(alternative: str) -> None:
    """Many lengths in one call (ties, NaN gaps keeping their positions, constant and short series)."""
    rng = np.random.default_rng(11)
    ys = []
    for trial in range(300):
        y = rng.standard_normal(int(rng.integers(2, 120)))
        if trial % 3 == 1:
            y = np.round(y * 2)                               # ties: average ranks
        if trial % 3 == 2:
            y[rng.random(y.size) < 0.2] = np.nan
        ys.append(y)
    got = rank_trends(ys, alternative=alternative, skip_nonfinite=True)
    for y, (rho, p) in zip(ys, got, strict=True):
        x = np.flatnonzero(np.isfinite(y))
        if x.size < 3 or np.ptp(y[x]) == 0:
            assert math.isnan(rho) and math.isnan(p)
            continue
        want = stats.spearmanr(x, y[x], alternative=alternative)
        assert _nan_close(rho, float(want.statistic)) and _nan_close(p, float(want.pvalue)), (y, rho, p, want)
    assert rank_trends([np.array([1.0, np.nan, 3.0, 4.0])]) == [(math.nan, math.nan)]   # NaN kept: no test


def test_average_ranks_are_scipys_rankdata() -> None:
    """Exact: ranks and mean ranks of ties are integers and halves, no rounding (rows of many tie patterns)."""
    rng = np.random.default_rng(12)
    for n in (1, 2, 3, 7, 64, 129):
        Y = np.round(rng.standard_normal((40, n)) * rng.choice([0.5, 2.0, 100.0], size=(40, 1)))
        Y[0] = 3.0                                             # one tie group over the whole row
        np.testing.assert_array_equal(average_ranks(Y), stats.rankdata(Y, axis=1))


def test_bimodality_coefficients_are_scipys_moments() -> None:
    rng = np.random.default_rng(2)
    X = np.r_[rng.standard_normal((3, 40)), rng.exponential(size=(2, 40)), np.ones((1, 40))]
    X[-2] = np.r_[rng.normal(-3, 1, 20), rng.normal(3, 1, 20)]
    got = bimodality_coefficients(X)
    n = X.shape[1]
    for x, bc in zip(X[:-1], got[:-1], strict=True):
        g, k = stats.skew(x, bias=False), stats.kurtosis(x, bias=False)
        assert bc == pytest.approx((g * g + 1) / (k + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3))), rel=1e-10)
    assert math.isnan(got[-1]) and got[-2] > 5 / 9


def test_stacked_least_squares_are_lstsq() -> None:
    """Full-rank designs (rtol 1e-9) and a rank-deficient one (the minimum-norm solution, atol 1e-10)."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((4, 30, 3))
    B = rng.standard_normal((4, 30))
    want = [np.linalg.lstsq(a, b, rcond=None)[0] for a, b in zip(A, B, strict=True)]
    np.testing.assert_allclose(np.matmul(pinv_stack(A), B[:, :, None])[:, :, 0], want, rtol=1e-9)
    np.testing.assert_allclose(lstsq_each(A[0], B), [np.linalg.lstsq(A[0], b, rcond=None)[0] for b in B], rtol=1e-9)
    deficient = np.c_[A[0], A[0][:, :1] * 2.0]
    np.testing.assert_allclose(lstsq_each(deficient, B), [np.linalg.lstsq(deficient, b, rcond=None)[0] for b in B],
                               atol=1e-10)
    with pytest.raises(np.linalg.LinAlgError):
        pinv_stack(np.full((1, 4, 2), np.nan))


def test_lag_design_built_once_and_equal_to_its_pseudo_inverse() -> None:
    periods = np.arange(2, 17)
    H = lag_design(16, periods)
    assert lag_design(16, periods) is H and not H.flags.writeable
    lag = np.arange(1, 17, dtype=np.float64)
    for k, period in enumerate(periods):
        X = np.c_[np.ones(16), lag / 16, (lag / 16) ** 2, np.cos(2 * np.pi * lag / period)]
        np.testing.assert_allclose(H[k], np.linalg.pinv(X)[3], rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ conflict's null
@pytest.mark.parametrize("pure", [True, False])
def test_permuted_source_grams_are_the_direct_products(pure: bool) -> None:
    """``Q A_πᵀ K A_π Q`` per permutation, products written out (rtol 1e-9); pure batches (diagonal Q) too."""
    rng = np.random.default_rng(11 if pure else 12)
    for trial in range(12):
        n, S = int(rng.integers(6, 80)), int(rng.integers(2, 5))
        A = np.eye(S)[np.arange(n) % S][rng.permutation(n)] if pure else rng.dirichlet(np.ones(S), n)
        Q = np.linalg.pinv(A.T @ A)
        X = rng.standard_normal((n, 20))
        perms = pt.permutations(n, 40, (trial, 3), None if trial % 2 else 5)
        got = pt.permuted_source_grams(X @ X.T, A, Q, perms, chunk=(128, 7)[trial % 2])
        want = np.stack([Q @ A[p].T @ (X @ X.T) @ A[p] @ Q for p in perms])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
        # units sharing the permutations (a tensor's heads with streams="tensor"): each its own products
        Y = rng.standard_normal((n, 7))
        both = pt.permuted_source_grams([X @ X.T, Y @ Y.T], A, Q, perms, chunk=(128, 7)[trial % 2])
        np.testing.assert_array_equal(both[0], got)
        want_y = np.stack([Q @ A[p].T @ (Y @ Y.T) @ A[p] @ Q for p in perms])
        np.testing.assert_allclose(both[1], want_y, rtol=1e-9, atol=1e-9 * np.abs(want_y).max())


def test_permutations_are_seeded_and_stay_in_their_blocks() -> None:
    perms = pt.permutations(50, 30, (1, 2), 8)
    np.testing.assert_array_equal(perms, pt.permutations(50, 30, (1, 2), 8))
    assert not np.array_equal(perms, pt.permutations(50, 30, (1, 3), 8))
    assert (np.sort(perms, axis=1) == np.arange(50)).all()
    assert (perms // 8 == np.arange(50) // 8).all()                     # a record moves inside its block only


# ------------------------------------------------------------------ slabs of units
def _units(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Raw gradients of units of three record counts (two mixtures), one short, one rank one."""
    out = []
    for n in (64, 64, 96, 64, 10, 96):
        X = rng.standard_normal((n, 30)) + np.outer(np.linspace(0, 2, n), rng.standard_normal(30))
        X += np.outer(np.cos(np.pi * np.arange(n)), rng.standard_normal(30))
        out.append(X)
    out.append(np.outer(np.ones(64), rng.standard_normal(30)) * np.arange(1, 65)[:, None])
    return [(X, np.eye(3)[np.arange(X.shape[0]) % 3 if i % 2 else np.arange(X.shape[0]) * 3 // X.shape[0]])
            for i, X in enumerate(out)]


def test_drift_slab_gives_each_unit_its_numpy_oracle() -> None:
    rng = np.random.default_rng(3)
    units = _units(rng)
    got = drift_slab([(X @ X.T, A) for X, A in units], window=None)
    for (X, _), res in zip(units, got, strict=True):
        n = X.shape[0]
        w = max(4, math.ceil(n / 16))
        if n // w < 4:
            assert res.window_cos.size == 0 and np.isnan(res.record_cos).all()
            continue
        m0 = X[:w].mean(axis=0)
        rec = [_cos(X[i], np.delete(X[:w], i, axis=0).mean(axis=0)) for i in range(w)]
        rec += [_cos(x, m0) for x in X[w:]]
        np.testing.assert_allclose(res.record_cos, rec, rtol=1e-9)
        if np.ptp(rec[w:]) < 1e-9:          # the rank-one unit: every cosine 1 but for rounding, no ranks to test
            continue
        r = stats.spearmanr(np.arange(n - w), rec[w:], alternative="less")
        assert _nan_close(res.row["rho"], float(r.statistic)) and _nan_close(res.row["p_value"], float(r.pvalue))


def test_hinge_changepoints_are_brute_force_least_squares() -> None:
    """Series of several lengths and NaN patterns in one call, each against every hinge by np.linalg.lstsq."""
    rng = np.random.default_rng(8)
    ys = []
    for n, knee, hole in ((100, 50, 7), (100, 30, 7), (100, 60, 40), (60, 20, None)):
        y = np.r_[np.ones(knee), 1 - 0.03 * np.arange(n - knee)] + 0.1 * rng.standard_normal(n)
        if hole is not None:
            y[hole] = np.nan
        ys.append(y)
    ys.append(np.linspace(0, 1, 30))                                   # a rise: no fall to find
    for y, (k, slope) in zip(ys, hinge_changepoints(ys), strict=True):
        t = np.flatnonzero(np.isfinite(y)).astype(float)
        v = y[np.isfinite(y)]
        best = None
        for j in range(1, v.size - 1):
            Z = np.c_[np.ones_like(t), np.maximum(0, t - t[j])]
            c = np.linalg.lstsq(Z, v, rcond=None)[0]
            sse = float(np.sum((v - Z @ c) ** 2))
            if c[1] < 0 and (best is None or sse < best[0]):
                best = (sse, int(t[j]), float(c[1]))
        if best is None:
            assert k is None and math.isnan(slope)
        else:
            assert k == best[1] and slope == pytest.approx(best[2], rel=1e-9)


def test_oscillation_slab_gives_each_unit_its_numpy_oracle() -> None:
    """Consecutive cosines from the raw gradients; the top principal direction against np.linalg.svd of the
    centred records (scores and projections rtol 1e-7 up to sign); explained share and poles."""
    rng = np.random.default_rng(4)
    units = _units(rng)
    got = oscillation_slab([(X @ X.T, A, None) for X, A in units], False, osc.OscillationOptions(), ("a", "b", "c"))
    for (X, _), (row, comp) in zip(units, got, strict=True):
        if X.shape[0] < 8 or comp is None:
            assert X.shape[0] < 8 or np.linalg.matrix_rank(X - X.mean(axis=0)) == 0
            continue
        Xc = X - X.mean(axis=0)
        _, s, vt = np.linalg.svd(Xc, full_matrices=False)
        v = vt[comp.k] * np.sign(comp.proj @ (X @ vt[comp.k]))
        np.testing.assert_allclose(comp.scores, Xc @ v, rtol=1e-7, atol=1e-9 * s[0])
        np.testing.assert_allclose(comp.proj, X @ v, rtol=1e-7, atol=1e-9 * s[0])
        assert row["explained"] == pytest.approx(s[comp.k] ** 2 / np.sum(s**2), rel=1e-9)
        assert row["pole_pos"] >= row["pole_neg"]
    lam, U = top_components(units[0][0] @ units[0][0].T, 1)
    with pytest.raises(ValueError, match="non-finite"):
        top_components(np.full((9, 9), np.nan), 1)
    assert lam.shape == (1,) and U.shape == (64, 1)


def test_consecutive_cosines_of_the_table_are_numpys() -> None:
    p = P.planted_oscillation(seed=4, period=2, heads=(1,))
    res = osc.compute(p.context())
    row = res.table[(res.table.tensor == P.q_name(0)) & (res.table["head"] == 1)].iloc[0]
    X = p.unit_matrix(P.q_name(0), 1)
    assert row["consec_cos"] == pytest.approx(np.mean([_cos(X[i], X[i + 1]) for i in range(p.n - 1)]), rel=1e-9)


# ------------------------------------------------------------------ threads and slabs
def test_map_units_keeps_order_and_raises_the_error() -> None:
    with unit_threads(2) as n:
        assert n == 2
        assert map_units(lambda i: i * i, range(50)) == [i * i for i in range(50)]

        def bad(i: int) -> int:
            if i == 7:
                raise ValueError("unit 7")
            return i

        with pytest.raises(ValueError, match="unit 7"):
            map_units(bad, range(20))
    assert map_units(lambda i: -i, [1, 2]) == [-1, -2]          # outside: the serial loop


def test_map_slabs_is_the_loop_in_order() -> None:
    items = list(range(203))
    seen: list[int] = []

    def twice(slab: list[int]) -> list[int]:
        seen.append(len(slab))
        return [2 * x for x in slab]

    assert map_slabs(twice, items, size=64) == [2 * x for x in items]
    assert seen == [64, 64, 64, 11]
    with unit_threads(2):
        assert map_slabs(twice, items, size=10) == [2 * x for x in items]
    assert map_slabs(twice, [], size=8) == []
    with pytest.raises(RuntimeError, match="results for"):
        map_slabs(lambda s: s[:1], items, size=8)


@pytest.mark.parametrize(("make", "module"), [(P.planted_conflict, cf), (P.planted_drift, dr),
                                              (P.planted_oscillation, osc)])
def test_units_on_threads_give_the_serial_tables(make, module) -> None:
    ctx = make(seed=1, n=64).context()
    serial = module.compute(ctx)
    with unit_threads(2):
        threaded = module.compute(ctx)
    assert serial.table.equals(threaded.table)
    assert serial.series.keys() == threaded.series.keys()
    for k in serial.series:
        np.testing.assert_array_equal(serial.series[k], threaded.series[k])
