"""Issue 28: the per-unit statistics made cheaper are the same numbers, bit for bit.

Oracles: scipy's own functions (``spearmanr``, ``beta.sf``, ``t.sf``), the direct
pseudo-inverse of the lag design, and the serial loop over units.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.kinds import drift as dr
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit.parallel import map_units, unit_threads
from gradforensics.analysis.toolkit.stats import rank_trend
from gradforensics.testing import planted_directions as P


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_rank_trend_is_spearmanr_bit_for_bit(alternative) -> None:
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(3, 200))
        y = rng.standard_normal(n)
        if trial % 3 == 1:
            y = np.round(y * 2)                               # ties: average ranks
        if trial % 3 == 2:
            y[rng.random(n) < 0.2] = np.nan                   # gaps keep their positions
        x = np.flatnonzero(np.isfinite(y))
        got = rank_trend(y, alternative=alternative, skip_nonfinite=True)
        yy = y[x]
        if yy.size < 3 or np.ptp(yy) == 0:
            assert all(map(math.isnan, got))
            continue
        want = stats.spearmanr(x, yy, alternative=alternative)
        assert _same(got[0], float(want.statistic)) and _same(got[1], float(want.pvalue)), (trial, got, want)


def test_periodogram_tail_is_scipy_beta_sf() -> None:
    """The test's p from its definition, with scipy.stats.beta.sf as the tail."""
    rng = np.random.default_rng(2)
    for n in (8, 9, 31, 64, 129):
        x = rng.standard_normal(n) + np.cos(np.pi * np.arange(n)) * 0.5
        period, p = osc.periodogram_test(x, 3, n - 1)
        t = np.linspace(-1.0, 1.0, n)
        T = np.c_[t, t * t - (t * t).mean()]
        xc = x - x.mean()
        xc = xc - T @ np.linalg.lstsq(T, xc, rcond=None)[0]
        j = np.arange(3, n // 2 + 1)
        F = np.abs(np.fft.rfft(xc)[j]) ** 2
        dof = np.where(2 * j == n, 1.0, 2.0)
        share = np.clip(np.where(dof == 1.0, F, 2.0 * F) / n / float(xc @ xc), 0.0, 1.0)
        tail = stats.beta.sf(share, dof / 2.0, np.maximum(n - 3 - dof, 1.0) / 2.0)
        best = int(np.argmin(tail))
        assert (period, p) == (n / float(j[best]), float(min(1.0, tail[best] * j.size)))


def test_lag_design_built_once_and_equal_to_its_pseudo_inverse() -> None:
    periods = np.arange(2, 17)
    H = osc.lag_design(16, periods)
    assert osc.lag_design(16, periods) is H and not H.flags.writeable
    lag = np.arange(1, 17, dtype=np.float64)
    for k, P_ in enumerate(periods):
        X = np.c_[np.ones(16), lag / 16, (lag / 16) ** 2, np.cos(2 * np.pi * lag / P_)]
        np.testing.assert_array_equal(H[k], np.linalg.pinv(X)[3])


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
