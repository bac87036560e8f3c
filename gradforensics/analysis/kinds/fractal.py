"""Fractal dimension of a detrended loss curve: Higuchi and box-counting.

How rough is the curve once its trend is gone?  ``D ≈ 1``: smooth (a heavily
smoothed or averaged log, or a slow deterministic wobble); ``D ≈ 1.5``: a random
walk (the loss wanders and its excursions persist); ``D ≈ 2``: independent
batch-to-batch noise (what a healthy per-batch loss mostly looks like).  Red
(AR(1)) noise sits between 1.5 and 2 depending on the scales fitted, which is why
the fit range is chosen automatically and reported.

The dimension is descriptive evidence for the report, not a verdict: there is no
calibrated healthy range (it depends on batch size, logging interval and
smoothing), so this analysis raises **no flags**.

References
----------
Higuchi, T. (1988). Approach to an irregular time series on the basis of the
    fractal theory. Physica D 31, 277–283 (eqs. 1–3).
Dubuc, B., Quiniou, J. F., Roques-Carmes, C., Tricot, C. & Zucker, S. W. (1989).
    Evaluating the fractal dimension of profiles. Phys. Rev. A 39, 1500–1512.
Gneiting, T., Ševčíková, H. & Percival, D. B. (2012). Estimators of fractal
    dimension: assessing the roughness of time series and spatial data.
    Statist. Sci. 27, 247–277.

The scaling maths (Higuchi, box counting, the fit ranges, their stacked forms) live in
:mod:`~gradforensics.analysis.toolkit.signal.scaling`; their public names are importable
from here as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag
from gradforensics.analysis.toolkit.series import series_compute
from gradforensics.analysis.toolkit.signal import (
    MIN_POINTS,
    DetrendCache,
    SpectrumOptions,
    default_nperseg,
    detrend,
    winsorize,
)
from gradforensics.analysis.toolkit.signal.scaling import (
    MIN_FIT_POINTS,
    MIN_FIT_SPAN,
    R2_STRAIGHT,
    ScalingFit,
    box_counting,
    box_counts,
    fit_range,
    fits_rows,
    higuchi,
    higuchi_lengths,
    line_fit,
    line_rows,
    log_scales,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.analysis.toolkit.series import Series, SeriesGroup

__all__ = ["ANALYSIS", "COLUMNS", "MIN_FIT_POINTS", "MIN_FIT_SPAN", "NAME", "R2_STRAIGHT", "ScalingFit",
           "analyze_series", "box_counting", "box_counts", "fit_range", "fractal_window", "higuchi", "higuchi_lengths",
           "plot", "plot_scaling"]


NAME = "fractal"
COLUMNS = ("tensor", "head", "series", "box_counting", "higuchi", "box_fit_from", "box_fit_to", "box_r2",
           "higuchi_fit_from", "higuchi_fit_to", "higuchi_r2", "n_points", "detrend", "note")
#: their names here before the scaling maths moved to toolkit.signal.scaling
_fits_rows, _line, _line_rows, _scales = fits_rows, line_fit, line_rows, log_scales


# ------------------------------------------------------------- series -> table
def analyze_series(groups: Sequence[SeriesGroup], options: SpectrumOptions | None = None,
                   cache: DetrendCache | None = None) -> AnalysisResult:
    """``fractal`` table (one row per series) of every group's all-ranks series,
    detrended as :func:`~gradforensics.analysis.toolkit.signal.detrend` does for
    the spectrum (and winsorised the same way); through *cache* the residuals
    ``loss_spectrum`` computed where the windows agree (the same values)."""
    import pandas as pd

    opt = options or SpectrumOptions()
    arrays: dict[str, np.ndarray] = {}
    known = _residuals([g.combined for g in groups], opt, cache)
    rows = [_row(g.combined, opt, arrays, cache, known.get(id(g.combined))) for g in groups]
    return AnalysisResult(pd.DataFrame(rows, columns=list(COLUMNS)), arrays)


def fractal_window(n: int, opt: SpectrumOptions) -> int:
    """Savitzky–Golay window for the fractal analysis: the spectrum's ``2·nperseg + 1``
    or N/2, whichever is wider.  The detrender flattens a random walk at scales
    above ~W/16 (Higuchi) and ~W/8 (box counting), so the fits stop there."""
    return int(max(2 * (opt.nperseg or default_nperseg(n)) + 1, n // 2) | 1)


def _residuals(series: list[Series], opt: SpectrumOptions, cache: DetrendCache | None
               ) -> dict[int, tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None]]:
    """Each analysable series' winsorised residual and its two fits (keyed by the series' identity), the series
    of one length and window detrended and fitted together (:meth:`DetrendCache.get_many`,
    :func:`~gradforensics.analysis.toolkit.signal.scaling.fits_rows`: the values :func:`_row` computes one series at a time)."""
    todo: dict[tuple[int, int], list[Series]] = {}
    for s in series:
        if s.n >= MIN_POINTS and np.ptp(s.y) > 0 and s.y.ndim == 1 and np.all(np.isfinite(s.y)):
            todo.setdefault((s.y.size, fractal_window(s.n, opt)), []).append(s)
    out: dict[int, tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None]] = {}
    for (_, w), same in todo.items():
        if len(same) < 2:
            continue
        got = (cache or DetrendCache(max_bytes=0)).get_many([s.y for s in same], "savgol", w, opt.clip_mad)
        rs = [r for _, r, _ in got]
        live = [u for u, (s, r) in enumerate(zip(same, rs)) if _rough(r, s)]
        fits = fits_rows(np.stack([rs[u] for u in live]), w) if len(live) >= 2 else None
        out.update((id(s), (r, None)) for s, r in zip(same, rs))
        out.update((id(same[u]), (rs[u], f)) for u, f in zip(live, fits or []))
    return out


def _rough(r: np.ndarray, s: Series) -> bool:
    """Anything left after detrending (else the curve is its trend)."""
    return bool(np.std(r) > 1e-9 * max(float(np.std(s.y)), 1e-300))


def _row(s: Series, opt: SpectrumOptions, arrays: dict[str, np.ndarray], cache: DetrendCache | None = None,
         known: tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"tensor": s.tensor, "head": None, "series": s.name, "n_points": s.n,
                           "detrend": "savgol", "note": ""}
    if s.n < MIN_POINTS or not np.ptp(s.y) > 0:
        return {**row, "note": f"too short or constant ({s.n} usable points, needs {MIN_POINTS})"}
    w = fractal_window(s.n, opt)
    r, fits = known if known is not None else (None, None)
    if r is None:
        r = (winsorize(detrend(s.y, "savgol", w).residual, opt.clip_mad)[0] if cache is None
             else cache.get(s.y, "savgol", w, opt.clip_mad)[1])
    if not _rough(r, s):
        return {**row, "note": "nothing left after detrending (the curve is its trend: smooth)"}
    h, b = fits or (higuchi(r, kmax=max(8, w // 16)), box_counting(r, max_width=max(32, w // 8)))
    for key, fit in (("higuchi", h), ("box", b)):
        arrays[f"{s.name}/{key}_scales"] = fit.scales
        arrays[f"{s.name}/{key}_values"] = fit.values
        arrays[f"{s.name}/{key}_fit"] = np.array([fit.lo, fit.hi, fit.dimension])
    return {**row, "box_counting": b.dimension, "higuchi": h.dimension, "box_fit_from": b.lo, "box_fit_to": b.hi,
            "box_r2": b.r2, "higuchi_fit_from": h.lo, "higuchi_fit_to": h.hi, "higuchi_r2": h.r2}


def plot_scaling(result: AnalysisResult, series: str, ax: Axes) -> None:
    """Higuchi curve length and box counts of *series* against scale (log-log), the
    fitted ranges drawn solid."""
    s = result.series
    if f"{series}/higuchi_scales" not in s:
        ax.text(0.5, 0.5, f"{series}: no fractal dimension", ha="center", transform=ax.transAxes)
        return
    for key, label, color in (("higuchi", "Higuchi <L(k)>, k", "C0"), ("box", "box count N, width (samples)", "C1")):
        k, v, fit = s[f"{series}/{key}_scales"], s[f"{series}/{key}_values"], s[f"{series}/{key}_fit"]
        inside = (k >= fit[0]) & (k <= fit[1])
        ax.loglog(k, v, color=color, ls=":", lw=1)
        ax.loglog(k[inside], v[inside], color=color, lw=2, label=f"{label}: D = {fit[2]:.2f}")
    ax.set_xlabel("scale (samples)")
    ax.set_title(f"{series} (detrended)", fontsize=9)
    ax.legend(fontsize=7)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Scaling plot of the flag's series (this analysis raises no flags itself)."""
    plot_scaling(result, str(flag.evidence.get("series", flag.tensor)), ax)


def _flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    return []


ANALYSIS = Analysis(name=NAME, needs=(), compute=series_compute(NAME, analyze_series, shares_detrending=True),
                    flags=_flags, plot=plot, options=SpectrumOptions,
                    series=analyze_series, long_history=True)
