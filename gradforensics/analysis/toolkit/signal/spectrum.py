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

The corrections, the candidate bins, the refined frequencies and the harmonic grouping live in
:mod:`~gradforensics.analysis.toolkit.signal.peaks`.  :func:`line_spectra` runs every step on a
stack of series of one length (:func:`line_spectrum` is one series).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.signal.background import GainGrid, ar1_fits, expected_welch, welch_dof
from gradforensics.analysis.toolkit.signal.detrending import (
    DETRENDERS,
    DetrendCache,
    Detrended,
    default_nperseg,
    detrend_many,
    savgol_coeffs,
)
from gradforensics.analysis.toolkit.signal.peaks import (
    CORRECTIONS,
    Peak,
    adjust_pvalues,
    group_harmonics,
    local_maxima,
    refine_frequency,
)
from gradforensics.analysis.toolkit.signal.trend import winsorize
from gradforensics.analysis.toolkit.signal.welch import welch
from gradforensics.errors import SpecError

__all__ = ["MIN_POINTS", "STACK", "LineSpectrum", "SpectrumOptions", "chi2_isf", "chi2_sf", "detrender_grid", "gain_grid",
           "line_spectra", "line_spectrum",
           "sinusoid_fit", "spectrum_window"]


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
    return bg * chi2_isf(level, dof) / dof


def chi2_isf(level: float, dof: np.ndarray) -> np.ndarray:
    """``scipy.stats.chi2.isf(level, dof)`` for 0 < level < 1, dof > 0, by ``scipy.special.chdtri``
    (without the distribution machinery around it: milliseconds a series)."""
    from scipy.special import chdtri

    return np.asarray(chdtri(np.asarray(dof, dtype=float), float(level)), dtype=float)


def chi2_sf(x: np.ndarray, dof: np.ndarray) -> np.ndarray:
    """``scipy.stats.chi2.sf(x, dof)`` for x >= 0, dof > 0, by ``scipy.special.chdtrc`` (1 at x = 0)."""
    from scipy.special import chdtrc

    x = np.asarray(x, dtype=float)
    return np.where(x <= 0, 1.0, chdtrc(np.asarray(dof, dtype=float), x))


#: Series tested together at most (bounds the stack of 16,384-point autocovariances).
STACK = 256


def line_spectrum(y: np.ndarray, options: SpectrumOptions | None = None, cache: DetrendCache | None = None
                  ) -> LineSpectrum:
    """Detrend *y*, estimate its Welch spectrum and test it against AR(1) red noise (:func:`line_spectra` of one).

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
    return line_spectra([y], options, cache)[0]


def line_spectra(ys: Sequence[np.ndarray], options: SpectrumOptions | None = None,
                 cache: DetrendCache | None = None) -> list[LineSpectrum]:
    """:func:`line_spectrum` of every series of *ys*, the series of one length detrended, transformed and
    fitted as one stack (at most :data:`STACK` at a time).  A series too short or not finite raises."""
    opt = options or SpectrumOptions()
    out: list[LineSpectrum | None] = [None] * len(ys)
    by_size: dict[int, list[int]] = {}
    for i, y in enumerate(ys):
        a = np.asarray(y, dtype=float)
        if a.ndim != 1 or a.size < MIN_POINTS or not np.all(np.isfinite(a)):
            raise SpecError(f"line_spectrum: need at least {MIN_POINTS} finite values; got {a.size} "
                            f"({int(np.count_nonzero(~np.isfinite(a)))} non-finite).")
        by_size.setdefault(a.size, []).append(i)
    for n, idx in by_size.items():
        nper, window = spectrum_window(n, opt)
        for k in range(0, len(idx), STACK):
            part = idx[k:k + STACK]
            if cache is not None:
                got = cache.get_many([ys[i] for i in part], opt.detrend, window, opt.clip_mad)
            else:
                got = [(d, *winsorize(d.residual, opt.clip_mad))
                       for d in detrend_many([np.asarray(ys[i], dtype=float) for i in part], opt.detrend, window)]
            for i, res in zip(part, _tested([g[0] for g in got], np.stack([g[1] for g in got]),
                                            [g[2] for g in got], nper, opt)):
                out[i] = res
    return [o for o in out if o is not None]


def spectrum_window(n: int, opt: SpectrumOptions) -> tuple[int, int | None]:
    """Welch segment length (before the residual's own length caps it) and the detrending window for *n* points."""
    nper = min(opt.nperseg or default_nperseg(n), n)
    return nper, None if opt.detrend == "diff" else 2 * nper + 1


def _tested(dets: list[Detrended], R: np.ndarray, n_clipped: list[int], nper: int, opt: SpectrumOptions
            ) -> list[LineSpectrum]:
    """The spectra of the winsorised residuals *R* (``(U, n)``, detrended alike by *dets*): Welch, the AR(1)
    background, the tests and the peaks; the rows with significant peaks fitted again without them."""
    det = dets[0]
    nper = min(nper, R.shape[1])
    freq, power = welch(R, nper)
    n_seg = 1 + (R.shape[1] - nper) // (nper - nper // 2)
    dof = np.full(freq.size, welch_dof(nper, n_seg))
    if nper % 2 == 0:
        dof[-1] /= 2.0
    grid = gain_grid(det, nper)
    tested = (freq > 0) & ((det.method == "diff") | (det.gain(freq) >= 0.5))
    got = _background(R, power, dof, tested, det, grid, nper, opt)
    refit = [u for u in range(R.shape[0]) if any(q.significant for q in got[u][-1][0])]
    if refit:   # background refitted with the significant sinusoids removed (they inflate ρ̂ and the variance)
        F = np.stack([R[u] - sinusoid_fit(R[u], [q.frequency for q in got[u][-1][0] if q.significant]) for u in refit])
        again = _background(F, power[refit], dof, tested, det, grid, nper, opt, R[refit])
        for u, g in zip(refit, again):
            got[u] = g
    out = []
    for u, (a, s2, bg, p, p_adj, ok, (peaks, n_sig)) in enumerate(got):
        m = max(int(ok.sum()), 1)
        out.append(LineSpectrum(freq, power[u], bg, p, p_adj, ok, _chi2_line(bg, dof, opt.alpha / m),
                                _chi2_line(bg, dof, opt.alpha), float(dof[1] if dof.size > 1 else dof[0]), nper,
                                n_seg, a, s2, dets[u], n_clipped[u], peaks, n_sig, opt))
    return out


def _background(F: np.ndarray, power: np.ndarray, dof: np.ndarray, tested: np.ndarray, det: Detrended,
                grid: GainGrid, nper: int, opt: SpectrumOptions, R: np.ndarray | None = None) -> list[tuple[Any, ...]]:
    """For each row: the AR(1) fit to *F* and its expected Welch estimate, the p-values of *power* and the
    peaks of *R* (default *F*): ``(alpha, sigma2, background, p, p_adjusted, tested, (peaks, n_significant))``."""
    alpha, sigma2, acov, ok_fit = ar1_fits(F, grid, nper)
    if not ok_fit.all():
        raise ValueError("line_spectrum: the AR(1) root search found no root (a non-finite residual?).")
    B = sigma2[:, None] * expected_welch(acov, nper)
    R = F if R is None else R
    out: list[tuple[Any, ...]] = []
    for u in range(F.shape[0]):
        bg = B[u]
        ok = tested & (bg > 0)
        p, p_adj = np.ones(bg.size), np.ones(bg.size)
        p[ok] = chi2_sf(dof[ok] * power[u, ok] / bg[ok], dof[ok])
        p_adj[ok] = adjust_pvalues(p[ok], opt.correction)
        out.append((float(alpha[u]), float(sigma2[u]), bg, p, p_adj, ok,
                    _peaks(R[u], power[u], bg, p, p_adj, ok, det, nper, opt)))
    return out


def gain_grid(det: Detrended, nper: int) -> GainGrid:
    """The gain grid the AR(1) background of a residual of *det* with Welch segments of *nper* is fitted on."""
    return detrender_grid(det.method, det.window, max(1 << 14, 1 << int(np.ceil(np.log2(8 * nper)))))


@lru_cache(maxsize=16)
def detrender_grid(method: str, window: int, m: int) -> GainGrid:
    """The gain grid on *m* points of :func:`~gradforensics.analysis.toolkit.signal.detrending.detrend`'s
    filter (*method*, *window*), shared by every series detrended alike.

    A store's gradient-norm series all have the store's length, hence one detrender:
    its grid and cosine are computed once, not once a series.
    """
    coeffs = savgol_coeffs(window) if method == "savgol" else np.zeros(0)
    return GainGrid(Detrended(np.zeros(0), np.zeros(0), method, window, 0, coeffs).gain_grid(m))


def sinusoid_fit(r: np.ndarray, freqs: Sequence[float]) -> np.ndarray:
    """Least-squares sum of sinusoids at *freqs* (cycles/sample) fitted to *r*."""
    t = np.arange(r.size)
    cols = [np.ones(r.size)]
    for f in freqs:
        cols += [np.cos(2 * np.pi * f * t), np.sin(2 * np.pi * f * t)]
    basis = np.column_stack(cols)
    coef, *_ = np.linalg.lstsq(basis, r, rcond=None)
    return basis[:, 1:] @ coef[1:]


def _candidates(power: np.ndarray, bg: np.ndarray, tested: np.ndarray) -> list[int]:
    """The tested bins where ``P/B`` is a local maximum."""
    ratio = np.where(tested, power / np.where(bg > 0, bg, np.inf), 0.0)
    return [int(i) - 1 for i in local_maxima(np.concatenate([[-1.0], ratio, [-1.0]])) if tested[int(i) - 1]]


def _peaks(r: np.ndarray, power: np.ndarray, bg: np.ndarray, p: np.ndarray, p_adj: np.ndarray, tested: np.ndarray,
           det: Detrended, nper: int, opt: SpectrumOptions) -> tuple[list[Peak], int]:
    """Local maxima of P/B in the band: the significant ones by excess variance (largest oscillation
    first), else the most significant candidate; and how many were significant in all."""
    idx = _candidates(power, bg, tested)
    df = 1.0 / nper

    def excess(k: int) -> float:
        lobe = slice(max(k - 2, 0), k + 3)
        return float(np.clip(power[lobe] - bg[lobe], 0, None).sum() * df)

    sig = sorted((k for k in idx if p_adj[k] < opt.alpha), key=lambda k: -excess(k))
    chosen = (sig or sorted(idx, key=lambda k: (p_adj[k], p[k]))[:1])[: opt.max_peaks]
    out: list[Peak] = []
    for k in chosen:
        f = refine_frequency(r, float(k / nper), df)
        g = float(det.gain(np.array([f]))[0])
        amp = float(np.sqrt(2.0 * excess(k) / g)) if g > 0 else float("nan")
        out.append(Peak(k, f, float(power[k]), float(bg[k]), float(p[k]), float(p_adj[k]),
                        bool(p_adj[k] < opt.alpha), excess(k), amp))
    groups = group_harmonics([q.frequency for q in out], 0.5 * df)
    return [Peak(**{**q.__dict__, "harmonic_of": g[0], "harmonic_number": g[1]}) if q.significant else q
            for q, g in zip(out, groups)], len(sig)
