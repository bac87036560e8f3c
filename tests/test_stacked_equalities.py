"""Issue 28: the stacked small calls the per-unit statistics rely on give each item's single-call floats.

Oscillation's periodogram tests and drift's rank trends run over a slab of units at once
(``parallel.map_slabs``).  What that rests on is checked here with ``==`` (NaN equal to NaN),
never a tolerance: NumPy's stacked calls (:mod:`~gradforensics.analysis.toolkit.stacked`,
``np.fft.rfft`` along the last axis, ``np.matmul`` of ``A`` by ``Aᵀ`` per item) against the
single calls on random inputs of many sizes and scales, then the stacked tests against the
single-series code they replace (written out here as it was) and ``scipy.stats.spearmanr``,
on random series and on the planted stores' units.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import betaincc
from scipy.stats import rankdata, spearmanr

from gradforensics.analysis.kinds import drift as drift_mod
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import parallel as par
from gradforensics.analysis.toolkit import stacked as st
from gradforensics.analysis.toolkit import stats
from gradforensics.analysis.toolkit import units as un
from gradforensics.testing import planted_directions as P

SIZES = [8, 9, 16, 17, 31, 32, 33, 64, 96, 127, 128, 129, 200, 257, 600]


def _same(a: object, b: object) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def _stacks(seed: int, trials: int = 120):
    rng = np.random.default_rng(seed)
    for t in range(trials):
        n, m = SIZES[t % len(SIZES)], int(rng.integers(1, 9))
        yield rng, n, rng.standard_normal((m, n)) * 10.0 ** rng.integers(-6, 7)


def test_numpy_stacked_calls_are_the_single_calls() -> None:
    """Row means and sums (pairwise along the contiguous axis), row dots, ``rfft`` rows, ``lstsq`` per item
    and ``A @ c`` per item: each row's floats those of the 1-d call."""
    for _, n, X in _stacks(1):
        t = np.linspace(-1.0, 1.0, n)
        T = np.c_[t, t * t - (t * t).mean()]
        coef = st.lstsq_each(T, X)
        F = np.fft.rfft(X, axis=-1)
        for i, x in enumerate(X):
            assert st.row_means(X)[i] == x.mean() and np.add.reduce(X, axis=-1)[i] == x.sum()
            assert st.row_dots(X)[i] == x @ x
            assert _same(F[i], np.fft.rfft(x))
            assert _same(coef[i], np.linalg.lstsq(T, x, rcond=None)[0])
            assert _same(st.matvec_each(T, coef)[i], T @ coef[i])


def test_a_matrix_right_hand_side_is_not_the_single_calls() -> None:
    """Why :func:`stacked.lstsq_each` stacks the items: one ``lstsq`` with several columns gives other floats
    (so a check that cannot tell them apart would not be one)."""
    differ = 0
    for _, n, X in _stacks(2, 60):
        t = np.linspace(-1.0, 1.0, n)
        T = np.c_[t, t * t - (t * t).mean()]
        multi = np.linalg.lstsq(T, X.T, rcond=None)[0].T
        differ += int(not _same(multi, st.lstsq_each(T, X)))
    assert differ > 0


def test_the_stacked_covariance_is_corrcoefs_dot() -> None:
    """``np.matmul(X, Xᵀ)`` per item of a stack of ``(2, n)`` views is the ``dot`` ``np.cov`` takes of each."""
    rng = np.random.default_rng(3)
    for trial in range(150):
        n, U = SIZES[trial % len(SIZES)], int(rng.integers(1, 12))
        R = np.empty((U, n, 2))
        R[:, :, 0] = np.arange(1, n + 1)
        for u in range(U):
            R[u, :, 1] = rankdata(np.round(rng.standard_normal(n), 1 if trial % 3 == 0 else 12))
        X = R.transpose(0, 2, 1)
        X = X - X.mean(axis=2)[:, :, None]
        c = np.matmul(X, X.transpose(0, 2, 1))
        for u in range(U):
            Xi = np.array(R[u], ndmin=2).T
            Xi -= np.average(Xi, axis=1)[:, None]
            assert _same(c[u], np.dot(Xi, Xi.T.conj()))


def periodogram_reference(x: np.ndarray, min_cycles: int = 3, dof_total: int | None = None) -> tuple[float, float]:
    """The single-series periodogram test as it was before the stack (one ``lstsq``, one FFT a series)."""
    n = x.size
    nu = (n - 1 if dof_total is None else int(dof_total)) - 2
    t = np.linspace(-1.0, 1.0, n)
    T = np.c_[t, t * t - (t * t).mean()]
    j = np.arange(min_cycles, n // 2 + 1)
    dof = np.where(2 * j == n, 1.0, 2.0)
    xc = x - x.mean()
    if n >= 8:
        xc = xc - T @ np.linalg.lstsq(T, xc, rcond=None)[0]
    ss = float(xc @ xc)
    if n < 8 or j.size == 0 or ss <= 0:
        return math.nan, math.nan
    F = np.fft.rfft(xc)
    power = np.abs(F[j]) ** 2
    power = np.where(dof == 1.0, power, 2.0 * power) / n
    share = np.clip(power / ss, 0.0, 1.0)
    tail = betaincc(dof / 2.0, np.maximum(nu - dof, 1.0) / 2.0, share)
    best = int(np.argmin(tail))
    return n / float(j[best]), float(min(1.0, tail[best] * j.size))


def test_periodogram_tests_are_the_single_series_test() -> None:
    rng = np.random.default_rng(4)
    for trial, (_, n, X) in enumerate(_stacks(5, 90)):
        if trial % 5 == 0:
            X[0] = 0.0                                              # no variance: NaN
        if trial % 7 == 0:
            X[-1] = np.sin(np.pi * np.arange(n) * 2 / 3) * 5 + rng.standard_normal(n)   # a period
        dof = None if trial % 2 else n - int(rng.integers(1, 4))
        period, p = osc.periodogram_tests(X, 3, dof)
        for i, x in enumerate(X):
            assert _same((period[i], p[i]), periodogram_reference(x, 3, dof)), (trial, i)
            assert _same(osc.periodogram_test(x, 3, dof), periodogram_reference(x, 3, dof))
    for n in (2, 5, 7):                                               # too short: NaN, as before
        assert _same(osc.periodogram_tests(np.ones((2, n)) + np.arange(n))[1], [math.nan] * 2)


def _planted_contexts():
    yield P.planted_oscillation(seed=1, n=96, period=2).context()
    yield P.planted_drift(seed=2, n=96).context()
    p = P.planted_conflict(seed=3, n=64, n_layers=2, where={P.q_name(1): (1, 2)}, mode="replay")
    yield P.with_nonfinite(p, P.q_name(0), [3, 17]).context()


@pytest.mark.parametrize("case", [0, 1, 2])
def test_planted_units_scores_and_trends_are_the_single_calls(case: int) -> None:
    """Each planted unit's principal scores through the stacked test, and its drift series through the stacked
    rank trend, give the single-series numbers (``scipy.stats.spearmanr`` for the trend)."""
    ctx = list(_planted_contexts())[case]
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    rows, series = [], []
    for u in un.units(ctx):
        fit = ks.shared_fit(mix[u.records])
        Kp = ks.residual_gram(u.gram, fit) if ctx.meta.mode == "replay" else ks.centred(u.gram)
        lam, U = ks.top_components(Kp, 3)
        scores = np.stack([U[:, k] * math.sqrt(lam[k]) for k in range(lam.size)])
        rows.append(scores)
        got = osc.periodogram_tests(scores, 3, u.n - 2)
        for i, x in enumerate(scores):
            assert _same((got[0][i], got[1][i]), periodogram_reference(x, 3, u.n - 2)), (u.where(), i)
        series.append(ks.consecutive_cosines(u.gram))
        series.append(np.diag(u.gram)[::-1].copy())
    trends = stats.rank_trends(series, min_n=4, alternative="less", skip_nonfinite=True)
    for y, (rho, p) in zip(series, trends, strict=True):
        y = y[np.isfinite(y)]
        ref = spearmanr(np.arange(y.size), y, alternative="less")
        assert _same((rho, p), (ref.statistic, ref.pvalue))


def test_rank_trends_are_rank_trend() -> None:
    """Ties, NaN, constant and short series, every alternative, with and without skipping non-finite values."""
    rng = np.random.default_rng(6)
    for trial in range(60):
        ys = []
        for u in range(int(rng.integers(1, 30))):
            n = int(rng.choice([2, 3, 4, 5, 8, 16, 28, 31, 60, 127, 300]))
            y = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8)
            if u % 4 == 0:
                y = np.round(y, 0)
            if u % 7 == 0:
                y[rng.integers(0, n)] = np.nan
            if u % 11 == 0:
                y[:] = 1.0
            ys.append(y)
        for alt in ("less", "greater", "two-sided"):
            for skip in (True, False):
                got = stats.rank_trends(ys, min_n=4, alternative=alt, skip_nonfinite=skip)
                want = [stats.rank_trend(y, min_n=4, alternative=alt, skip_nonfinite=skip) for y in ys]
                assert all(_same(g, w) for g, w in zip(got, want, strict=True)), (trial, alt, skip)
        y = ys[0][np.isfinite(ys[0])]
        if y.size >= 4 and np.ptp(y) > 0:
            ref = spearmanr(np.arange(y.size), y)
            assert _same(stats.rank_trends([y])[0], (ref.statistic, ref.pvalue))


def test_map_slabs_is_the_loop_in_order() -> None:
    items = list(range(203))
    seen: list[int] = []

    def twice(slab: list[int]) -> list[int]:
        seen.append(len(slab))
        return [2 * x for x in slab]

    assert par.map_slabs(twice, items, size=64) == [2 * x for x in items]
    assert seen == [64, 64, 64, 11]
    with par.unit_threads(2):
        assert par.map_slabs(twice, items, size=10) == [2 * x for x in items]
    assert par.map_slabs(twice, [], size=8) == []
    with pytest.raises(RuntimeError, match="results for"):
        par.map_slabs(lambda s: s[:1], items, size=8)


def _safe_div_reference(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``kspace.safe_div`` as it was: the selected entries divided through boolean indexing."""
    num = np.asarray(num, dtype=np.float64)
    den = np.broadcast_to(np.asarray(den, dtype=np.float64), num.shape)
    out = np.full(num.shape, np.nan)
    ok = den > 1e-300
    out[ok] = num[ok] / den[ok]
    return np.clip(out, -1.0, 1.0)


def test_safe_div_is_the_indexed_division() -> None:
    rng = np.random.default_rng(8)
    for trial in range(200):
        shape = [(), (7,), (5, 3), (1, 4)][trial % 4]
        num = rng.standard_normal(shape) * 10.0 ** rng.integers(-300, 300)
        den = np.abs(rng.standard_normal(shape)) * 10.0 ** rng.integers(-310, 300)
        if trial % 3 == 0 and np.ndim(den):
            den.flat[0], num.flat[-1] = 0.0, np.nan
        with np.errstate(over="ignore"):           # both overflow alike where the quotient does
            assert _same(ks.safe_div(num, den), _safe_div_reference(num, den)), trial
            if np.ndim(num) == 2:
                assert _same(ks.safe_div(num, den[:1]), _safe_div_reference(num, den[:1]))


def _hinge_reference(y: np.ndarray) -> tuple[int | None, float]:
    """``drift.hinge_changepoint`` as it was: one series, its suffix sums by 1-d ``cumsum``."""
    t = np.flatnonzero(np.isfinite(y)).astype(np.float64)
    v = y[np.isfinite(y)].astype(np.float64)
    n = v.size
    if n < 4:
        return None, math.nan

    def suffix(a: np.ndarray) -> np.ndarray:
        return np.concatenate((np.cumsum(a[::-1])[::-1][1:], np.zeros(1)))

    m, st_, stt, sy, sty = suffix(np.ones(n)), suffix(t), suffix(t * t), suffix(v), suffix(t * v)
    sz = st_ - m * t
    szz = stt - 2 * t * st_ + m * t * t
    szy = sty - t * sy
    vc = v - v.mean()
    var_z = szz - sz**2 / n
    cov_zy = szy - sz * v.sum() / n
    ok = np.zeros(n, bool)
    ok[1:n - 1] = var_z[1:n - 1] > 1e-12
    slope = np.where(ok, cov_zy / np.where(ok, var_z, 1.0), 0.0)
    sse = np.where(ok & (slope < 0), vc @ vc - cov_zy**2 / np.where(ok, var_z, 1.0), np.inf)
    if not np.isfinite(sse).any():
        return None, math.nan
    j = int(np.argmin(sse))
    return int(t[j]), float(slope[j])


def test_hinge_changepoints_are_the_single_series_fit() -> None:
    """Stacked by finite positions (NaN holes, short and rising series among them), each fit the 1-d one's;
    ``cumsum`` along the rows of a stack is the 1-d ``cumsum`` of each."""
    rng = np.random.default_rng(9)
    for trial in range(80):
        n = SIZES[trial % len(SIZES)]
        X = rng.standard_normal((5, n)) * 10.0 ** rng.integers(-6, 7)
        assert all(_same(np.cumsum(X[:, ::-1], axis=-1)[i], np.cumsum(x[::-1])) for i, x in enumerate(X))
        ys = [x for x in X]
        knee = np.r_[np.zeros(n // 2), -np.arange(n - n // 2) / n] + 0.05 * rng.standard_normal(n)
        ys += [knee, np.linspace(0.0, 1.0, n), knee.copy(), np.full(3, 1.0)]
        ys[-2][[1, n // 3]] = np.nan
        ys[0][2] = np.nan
        got = drift_mod.hinge_changepoints(ys)
        for y, g in zip(ys, got, strict=True):
            assert _same(g[1], _hinge_reference(y)[1]) and g[0] == _hinge_reference(y)[0], trial
    for u in un.units(P.planted_drift(seed=2, n=96).context()):
        y = drift_mod.opening_cosines(u.gram, np.arange(6))
        assert drift_mod.hinge_changepoint(y) == _hinge_reference(y)


def test_bimodality_coefficients_are_the_single_call() -> None:
    """Moments over the stack, the last operations on each row's scalars: each row's coefficient the 1-d one's
    (constant rows and rows shorter than 4 NaN); a scalar power is not an array's, so the check can fail."""
    rng = np.random.default_rng(10)
    for trial in range(150):
        n, m = SIZES[trial % len(SIZES)] if trial % 9 else 3, int(rng.integers(1, 40))
        X = rng.standard_normal((m, n)) * 10.0 ** rng.integers(-8, 8)
        if trial % 5 == 0:
            X[0] = 1.0
        if trial % 7 == 0:
            X = np.where(X > 0, 1.0, -1.0) + 1e-3 * X             # two modes
        got = stats.bimodality_coefficients(X)
        assert all(_same(g, stats.bimodality_coefficient(x)) for g, x in zip(got, X, strict=True)), trial
    x = np.abs(rng.standard_normal(20000)) * 10.0 ** rng.integers(-100, 100, 20000)
    assert np.count_nonzero(x**1.5 != np.array([v**1.5 for v in x])) > 0


def test_stacked_cosines_are_kspace_cosines() -> None:
    """``cosines_each`` and ``record_cosines_each`` against ``kspace.cosines`` / ``record_cosines`` per item: drift's
    window means, a source fit's rows against one direction, the opening mean; sizes 4-600, scales 1e-6 to
    1e6, rank-deficient and non-finite K."""
    rng = np.random.default_rng(31)
    checked = 0
    for t in range(150):
        n, m = SIZES[t % len(SIZES)] if t % 5 else int(rng.integers(4, 8)), int(rng.integers(1, 9))
        X = rng.standard_normal((m, n, int(rng.integers(1, 60)))) * 10.0 ** rng.uniform(-6, 6)
        Ks = np.matmul(X, np.swapaxes(X, 1, 2))
        if t % 7 == 0:
            Ks[0, rng.integers(0, n), rng.integers(0, n)] = rng.choice([np.nan, np.inf])
        if t % 11 == 0:
            Ks[-1] = 0.0
        W, rows = drift_mod._windows(n, ks.window_size(n))
        C = rng.standard_normal((int(rng.integers(2, 5)), n))
        d = ks.mean_coefficients(n, rows[-1]) - ks.mean_coefficients(n, rows[0])
        a = ks.mean_coefficients(n, rows[0])
        cases = [(st.cosines_each(Ks, W, W[:1]), (W, W[:1])), (st.cosines_each(Ks, C, d[None, :]), (C, d[None, :])),
                 (st.cosines_each(Ks, W), (W,)), (st.record_cosines_each(Ks, a), a)]
        for got, args in cases:
            for i in range(m):
                K = np.ascontiguousarray(Ks[i])
                want = ks.record_cosines(K, args) if isinstance(args, np.ndarray) else ks.cosines(K, *args)
                assert got[i].shape == want.shape and _same(got[i], want), (t, n, i)
                checked += 1
    assert checked > 2000


@pytest.mark.parametrize("case", [0, 1, 2])
def test_drift_slab_cosines_are_each_units_own(case: int) -> None:
    """The planted stores' units through drift's stacked slab cosines against each unit's own calls (the
    per-unit path, ``pre=None``): every row value and series, ``==``."""
    ctx = list(_planted_contexts())[case]
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    slab = [(u.gram, mix[u.records]) for u in un.units(ctx)]
    pre = drift_mod._slab_cosines(slab, None)
    assert len(pre) == len(slab)
    for i, (K, m) in enumerate(slab):
        (got, gs), (want, ws) = drift_mod._drift_start(K, m, None, pre[i]), drift_mod._drift_start(K, m, None)
        assert got.row.keys() == want.row.keys()
        assert all(_same(got.row[k], want.row[k]) if isinstance(want.row[k], float) else got.row[k] == want.row[k]
                   for k in want.row)
        assert _same(got.record_cos, want.record_cos) and _same(got.window_cos, want.window_cos)
        assert gs is not None and ws is not None and _same(gs[0], ws[0]) and _same(gs[1], ws[1])
