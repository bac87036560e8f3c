"""Issue 28, the series analyses on many small tensors: each shortcut against the code it replaces.

* ``loss_spectrum`` and ``fractal`` share each series' detrended and winsorised residual
  (:class:`DetrendCache`): what it hands out is what ``detrend`` + ``winsorize`` return, bit for
  bit, read-only, only for read-only series, within its byte budget; both analyses' tables and
  series are the same with and without it, and through the engine's context one cache serves both;
* the medians by one partition are ``np.median``'s (signed zeros and NaN too);
* the log-time fit's five solves in one gufunc call are ``np.linalg.lstsq``'s, one by one;
* Higuchi's curve lengths from one difference array per scale are the definition's loop;
* the AR(1) autocovariance built in one buffer is :func:`filtered_ar1_acov`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.contract.series import Series, SeriesGroup
from gradforensics.analysis.kinds import fractal, loss_spectrum
from gradforensics.analysis.toolkit.signal import DetrendCache, SpectrumOptions, detrend, winsorize
from gradforensics.analysis.toolkit.signal import detrending as dt
from gradforensics.analysis.toolkit.signal.background import GainGrid, filtered_ar1_acov


def _curve(n: int, rng: np.random.Generator, kind: int) -> np.ndarray:
    """A loss-like curve: a decay, AR(1)-ish noise, and by *kind* a spike, a level shift or a line."""
    t = np.arange(n, dtype=float)
    y = 2.0 * np.exp(-t / (n / 4)) + 0.05 * rng.standard_normal(n).cumsum() / np.sqrt(n) + 0.05 * rng.standard_normal(n)
    if kind % 4 == 1:
        y[n // 3] += 3.0                                        # a spike: winsorised
    elif kind % 4 == 2:
        y[n // 2:] -= 0.8                                       # a level shift
    elif kind % 4 == 3:
        y += 0.2 * np.sin(2 * np.pi * t / 7.0)                  # a line
    return y


def _frozen(y: np.ndarray) -> np.ndarray:
    y = np.array(y, dtype=float)
    y.setflags(write=False)
    return y


def _same_det(a: dt.Detrended, b: dt.Detrended) -> None:
    for f in ("residual", "trend", "coeffs"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert (a.method, a.window, a.offset, a.shifts) == (b.method, b.window, b.offset, b.shifts)


# ------------------------------------------------------------------ the cache against the direct calls
@pytest.mark.parametrize("method", ["savgol", "diff"])
def test_cache_hands_out_what_detrend_and_winsorize_return_read_only(method) -> None:
    rng = np.random.default_rng(0)
    cache = DetrendCache()
    for i, n in enumerate((32, 33, 40, 64, 100, 257)):
        y = _frozen(_curve(n, rng, i))
        window = None if method == "diff" else 2 * min(16, n) + 1
        det, r, k = cache.get(y, method, window, 6.0)
        ref = detrend(y, method, window)
        ref_r, ref_k = winsorize(ref.residual, 6.0)
        _same_det(det, ref)
        np.testing.assert_array_equal(r, ref_r)
        assert k == ref_k
        again = cache.get(y, method, window, 6.0)                         # the second analysis: the same objects
        assert again[0] is det and again[1] is r and cache.hits == i + 1
        for a in (det.residual, det.trend, r):
            assert not a.flags.writeable
            with pytest.raises(ValueError):
                a[0] = 1.0                                                # no analysis can change what the next reads


def test_windows_that_cap_alike_share_and_other_parameters_do_not() -> None:
    y = _frozen(_curve(32, np.random.default_rng(1), 1))
    cache = DetrendCache()
    det = cache.get(y, "savgol", 33, 6.0)[0]                 # loss_spectrum's 2·16 + 1 ...
    assert cache.get(y, "savgol", 31, 6.0)[0] is det         # ... and fractal's, both capped at 31 points
    assert cache.hits == 1
    for other in (("savgol", 21, 6.0), ("savgol", 33, 3.0), ("diff", None, 6.0)):
        got = cache.get(y, *other)
        ref = detrend(y, other[0], other[1])
        _same_det(got[0], ref)
        np.testing.assert_array_equal(got[1], winsorize(ref.residual, other[2])[0])
    assert cache.hits == 1


def test_writable_series_are_not_remembered_and_the_budget_holds() -> None:
    rng = np.random.default_rng(2)
    y = _curve(40, rng, 1)                                   # writable: it could change between two calls
    cache = DetrendCache()
    first = cache.get(y, "savgol", None, 6.0)
    y[5] += 1.0
    second = cache.get(y, "savgol", None, 6.0)
    _same_det(second[0], detrend(y, "savgol", None))
    assert cache.hits == 0 and cache.nbytes == 0 and not np.array_equal(first[0].residual, second[0].residual)
    view = _curve(40, rng, 0)[::1]                           # a read-only view of a writable array: not either
    view.setflags(write=False)
    cache.get(view, "savgol", None, 6.0)
    assert cache.nbytes == 0

    ys = [_frozen(_curve(64, rng, i)) for i in range(10)]
    one = sum(a.nbytes for a in {id(a): a for a in (*(lambda d: (d.residual, d.trend, d.coeffs))(
        detrend(ys[0], "savgol", None)), winsorize(detrend(ys[0], "savgol", None).residual, 6.0)[0])}.values())
    small = DetrendCache(max_bytes=3 * one)
    for y in ys:
        small.get(y, "savgol", None, 6.0)
    assert small.nbytes <= 3 * one and len(small._entries) == 3
    for y in ys:                                             # past the budget: computed again, the same values
        det, _r, _ = small.get(y, "savgol", None, 6.0)
        _same_det(det, detrend(y, "savgol", None))
    assert small.hits == 3


# ------------------------------------------------------------------ both analyses, with and without the cache
def _groups(n_series: int, n: int) -> list[SeriesGroup]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(n_series):
        y = _frozen(_curve(n, rng, i))
        x = _frozen(np.arange(n, dtype=float))
        name = "batches/loss" if i == 0 else f"grad_norm/t{i}"
        out.append(SeriesGroup(Series(name, name.split("/")[-1], x, y, records=(0, n - 1))))
    return out


def _same_result(a, b) -> None:
    pd.testing.assert_frame_equal(a.table, b.table, check_exact=True)
    assert sorted(a.series) == sorted(b.series)
    for k in a.series:
        np.testing.assert_array_equal(np.asarray(a.series[k]), np.asarray(b.series[k]), err_msg=k)


@pytest.mark.parametrize("n", [32, 48, 200])
def test_loss_spectrum_and_fractal_with_the_cache_equal_their_direct_computation(n) -> None:
    groups, opt = _groups(12, n), SpectrumOptions()
    cache = DetrendCache()
    ls = loss_spectrum.analyze_series(groups, opt, cache)
    hits = cache.hits
    fr = fractal.analyze_series(groups, opt, cache)
    _same_result(ls, loss_spectrum.analyze_series(groups, opt))
    _same_result(fr, fractal.analyze_series(groups, opt))
    assert hits == 0
    # fractal's window is max(2·nperseg + 1, N/2): the spectrum's 33 up to N = 67 (capped at N), wider above
    assert cache.hits - hits == (len(groups) if n <= 67 else 0)
    residual = ls.series["batches/loss/residual"]
    with pytest.raises(ValueError):
        residual[0] = 0.0


def test_engine_context_gives_both_analyses_one_cache(tmp_path) -> None:
    from gradforensics.analysis.contract.model import Context
    from gradforensics.analysis.toolkit.series import from_context, shared_detrending
    from gradforensics.store.reader import Store
    from gradforensics.testing.planted import write_store

    def grads(i, src, rng):
        return {"w": rng.standard_normal((4, 3)).astype(np.float32)}

    p = tmp_path / "s.zarr"
    write_store(p, grads, 48, ("a", "b"), loss_fn=lambda i, src, rng: 2.0 * np.exp(-i / 12) + 0.05 * rng.standard_normal())
    store = Store(p)
    ctx = Context(store=store, meta=store.meta, batches=store.batches(), grams={})
    cache = shared_detrending(ctx)
    assert shared_detrending(ctx) is cache
    ls = loss_spectrum.ANALYSIS.compute(ctx)
    fr = fractal.ANALYSIS.compute(ctx)
    assert ls.table["ar1"].notna().all() and cache.hits == 1  # batches/loss: fractal read what loss_spectrum computed
    fresh, opt = from_context(ctx), SpectrumOptions()
    _same_result(ls, loss_spectrum.analyze_series(fresh, opt))
    _same_result(fr, fractal.analyze_series(fresh, opt))


# ------------------------------------------------------------------ the smaller shortcuts
def test_median_is_numpys_bit_for_bit() -> None:
    rng = np.random.default_rng(4)
    for n in [*range(0, 40), 63, 64, 1001]:
        for t in range(30):
            a = rng.standard_normal(n) * rng.lognormal(0, 4)
            if t % 3 == 1:
                a = np.round(a)                              # ties
            if t % 5 == 2:
                a = np.where(rng.random(n) < 0.5, -0.0, 0.0)  # signed zeros only
            if t % 7 == 3 and n:
                a[rng.integers(n)] = np.nan
            with np.errstate(all="ignore"):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref = float(np.median(a))
                    got = dt.median(a)
            assert np.array_equal(ref, got, equal_nan=True) and np.signbit(ref) == np.signbit(got), (n, t)


def _log_time_fit_reference(y: np.ndarray, degree: int = 3) -> np.ndarray:
    """The fit as it was written: one public ``np.linalg.lstsq`` per basis."""
    best, best_rss = np.full(y.size, y.mean()), np.inf
    for basis in dt._log_time_bases(y.size, degree):
        coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
        fit = basis @ coef
        rss = float(((y - fit) ** 2).sum())
        if rss < best_rss:
            best, best_rss = fit, rss
    return best


def test_log_time_fit_in_one_stacked_call_equals_the_public_lstsq_per_basis() -> None:
    rng = np.random.default_rng(5)
    for n in (32, 33, 47, 64, 100, 512, 3000):
        for t in range(40 if n < 512 else 4):
            y = _curve(n, rng, t) * rng.lognormal(0, 3) + rng.standard_normal() * 50
            coefs = dt._log_time_coefs(y, 3)
            for basis, c in zip(dt._log_time_bases(n, 3), coefs, strict=True):   # SVD against gelsd: rounding
                want = np.linalg.lstsq(basis, y, rcond=None)[0]
                np.testing.assert_allclose(basis @ c, basis @ want, rtol=1e-9, atol=1e-9 * np.abs(y).max())
            np.testing.assert_allclose(dt.log_time_fit(y), _log_time_fit_reference(y), rtol=1e-9,
                                       atol=1e-9 * np.abs(y).max())


def _higuchi_reference(x: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Higuchi's lengths as the definition's loop (one difference per offset)."""
    n, out = x.size, np.empty(ks.size)
    for a, k in enumerate(ks):
        lm = [np.abs(np.diff(x[m::k])).sum() * (n - 1) / ((x[m::k].size - 1) * k) / k
              for m in range(int(k)) if x[m::k].size >= 2]
        out[a] = np.mean(lm)
    return out


def test_higuchi_lengths_equal_the_definitions_loop_and_scales_are_shared_read_only() -> None:
    rng = np.random.default_rng(6)
    for n in (32, 33, 50, 100, 1000, 5000):
        for t in range(10):
            x = rng.standard_normal(n) * rng.lognormal(0, 3)
            x = x.cumsum() if t % 2 else x
            ks = fractal._scales(1, int(min(max(n // 10, 16), 1000)))
            np.testing.assert_array_equal(fractal.higuchi_lengths(x, ks), _higuchi_reference(x, ks))
    s = fractal._scales(1, 16)
    assert fractal._scales(1, 16) is s and not s.flags.writeable
    np.testing.assert_array_equal(s, np.unique(np.round(np.geomspace(1, 16, 24)).astype(int)))


def test_ar1_autocovariance_in_one_buffer_is_filtered_ar1_acov() -> None:
    rng = np.random.default_rng(7)
    det = detrend(_curve(32, rng, 0), "savgol", 33)
    gain = det.gain_grid(1 << 14)
    grid = GainGrid(gain)
    for a in (-0.95, 0.995, *rng.uniform(-0.95, 0.995, 50)):
        np.testing.assert_array_equal(grid.acov(float(a), 40), filtered_ar1_acov(float(a), gain, 40))
