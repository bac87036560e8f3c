"""The line spectrum of a loss curve: a detrended Welch periodogram tested against AR(1) red noise.

:func:`line_spectrum` runs the whole test on one uniformly sampled series:

1. removes the trend with a Savitzky–Golay high-pass (default) or a first
   difference, both linear filters with a known power gain ``G(f)``
   (:mod:`~gradforensics.analysis.toolkit.signal.detrending`);
2. estimates the spectrum of the residual with Welch's method (Hann window, 50 %
   overlap);
3. fits an AR(1) red-noise background *to the residual*: the AR(1) coefficient is
   the one whose spectrum, passed through ``G(f)``, reproduces the residual's
   lag-1 autocorrelation; its scale reproduces the residual's variance; the
   background is the exact expected Welch estimate of that model
   (:mod:`~gradforensics.analysis.toolkit.signal.background`).  When peaks are
   significant, the background is refitted once with their least-squares
   sinusoids removed (a strong oscillation would otherwise inflate both the
   lag-1 autocorrelation and the variance) and the test repeated;
4. tests every frequency with the χ² confidence of Torrence & Compo (1998),
   ``P/B ~ χ²_ν / ν`` (their eq. 18), with ν the equivalent degrees of freedom of
   the Welch average (Percival & Walden 1993, eq. 292b);
5. corrects for testing many frequencies (Benjamini–Hochberg by default,
   Bonferroni on request, :func:`adjust_pvalues`) and reports the local maxima
   that survive, with harmonics grouped under their fundamental.

References
----------
Torrence, C. & Compo, G. P. (1998). A practical guide to wavelet analysis.
    Bull. Amer. Meteor. Soc. 79, 61–78 (eqs. 16–18).
Percival, D. B. & Walden, A. T. (1993). Spectral Analysis for Physical
    Applications. Cambridge University Press (eq. 292b).
Benjamini, Y. & Hochberg, Y. (1995). Controlling the false discovery rate.
    J. R. Stat. Soc. B 57, 289–300.

The corrections, the refined frequencies and the harmonic grouping live in
:mod:`~gradforensics.analysis.toolkit.signal.peaks` (importable from here as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.signal.background import GainGrid, expected_welch, fit_ar1, hann, welch_dof
from gradforensics.analysis.toolkit.signal.detrending import (
    DETRENDERS,
    DetrendCache,
    Detrended,
    default_nperseg,
    detrend,
    winsorize,
)
from gradforensics.analysis.toolkit.signal.peaks import (
    CORRECTIONS,
    Peak,
    adjust_pvalues,
    group_harmonics,
    refine_frequency,
)
from gradforensics.errors import SpecError

__all__ = [
    "CORRECTIONS",
    "MIN_POINTS",
    "LineSpectrum",
    "Peak",
    "SpectrumOptions",
    "adjust_pvalues",
    "gain_grid",
    "group_harmonics",
    "line_spectrum",
    "refine_frequency",
    "sinusoid_fit",
    "spectrum_window",
    "tested_spectrum",
]


MIN_POINTS = 32


@dataclass(frozen=True)
class SpectrumOptions(Options):
    """Options of :func:`line_spectrum`, validated once.

    The options of each loss-curve analysis: ``loss_spectrum``, ``fractal`` and
    ``coherence`` (each parses its own ``options[name]``), and of ``gradforensics loss``.

    Parameters
    ----------
    detrend
        ``"savgol"``: subtract a Savitzky–Golay smooth (cubic, window
        ``2 * nperseg + 1``); ``"diff"``: first difference.
    nperseg
        Welch segment length; default the largest power of two ≤ N/8 (at least 16).
    alpha
        Significance level after the multiple-testing correction.
    correction
        ``"bh"`` (Benjamini–Hochberg) or ``"bonferroni"`` over the tested frequencies.
    clip_mad
        Winsorise the residual at ``median ± clip_mad · 1.4826 · MAD`` so a single
        loss spike does not masquerade as broadband power (0 disables).
    max_peaks
        Peaks reported per series (significant ones first).
    axis
        For a store: sample by ``"step"`` (``batches/step``; the record order in
        replay mode) or by ``"time"`` (``batches/time``; frequencies in Hz).
    """

    detrend: str = "savgol"
    nperseg: int | None = None
    alpha: float = 0.01
    correction: str = "bh"
    clip_mad: float = 6.0
    max_peaks: int = 5
    axis: str = "step"

    def __post_init__(self) -> None:
        if self.axis not in ("step", "time"):
            raise SpecError(f"SpectrumOptions: axis must be 'step' or 'time'; got {self.axis!r}.")
        if self.detrend not in DETRENDERS:
            raise SpecError(f"SpectrumOptions: detrend must be one of {DETRENDERS}; got {self.detrend!r}.")
        if self.correction not in CORRECTIONS:
            raise SpecError(f"SpectrumOptions: correction must be one of {CORRECTIONS}; got {self.correction!r}.")
        if not 0.0 < self.alpha < 0.5:
            raise SpecError(f"SpectrumOptions: alpha must be in (0, 0.5); got {self.alpha!r}.")
        if self.nperseg is not None and self.nperseg < 16:
            raise SpecError(f"SpectrumOptions: nperseg must be >= 16; got {self.nperseg!r}.")
        if self.clip_mad < 0 or self.max_peaks < 1:
            raise SpecError(f"SpectrumOptions: clip_mad must be >= 0 and max_peaks >= 1; got {self.clip_mad}, "
                            f"{self.max_peaks}.")


# --------------------------------------------------------------------- result
@dataclass
class LineSpectrum:
    """Everything :func:`line_spectrum` measured on one series (fs = 1 sample⁻¹).

    ``freq`` etc. cover the Welch bins; ``tested`` marks the band where the
    detrender passes at least half the power (and f > 0); ``threshold`` is the
    power a bin needs to be significant after a Bonferroni correction (the
    conservative bound of the BH line), ``threshold_nominal`` the per-bin
    ``1 − alpha`` χ² line.
    """

    freq: np.ndarray
    power: np.ndarray
    background: np.ndarray
    p_value: np.ndarray
    p_adjusted: np.ndarray
    tested: np.ndarray
    threshold: np.ndarray
    threshold_nominal: np.ndarray
    dof: float
    nperseg: int
    n_segments: int
    ar1: float
    sigma2: float
    detrended: Detrended
    n_clipped: int
    peaks: list[Peak]
    n_significant: int
    options: SpectrumOptions

    @property
    def significant(self) -> list[Peak]:
        return [p for p in self.peaks if p.significant]


def _chi2_line(bg: np.ndarray, dof: np.ndarray, level: float) -> np.ndarray:
    from scipy.special import chdtri

    return bg * _chi2_isf(level, dof, chdtri) / dof


def _chi2_isf(level: float, dof: np.ndarray, chdtri: Any) -> np.ndarray:
    """``scipy.stats.chi2.isf(level, dof)`` for 0 < level < 1, dof > 0: SciPy's own ``chdtri``
    without the distribution machinery around it (milliseconds a series)."""
    return np.asarray(chdtri(np.asarray(dof, dtype=float), float(level)), dtype=float)


def _chi2_sf(x: np.ndarray, dof: np.ndarray) -> np.ndarray:
    """``scipy.stats.chi2.sf(x, dof)`` for x >= 0, dof > 0: ``chdtrc``, and exactly 1 at x = 0 as SciPy gives."""
    from scipy.special import chdtrc

    x = np.asarray(x, dtype=float)
    return np.where(x <= 0, 1.0, chdtrc(np.asarray(dof, dtype=float), x))


def line_spectrum(y: np.ndarray, options: SpectrumOptions | None = None, cache: DetrendCache | None = None
                  ) -> LineSpectrum:
    """Detrend *y*, estimate its Welch spectrum and test it against AR(1) red noise.

    Parameters
    ----------
    y
        Uniformly sampled, finite values (at least :data:`MIN_POINTS`).
    options
        See :class:`SpectrumOptions`.
    cache
        Where the run's analyses share each series' detrended and winsorised residual
        (:class:`~gradforensics.analysis.toolkit.signal.detrending.DetrendCache`; the same
        values as without it, read-only).

    Returns
    -------
    LineSpectrum
        Frequencies in cycles per sample; divide by the sample spacing for
        physical units.

    Notes
    -----
    Each bin's statistic ``P/B`` is χ²_ν/ν under the null (Torrence & Compo
    1998, eq. 18; ν from :func:`welch_dof`, halved at Nyquist).  The p-values are
    adjusted over the tested bins, so ``alpha`` bounds the chance of *any* false
    peak in a pure red-noise series (BH controls the family-wise rate under the
    global null).
    """
    opt = options or SpectrumOptions()
    src, y = y, np.asarray(y, dtype=float)
    if y.size < MIN_POINTS or not np.all(np.isfinite(y)):
        raise SpecError(f"line_spectrum: need at least {MIN_POINTS} finite values; got {y.size} "
                        f"({int(np.count_nonzero(~np.isfinite(y)))} non-finite).")
    nper, window = spectrum_window(y.size, opt)
    if cache is None:
        det = detrend(y, opt.detrend, window)
        r, n_clipped = winsorize(det.residual, opt.clip_mad)
    else:
        det, r, n_clipped = cache.get(src, opt.detrend, window, opt.clip_mad)
    return tested_spectrum(r, det, n_clipped, nper, opt)


def spectrum_window(n: int, opt: SpectrumOptions) -> tuple[int, int | None]:
    """Welch segment length (before the residual's own length caps it) and the detrending window for *n* points."""
    nper = min(opt.nperseg or default_nperseg(n), n)
    return nper, None if opt.detrend == "diff" else 2 * nper + 1


def tested_spectrum(r: np.ndarray, det: Detrended, n_clipped: int, nper: int, opt: SpectrumOptions,
                    welch_out: tuple[np.ndarray, np.ndarray] | None = None,
                    first_fit: tuple[float, float, np.ndarray] | None = None) -> LineSpectrum:
    """:func:`line_spectrum` from the winsorised residual *r* of *det* on: Welch, the AR(1)
    background, the tests and the peaks.  *welch_out* (``freq, power``) and *first_fit*
    (``alpha, sigma2, acov``: the first AR(1) fit and its autocovariance, lags ``0..nper-1``)
    are what the stacked path (:func:`~gradforensics.analysis.toolkit.signal.spectra.line_spectra`)
    computed for many series at once, the same values."""
    from gradforensics.analysis.toolkit.signal.replicas import local_maxima, welch_density

    nper = min(nper, r.size)
    # SciPy's Welch estimate (replicas.welch_density: its steps, without importing scipy.signal) with
    # the Hann window SciPy makes of "hann", made once per length
    freq, power = welch_out or welch_density(r, hann(nper), nper)
    n_seg = 1 + (r.size - nper) // (nper - nper // 2)
    dof = np.full(freq.size, welch_dof(nper, n_seg))
    if nper % 2 == 0:
        dof[-1] /= 2.0
    grid = gain_grid(det, nper)
    tested = (freq > 0) & ((det.method == "diff") | (det.gain(freq) >= 0.5))
    fit = r
    for i in range(2):   # second pass: background refitted with the significant sinusoids removed
        if i == 0 and first_fit is not None:
            a, s2, acov = first_fit
        else:
            a, s2 = fit_ar1(fit, grid)
            acov = grid.acov(a, nper)
        bg = s2 * expected_welch(acov[:nper], nper)
        ok = tested & (bg > 0)
        p = np.ones(freq.size)
        p[ok] = _chi2_sf(dof[ok] * power[ok] / bg[ok], dof[ok])
        p_adj = np.ones(freq.size)
        p_adj[ok] = adjust_pvalues(p[ok], opt.correction)
        peaks, n_sig = _peaks(r, freq, power, bg, p, p_adj, ok, det, nper, opt, local_maxima)
        sig = [q.frequency for q in peaks if q.significant]
        if not sig or fit is not r:
            break
        fit = r - sinusoid_fit(r, sig)
    m = max(int(ok.sum()), 1)
    return LineSpectrum(freq, power, bg, p, p_adj, ok, _chi2_line(bg, dof, opt.alpha / m),
                        _chi2_line(bg, dof, opt.alpha), float(dof[1] if dof.size > 1 else dof[0]), nper,
                        n_seg, a, s2, det, n_clipped, peaks, n_sig, opt)


def gain_grid(det: Detrended, nper: int) -> GainGrid:
    """The gain grid the AR(1) background of a residual of *det* with Welch segments of *nper* is fitted on."""
    return _gain_grid(det, max(1 << 14, 1 << int(np.ceil(np.log2(8 * nper)))))


_GRIDS: dict[tuple[str, bytes, int], GainGrid] = {}


def _gain_grid(det: Detrended, m: int) -> GainGrid:
    """The gain grid of *det*'s filter on *m* points, shared by every series detrended alike.

    A store's gradient-norm series all have the store's length, hence one detrender:
    its grid, cosine and AR(1) autocovariances are computed once, not once a series.
    """
    key = (det.method, np.asarray(det.coeffs, dtype=float).tobytes(), int(m))
    grid = _GRIDS.get(key)
    if grid is None:
        if len(_GRIDS) >= 16:
            _GRIDS.clear()
        grid = _GRIDS[key] = GainGrid(det.gain_grid(m))
    return grid


def sinusoid_fit(r: np.ndarray, freqs: Sequence[float]) -> np.ndarray:
    """Least-squares sum of sinusoids at *freqs* (cycles/sample) fitted to *r*."""
    t = np.arange(r.size)
    cols = [np.ones(r.size)]
    for f in freqs:
        cols += [np.cos(2 * np.pi * f * t), np.sin(2 * np.pi * f * t)]
    basis = np.column_stack(cols)
    coef, *_ = np.linalg.lstsq(basis, r, rcond=None)
    return basis[:, 1:] @ coef[1:]


def _peaks(r, freq, power, bg, p, p_adj, tested, det, nper, opt, find_peaks) -> tuple[list[Peak], int]:
    """Local maxima of P/B in the band: the significant ones by excess variance
    (largest oscillation first), else the most significant candidate; and how
    many were significant in all."""
    ratio = np.where(tested, power / np.where(bg > 0, bg, np.inf), 0.0)
    idx = find_peaks(np.concatenate([[-1.0], ratio, [-1.0]]))     # scipy.signal.find_peaks(...)[0]
    idx = [int(i) - 1 for i in idx if tested[int(i) - 1]]
    df = 1.0 / nper

    def excess(k: int) -> float:
        lobe = slice(max(k - 2, 0), k + 3)
        return float(np.clip(power[lobe] - bg[lobe], 0, None).sum() * df)

    sig = sorted((k for k in idx if p_adj[k] < opt.alpha), key=lambda k: -excess(k))
    chosen = (sig or sorted(idx, key=lambda k: (p_adj[k], p[k]))[:1])[: opt.max_peaks]
    out: list[Peak] = []
    for k in chosen:
        f = refine_frequency(r, float(freq[k]), df)
        g = float(det.gain(np.array([f]))[0])
        amp = float(np.sqrt(2.0 * excess(k) / g)) if g > 0 else float("nan")
        out.append(Peak(k, f, float(power[k]), float(bg[k]), float(p[k]), float(p_adj[k]),
                        bool(p_adj[k] < opt.alpha), excess(k), amp))
    groups = group_harmonics([q.frequency for q in out], 0.5 * df)
    return [Peak(**{**q.__dict__, "harmonic_of": g[0], "harmonic_number": g[1]}) if q.significant else q
            for q, g in zip(out, groups)], len(sig)

