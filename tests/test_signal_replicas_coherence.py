"""Issue 28: coherence and the long-window smoother without ``scipy.signal``, SciPy's floats bit for bit.

:func:`~gradforensics.analysis.toolkit.signal.replicas.csd_density`,
:func:`~gradforensics.analysis.toolkit.signal.replicas.coherence_density` and
:func:`~gradforensics.analysis.toolkit.signal.replicas.fftconvolve_same` are held against
``scipy.signal.csd`` / ``coherence`` / ``fftconvolve`` with ``==`` (NaN equal to NaN, dtype and
shape too), never a tolerance, on random inputs of many lengths, segment lengths and scales and on
the edge cases (a segment as long as the series, odd segments, constant and zero series, NaN,
lengths where SciPy's fast FFT length pads); then ``pair_coherence`` and the long-window
detrender against their code as it was (with ``scipy.signal``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from scipy.signal import coherence, csd, fftconvolve, find_peaks, get_window

from gradforensics.analysis.kinds import coherence as co
from gradforensics.analysis.toolkit.signal import (
    SpectrumOptions,
    adjust_pvalues,
    default_nperseg,
    detrend,
    refine_frequency,
    winsorize,
)
from gradforensics.analysis.toolkit.signal import detrending as dt
from gradforensics.analysis.toolkit.signal import replicas as rp


def _same(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def _pairs(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    scale = float(rng.choice([1e-9, 1.0, 1e9]))
    a = (rng.normal(size=n) + np.cumsum(rng.normal(size=n)) * rng.random()) * scale
    shared = np.sin(2 * np.pi * np.arange(n) / 9.0) * scale
    nan = a.copy()
    nan[n // 3] = np.nan
    return [(a, rng.normal(size=n) * scale), (a + shared, a * 0.5 + shared + rng.normal(size=n) * scale),
            (a, a), (np.full(n, 2.5), a), (np.zeros(n), np.zeros(n)), (nan, a), (np.round(a), -a)]


_KW = {"fs": 1.0, "nperseg": None, "noverlap": None, "detrend": False}


@pytest.mark.parametrize("n", [16, 17, 31, 32, 33, 48, 64, 100, 257, 600])
def test_csd_and_coherence_are_scipys(n: int) -> None:
    rng = np.random.default_rng(2800 + n)
    for nper in sorted({16, 17, 32, 33, 64, 128, n}):
        if nper > n:
            continue
        win = get_window("hann", nper)
        kw = {**_KW, "window": win, "nperseg": nper, "noverlap": nper // 2}
        for x, y in _pairs(rng, n):
            with np.errstate(all="ignore"):
                f1, p1 = csd(x, y, **kw)
                _, c1 = coherence(x, y, **kw)
                f2, p2 = rp.csd_density(x, y, win, nper)
                g2, c2, q2 = rp.coherence_density(x, y, win, nper)
            assert _same(f1, f2) and _same(f1, g2), (n, nper)
            assert _same(p1, p2) and _same(p1, q2), (n, nper)
            assert _same(c1, c2), (n, nper)


def test_welch_density_still_is_scipys_after_the_split() -> None:
    from scipy.signal import welch

    rng = np.random.default_rng(28)
    for n, nper in ((16, 16), (33, 17), (257, 64), (600, 128)):
        win = get_window("hann", nper)
        for x, _ in _pairs(rng, n):
            with np.errstate(all="ignore"):
                want = welch(x, fs=1.0, window=win, nperseg=nper, noverlap=nper // 2, detrend=False)
                got = rp.welch_density(x, win, nper)
            assert _same(want[0], got[0]) and _same(want[1], got[1]), (n, nper)


@pytest.mark.parametrize("n", [2, 3, 5, 1026, 1100, 2049, 3001, 4096, 5000, 8193, 9999])
def test_fftconvolve_same_is_scipys(n: int) -> None:
    rng = np.random.default_rng(n)
    for m in sorted({2, 3, 5, 1027, 2049, n, n // 2 | 1}):
        if m < 2:
            continue
        a = np.cumsum(rng.normal(size=n)) * float(rng.choice([1e-12, 1.0, 1e12]))
        b = rng.normal(size=m)
        nan = a.copy()
        nan[n // 2] = np.nan
        for x, k in ((a, b), (a, b[::-1]), (np.full(n, 3.0), b), (np.zeros(n), b), (nan, b), (b, a)):
            assert _same(rp.fftconvolve_same(x, k), fftconvolve(x, k, mode="same")), (n, m)


def _savgol_fft_with_scipy(z: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """detrending._savgol_fft as it was: scipy.signal.fftconvolve."""
    w = coeffs.size
    half = w // 2
    out = fftconvolve(z, coeffs[::-1], mode="same")
    t = np.arange(w, dtype=float)
    for sl, idx in ((slice(0, w), slice(0, half)), (slice(z.size - w, z.size), slice(w - half, w))):
        poly = np.polynomial.polynomial.Polynomial.fit(t, z[sl], 3)
        seg = out[sl]
        seg[idx] = poly(t[idx])
        out[sl] = seg
    return out


@pytest.mark.parametrize("n,w", [(1027, 1027), (2100, 2049), (5000, 1027), (8192, 2049), (9000, 4097)])
def test_the_long_window_smoother_is_the_scipy_one(n: int, w: int) -> None:
    rng = np.random.default_rng(n + w)
    for z in (np.cumsum(rng.normal(size=n)), rng.normal(size=n) * 1e6, np.full(n, -1.5),
              np.linspace(0, 1, n) ** 3):
        coeffs = dt._savgol_coeffs(w)
        assert _same(dt._savgol_fft(z, coeffs), _savgol_fft_with_scipy(z, coeffs)), (n, w)


def _pair_coherence_with_scipy(a: np.ndarray, b: np.ndarray, opt: SpectrumOptions) -> co.PairCoherence:
    """coherence.pair_coherence as it was (26c235c): scipy.signal's coherence, csd and find_peaks."""
    n = min(a.size, b.size)
    nper = min(opt.nperseg or default_nperseg(n), n)
    res = []
    for y in (a[:n], b[:n]):
        det = detrend(y, "savgol", 2 * nper + 1)
        res.append(winsorize(det.residual, opt.clip_mad)[0])
    kw = {"fs": 1.0, "window": "hann", "nperseg": nper, "noverlap": nper // 2, "detrend": False}
    f, c = coherence(res[0], res[1], **kw)
    _, sab = csd(res[0], res[1], **kw)
    k_eff = max(n / nper, 2.0)
    tested = (f > 0) & (det.gain(f) >= 0.5)
    p = np.ones(f.size)
    p[tested] = co.msc_pvalue(c[tested], k_eff)
    p_adj = np.ones(f.size)
    p_adj[tested] = adjust_pvalues(p[tested], opt.correction)
    m = max(int(tested.sum()), 1)
    idx, _ = find_peaks(np.concatenate([[-1.0], np.where(tested, c, -1.0), [-1.0]]))
    idx = sorted((int(i) - 1 for i in idx if tested[int(i) - 1]), key=lambda k: -c[k])
    sig = [k for k in idx if p_adj[k] < opt.alpha]
    peaks = (sig or idx[:1])[: opt.max_peaks]
    both = res[0] / np.std(res[0]) + res[1] / np.std(res[1])
    refined = [refine_frequency(both, float(f[k]), 1.0 / nper) for k in peaks]
    return co.PairCoherence(f, c, np.angle(sab), refined, p, p_adj, tested, k_eff,
                            co.msc_threshold(opt.alpha / m, k_eff), peaks, n)


@pytest.mark.parametrize("n", [32, 33, 47, 64, 200, 513, 1500])
def test_pair_coherence_is_the_scipy_code(n: int) -> None:
    rng = np.random.default_rng(n)
    t = np.arange(n)
    for opt in (SpectrumOptions(), SpectrumOptions(nperseg=16), SpectrumOptions(clip_mad=0.0)):
        for _ in range(4):
            common = np.sin(2 * np.pi * t / rng.uniform(5, 20)) * rng.uniform(0, 2)
            a = np.exp(-t / n) + common + rng.normal(size=n) * 0.3
            b = np.exp(-t / n) + common + rng.normal(size=n + int(rng.integers(0, 5))) [:n] * 0.3
            want, got = _pair_coherence_with_scipy(a, b, opt), co.pair_coherence(a, b, opt)
            for field in ("freq", "msc", "phase", "p_value", "p_adjusted", "tested"):
                assert _same(getattr(got, field), getattr(want, field)), (n, field)
            assert (got.peaks, got.peak_freq, got.k_eff, got.threshold, got.n_points) == (
                want.peaks, want.peak_freq, want.k_eff, want.threshold, want.n_points)


def test_pair_coherence_on_the_long_window_path_is_the_scipy_code() -> None:
    rng = np.random.default_rng(8200)
    n = 8300                                    # default nperseg 1024: the smoother's window 2049 > 1025
    t = np.arange(n)
    common = np.sin(2 * np.pi * t / 37.0)
    a, b = common + rng.normal(size=n), common + rng.normal(size=n)
    want, got = _pair_coherence_with_scipy(a, b, SpectrumOptions()), co.pair_coherence(a, b)
    for field in ("freq", "msc", "phase", "p_value", "p_adjusted"):
        assert _same(getattr(got, field), getattr(want, field)), field
    assert (got.peaks, got.peak_freq) == (want.peaks, want.peak_freq)


@pytest.mark.slow
def test_coherence_and_the_long_smoother_do_not_import_scipy_signal() -> None:
    code = ("import sys, numpy as np\n"
            "from gradforensics.analysis.kinds import coherence\n"
            "from gradforensics.analysis.toolkit.signal import detrend\n"
            "rng = np.random.default_rng(0)\n"
            "a, b = rng.normal(size=300), rng.normal(size=300)\n"
            "coherence.pair_coherence(a, b); detrend(rng.normal(size=3000), 'savgol', 2049)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('scipy.signal', 'scipy.optimize', 'scipy.stats'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
