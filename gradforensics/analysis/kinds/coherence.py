"""Cross-rank coherence of a per-step series: magnitude-squared coherence and phase.

With data parallelism every rank logs its own loss.  An oscillation the ranks
share (coherence ≈ 1 at its frequency, phase ≈ 0) comes from the model or the
optimizer they share; one confined to a rank (coherence ≈ 0) comes from that
rank's data or hardware.  For each pair of ranks this analysis detrends both
series the way the spectrum does (:mod:`gradforensics.analysis.toolkit.signal`), estimates the
magnitude-squared coherence ``C(f) = |S_ab|² / (S_aa S_bb)`` with Welch averages
(:func:`~gradforensics.analysis.toolkit.signal.welch.coherence`, SciPy's conventions), tests it
against independence and reports the
phase of the cross-spectrum at coherent peaks and the lag it implies (``lag =
−phase / 2πf``, in the axis unit, positive when rank b lags rank a, modulo a
period); a peak's frequency is
refined on the periodogram of the two standardised residuals' sum (where a
shared component adds up), as the spectrum refines its peaks.

Under independence, with K independent Welch segments,
``P(C > c) = (1 − c)^{K−1}`` (Carter, Knapp & Nuttall 1973, eq. 14).  The
segments overlap by half; crediting the overlap (K = ν/2 of Percival & Walden
1993, eq. 292b) made the tail too light (2.7 % of 300 independent pairs had a
"significant" bin at 1 %), so K counts non-overlapping segments only,
``K = N / nperseg``: measured, 0 of 300 pairs and 0.4 % of bins at p < 0.05 -
conservative.  p-values are corrected over the tested frequencies like the
spectrum's.  Coherence is context, not a verdict: healthy ranks share the slow
drift of the weights, so this analysis raises **no flags**.

References
----------
Carter, G. C., Knapp, C. H. & Nuttall, A. H. (1973). Estimation of the
    magnitude-squared coherence function via overlapped fast Fourier transform
    processing. IEEE Trans. Audio Electroacoust. 21, 337–344.
Percival, D. B. & Walden, A. T. (1993). Spectral Analysis for Physical
    Applications. Cambridge University Press.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag
from gradforensics.analysis.toolkit.series import series_compute
from gradforensics.analysis.toolkit.signal.detrending import default_nperseg, detrend_many
from gradforensics.analysis.toolkit.signal.peaks import adjust_pvalues, local_maxima, refine_frequency
from gradforensics.analysis.toolkit.signal.spectrum import MIN_POINTS, SpectrumOptions
from gradforensics.analysis.toolkit.signal.trend import winsorize
from gradforensics.analysis.toolkit.signal.welch import coherence

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.analysis.toolkit.series import Series, SeriesGroup

__all__ = ["ANALYSIS", "COLUMNS", "MAX_ALL_PAIRS", "NAME", "PairCoherence", "align", "analyze_series", "msc_pvalue",
           "msc_threshold", "pair_coherence", "pair_key", "plot", "plot_coherence", "rank_pairs"]


NAME = "coherence"
COLUMNS = ("tensor", "head", "series", "rank_a", "rank_b", "period_steps", "msc", "p_value", "p_adjusted",
           "significant", "threshold", "frequency", "period", "period_unit", "phase_deg", "lag", "mean_msc",
           "n_segments", "n_points", "note")
MAX_ALL_PAIRS = 8


def msc_pvalue(c: np.ndarray, k: float) -> np.ndarray:
    """``P(C ≥ c)`` under independence with *k* independent segments: ``(1 − c)^{k−1}``."""
    return np.clip(1.0 - np.asarray(c, dtype=float), 0.0, 1.0) ** (k - 1.0)


def msc_threshold(level: float, k: float) -> float:
    """The MSC exceeded with probability *level* under independence: ``1 − level^{1/(k−1)}``."""
    return float(1.0 - level ** (1.0 / (k - 1.0)))


@dataclass
class PairCoherence:
    """Coherence of two aligned series (frequencies in cycles per sample)."""

    freq: np.ndarray
    msc: np.ndarray
    phase: np.ndarray          # radians, angle of S_ab = conj(A)·B (SciPy's csd): −2πf·lag when b lags a
    peak_freq: list[float]     # frequency of each peak refined on the periodogram of a + b
    p_value: np.ndarray
    p_adjusted: np.ndarray
    tested: np.ndarray
    k_eff: float
    threshold: float           # MSC needed at the corrected level (Bonferroni bound)
    peaks: list[int]           # bins of coherent peaks, strongest first (or the best candidate)
    n_points: int


def pair_coherence(a: np.ndarray, b: np.ndarray, options: SpectrumOptions | None = None) -> PairCoherence:
    """Magnitude-squared coherence of two uniformly sampled series on the same grid.

    Both are detrended and winsorised as for the spectrum; the band tested is the
    detrender's pass band (gain ≥ 0.5) above f = 0.
    """
    opt = options or SpectrumOptions()
    n = min(a.size, b.size)
    nper = min(opt.nperseg or default_nperseg(n), n)
    dets = detrend_many([a[:n], b[:n]], "savgol", 2 * nper + 1)
    res = [winsorize(d.residual, opt.clip_mad)[0] for d in dets]
    f, c, sab = coherence(res[0], res[1], nper)
    det = dets[1]
    k_eff = max(n / nper, 2.0)
    tested = (f > 0) & (det.gain(f) >= 0.5)
    p = np.ones(f.size)
    p[tested] = msc_pvalue(c[tested], k_eff)
    p_adj = np.ones(f.size)
    p_adj[tested] = adjust_pvalues(p[tested], opt.correction)
    m = max(int(tested.sum()), 1)
    maxima = local_maxima(np.concatenate([[-1.0], np.where(tested, c, -1.0), [-1.0]]))
    idx = sorted((int(i) - 1 for i in maxima if tested[int(i) - 1]), key=lambda k: -c[k])
    sig = [k for k in idx if p_adj[k] < opt.alpha]
    peaks = (sig or idx[:1])[: opt.max_peaks]
    both = res[0] / np.std(res[0]) + res[1] / np.std(res[1])
    refined = [refine_frequency(both, float(f[k]), 1.0 / nper) for k in peaks]
    return PairCoherence(f, c, np.angle(sab), refined, p, p_adj, tested, k_eff,
                         msc_threshold(opt.alpha / m, k_eff), peaks, n)


def align(a: Series, b: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both series on their common range, at the coarser of the two spacings."""
    x0, x1 = max(a.x[0], b.x[0]), min(a.x[-1], b.x[-1])
    dt = max(a.dt, b.dt)
    if not x1 > x0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    grid = x0 + dt * np.arange(int(np.floor((x1 - x0) / dt + 1e-9)) + 1)
    return grid, np.interp(grid, a.x, a.y), np.interp(grid, b.x, b.y)


def rank_pairs(n: int) -> list[tuple[int, int]]:
    """Every pair up to :data:`MAX_ALL_PAIRS` ranks; beyond, each rank against the first."""
    return list(combinations(range(n), 2)) if n <= MAX_ALL_PAIRS else [(0, j) for j in range(1, n)]


# ------------------------------------------------------------- series -> table
def analyze_series(groups: Sequence[SeriesGroup], options: SpectrumOptions | None = None) -> AnalysisResult:
    """``coherence`` table: for every group with several ranks, a row per coherent
    peak of each rank pair (or the strongest candidate, ``significant`` False)."""
    import pandas as pd

    opt = options or SpectrumOptions()
    rows: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for g in groups:
        for i, j in rank_pairs(len(g.ranks)):
            rows += _pair_rows(g.ranks[i], g.ranks[j], opt, arrays)
    return AnalysisResult(pd.DataFrame(rows, columns=list(COLUMNS)), arrays)


def pair_key(series: str, a: str | None, b: str | None) -> str:
    """Figure-series prefix of a pair: ``<series>/<rank_a>~<rank_b>``."""
    return f"{series}/{str(a).replace('/', '_')}~{str(b).replace('/', '_')}"


def _pair_rows(a: Series, b: Series, opt: SpectrumOptions, arrays: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    grid, ya, yb = align(a, b)
    base = {"tensor": a.tensor, "head": None, "series": a.name, "rank_a": a.rank, "rank_b": b.rank,
            "period_unit": a.unit, "n_points": grid.size, "note": ""}
    if grid.size < MIN_POINTS or not (np.ptp(ya) > 0 and np.ptp(yb) > 0):
        return [{**base, "note": f"overlap too short or constant ({grid.size} points, needs {MIN_POINTS})"}]
    dt = float(grid[1] - grid[0])
    pc = pair_coherence(ya, yb, opt)
    key = pair_key(a.name, a.rank, b.rank)
    arrays[f"{key}/freq"] = pc.freq / dt
    arrays[f"{key}/msc"] = pc.msc
    arrays[f"{key}/phase"] = pc.phase
    arrays[f"{key}/threshold"] = np.array([pc.threshold])
    common = {**base, "threshold": pc.threshold, "n_segments": pc.k_eff,
              "mean_msc": float(pc.msc[pc.tested].mean()) if pc.tested.any() else np.nan}
    rows = []
    for k, fk in zip(pc.peaks, pc.peak_freq):
        f = fk / dt
        rows.append({**common, "frequency": f, "period": 1.0 / f, "period_steps": a.steps_per_unit / f,
                     "msc": pc.msc[k], "p_value": pc.p_value[k], "p_adjusted": pc.p_adjusted[k],
                     "significant": bool(pc.p_adjusted[k] < opt.alpha), "phase_deg": float(np.degrees(pc.phase[k])),
                     "lag": float(-pc.phase[k] / (2 * np.pi * pc.freq[k] / dt))})
    return rows or [{**common, "note": "no local maximum in the tested band"}]


# ------------------------------------------------------------------------- plots
def plot_coherence(result: AnalysisResult, series: str, ax: Axes) -> None:
    """MSC of every rank pair of *series* with the corrected significance line."""
    keys = sorted(k[: -len("/msc")] for k in result.series if k.startswith(series + "/") and k.endswith("/msc"))
    if not keys:
        ax.text(0.5, 0.5, f"{series}: no rank pairs", ha="center", transform=ax.transAxes)
        return
    for i, key in enumerate(keys[:8]):
        f, c = result.series[f"{key}/freq"], result.series[f"{key}/msc"]
        ax.semilogx(f[1:], c[1:], lw=0.8, color=f"C{i % 10}", label=key[len(series) + 1:])
    ax.axhline(float(result.series[f"{keys[0]}/threshold"][0]), color="C3", ls="-.", lw=0.8,
               label="corrected significance")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("frequency")
    ax.set_ylabel("magnitude-squared coherence")
    ax.set_title(f"{series}: coherence between ranks", fontsize=9)
    ax.legend(fontsize=7)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Coherence of the flag's series across ranks (this analysis raises no flags itself)."""
    plot_coherence(result, str(flag.evidence.get("series", flag.tensor)), ax)


def _series(groups: Sequence[SeriesGroup], opt: SpectrumOptions) -> AnalysisResult | None:
    """:func:`analyze_series`, or None (no table) when no series has several ranks."""
    return analyze_series(groups, opt) if any(g.ranks for g in groups) else None


def _flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    return []


ANALYSIS = Analysis(name=NAME, needs=(), compute=series_compute(NAME, analyze_series), flags=_flags, plot=plot, options=SpectrumOptions,
                    series=_series, long_history=True)
