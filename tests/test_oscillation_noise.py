"""Oscillation's test against healthy training noise (training stores): calibration and power.

The null family is what SGD, momentum and Adam produce along a direction of the records without any
oscillation: white noise, the differenced batch noise ``ξ_{t+1} - ξ_t`` (lag-1 autocorrelation -1/2),
SGD's ARMA(1,1) ``g_{t+1} = φ g_t + ξ_{t+1} - ξ_t`` and red AR(1) noise up to a random walk.  The
test must hold its level on all of them and still find a flip beyond -1/2 and a line on red noise.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import lfilter

from gradforensics.analysis.kinds.oscillation import stats as ost
from gradforensics.testing import planted_directions as P

NULLS = {"white": (0.0, 0.0), "differenced": (0.0, -1.0), "sgd-0.5": (0.5, -1.0), "sgd-0.9": (0.9, -1.0),
         "ar-0.5": (0.5, 0.0), "ar-0.9": (0.9, 0.0), "random-walk": (1.0, 0.0)}


def _arma(rng: np.random.Generator, phi: float, theta: float, n: int, m: int) -> np.ndarray:
    e = rng.standard_normal((m, n + 200))
    return lfilter([1.0, theta], [1.0, -phi], e, axis=1)[:, 200:]


@pytest.mark.parametrize("name", list(NULLS))
def test_the_noise_test_holds_its_level_on_healthy_training_noise(name: str) -> None:
    """P(p < a) <= a up to 4 Monte-Carlo standard errors plus 50 % (the continuum fit and Bartlett's variance are
    approximations; measured at most 1.4 a at 0.01 and 4 a at 0.001, 6 of 1500), at a = 0.01 and 0.001, on 1500
    series of 96 records."""
    rng = np.random.default_rng([7, len(name)])
    ps = ost.periodogram_tests(_arma(rng, *NULLS[name], 96, 1500), 3, noise=True)[1]
    for a in (0.01, 0.001):
        assert np.mean(ps < a) <= 1.5 * a + 4 * np.sqrt(a * (1 - a) / ps.size), (name, a)


def test_white_test_is_fooled_by_red_and_blue_noise_the_noise_test_is_not() -> None:
    """The reason for the noise test: white noise's test rejects red (Adam, momentum) and differenced (SGD) noise."""
    rng = np.random.default_rng(3)
    for phi, theta in ((0.9, 0.0), (0.0, -1.0)):
        X = _arma(rng, phi, theta, 120, 400)
        white = ost.periodogram_tests(X, 3)[1]
        noise = ost.periodogram_tests(X, 3, noise=True)[1]
        assert np.mean(white < 0.01) > 0.1 and np.mean(noise < 0.01) < 0.03, (phi, theta)


def test_flips_beyond_the_batch_noise_baseline_and_lines_on_red_noise_are_found() -> None:
    rng = np.random.default_rng(5)
    n = 120
    for strength in (2.0, 3.0):             # a period-2 flip above differenced batch noise (variance 2)
        x = strength * P.square_wave(n, 2) + _arma(rng, 0.0, -1.0, n, 1)[0]
        period, p = ost.periodogram_tests(x[None, :], 3, noise=True)
        assert period[0] == pytest.approx(2.0, rel=0.05) and p[0] < 1e-4, strength
    red = _arma(rng, 0.9, 0.0, n, 1)[0]
    x = red + 2.0 * np.std(red) * np.sin(2 * np.pi * np.arange(n) / 12.0)      # a line at 12 records
    period, p = ost.periodogram_tests(x[None, :], 3, noise=True)
    assert period[0] == pytest.approx(12.0, rel=0.05) and p[0] < 1e-4


def test_the_flip_p_is_bartletts_normal_tail_of_the_lag_one_autocorrelation() -> None:
    """A pure flip-band series: p = 2 Φ((r1 + 1/2) / sqrt(1/(2n))) (scipy.stats.norm), rtol 1e-9."""
    from scipy import stats

    rng = np.random.default_rng(11)
    n = 64
    x = P.square_wave(n, 2) * 1.5 + rng.standard_normal(n)
    t = np.linspace(-1.0, 1.0, n)
    T = np.c_[np.ones(n), t, t * t]
    xc = x - T @ np.linalg.lstsq(T, x, rcond=None)[0]
    r1 = float(xc[1:] @ xc[:-1] / (xc @ xc))
    period, p = ost.periodogram_tests(x[None, :], 3, noise=True)
    want = 2 * stats.norm.cdf((r1 + 0.5) / np.sqrt(0.5 / n))
    assert r1 < -0.5 and period[0] == pytest.approx(2.0, rel=0.05)
    np.testing.assert_allclose(p[0], want, rtol=1e-9)


def test_the_continuum_neighbourhood_is_the_rule_found_once_per_frequency() -> None:
    """The :data:`CONTINUUM` nearest ordinates outside a frequency's leak guard (nearest first, the lower on a
    tie) are found once per ``(k, lo, n2)`` and handed read-only to every slab: the rule, recomputed here."""
    st = ost
    for n2 in (5, 16, 17, 64, 129):
        for lo in (3, 4, 7):
            for k in range(1, n2 + 1):
                guard = max(1, k // st.LINE_CYCLES)
                cand = [q for q in range(lo, n2) if abs(q - k) > guard]
                want = sorted(cand, key=lambda q: (abs(q - k), q))[:st.CONTINUUM]
                cols, logs = st._continuum_bins(k, lo, n2)
                assert cols.tolist() == [q - 1 for q in want]
                np.testing.assert_array_equal(logs, np.log(np.asarray(want, dtype=np.float64)))
                assert not cols.flags.writeable and not logs.flags.writeable
                assert st._continuum_bins(k, lo, n2)[0] is cols           # cached, not recomputed
