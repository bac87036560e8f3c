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

The scaling maths (Higuchi's curve lengths, box counts, the fit ranges) work on a stack of
residuals of one length at once (:func:`higuchi_fits`, :func:`box_countings`); :func:`higuchi` and
:func:`box_counting` are one series.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag
from gradforensics.analysis.toolkit.series import series_compute
from gradforensics.analysis.toolkit.signal.detrending import DetrendCache, default_nperseg
from gradforensics.analysis.toolkit.signal.spectrum import MIN_POINTS, SpectrumOptions

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.analysis.toolkit.series import Series, SeriesGroup

__all__ = ["ANALYSIS", "COLUMNS", "MIN_FIT_POINTS", "MIN_FIT_SPAN", "NAME", "R2_STRAIGHT", "ScalingFit",
           "analyze_series", "box_counting", "box_countings", "box_counts", "fit_range", "fit_ranges",
           "fractal_window", "higuchi", "higuchi_fits", "higuchi_lengths", "log_scales", "plot", "plot_scaling"]


NAME = "fractal"
COLUMNS = ("tensor", "head", "series", "box_counting", "higuchi", "box_fit_from", "box_fit_to", "box_r2",
           "higuchi_fit_from", "higuchi_fit_to", "higuchi_r2", "n_points", "detrend", "note")
R2_STRAIGHT = 0.999
MIN_FIT_POINTS = 5
MIN_FIT_SPAN = 8.0


# ------------------------------------------------------------------ scaling maths
@dataclass(frozen=True)
class ScalingFit:
    """A straight-line fit of ``log values`` on ``log scales`` over ``[lo, hi]``.

    ``scales`` are in samples (Higuchi's k, the box column width); ``dimension``
    is ``−slope`` (curve length and box count both fall with scale).
    """

    dimension: float
    lo: float
    hi: float
    r2: float
    scales: np.ndarray
    values: np.ndarray


def log_scales(lo: int, hi: int, count: int = 24) -> np.ndarray:
    """About *count* integer scales from *lo* to *hi*, geometrically spaced (read-only: shared by every series)."""
    return _scales_of(int(lo), int(hi), int(count))


@lru_cache(maxsize=256)
def _scales_of(lo: int, hi: int, count: int) -> np.ndarray:
    out = np.unique(np.round(np.geomspace(lo, max(hi, lo), count)).astype(int))
    out.setflags(write=False)
    return out


def fit_ranges(scales: np.ndarray, values: np.ndarray, min_points: int = MIN_FIT_POINTS,
               min_span: float = MIN_FIT_SPAN, straight: float = R2_STRAIGHT
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Choose the scaling range of each row of *values* (``(U, K)``): ``(lo, hi, slope, r²)``, inclusive indices.

    The longest contiguous window (at least *min_points* scales spanning a factor
    *min_span*) whose log-log least-squares line has r² of at least *straight*; ties go to
    the smaller scales (a fractal dimension is a small-scale property).  When no window is
    that straight, the window of largest r² among the shortest admissible ones.
    """
    ls, LV = np.log(np.asarray(scales, dtype=float)), np.log(np.atleast_2d(np.asarray(values, dtype=float)))
    k = ls.size
    wins = [(i, j) for i in range(k) for j in range(i + min_points - 1, k) if not scales[j] / scales[i] < min_span]
    starts, ends = np.array([i for i, _ in wins or [(0, k - 1)]]), np.array([j for _, j in wins or [(0, k - 1)]])
    slope, r2 = np.empty((LV.shape[0], starts.size)), np.empty((LV.shape[0], starts.size))
    for length in np.unique(ends - starts):           # the windows of one length, as one stack
        sel = np.flatnonzero(ends - starts == length)
        idx = starts[sel, None] + np.arange(length + 1)
        xc, Y = ls[idx] - ls[idx].mean(axis=-1, keepdims=True), LV[:, idx]
        yc = Y - Y.mean(axis=-1, keepdims=True)
        b = (xc * yc).sum(axis=-1) / (xc * xc).sum(axis=-1)
        ss, res = (yc * yc).sum(axis=-1), ((yc - b[..., None] * xc) ** 2).sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            slope[:, sel], r2[:, sel] = b, np.where(ss > 0, 1.0 - res / np.where(ss > 0, ss, 1.0), 1.0)
    good = r2 >= straight
    pick_good = np.argmax(np.where(good, (ends - starts) * (k + 1) + (k - starts), -1), axis=1)
    short = np.flatnonzero(ends - starts == (ends - starts).min())
    pick = np.where(good.any(axis=1), pick_good, short[np.argmax(r2[:, short], axis=1)])
    rows = np.arange(LV.shape[0])
    return starts[pick], ends[pick], slope[rows, pick], r2[rows, pick]


def fit_range(scales: np.ndarray, values: np.ndarray, **kw: Any) -> tuple[int, int, float, float]:
    """:func:`fit_ranges` of one row: ``(lo, hi, slope, r²)``."""
    lo, hi, slope, r2 = fit_ranges(scales, np.asarray(values)[None, :], **kw)
    return int(lo[0]), int(hi[0]), float(slope[0]), float(r2[0])


def _fits(scales: np.ndarray, values: np.ndarray) -> list[ScalingFit]:
    """The :class:`ScalingFit` of each row of *values* (``(U, K)``) on *scales*."""
    lo, hi, slope, r2 = fit_ranges(scales, values)
    sc = np.asarray(scales, dtype=float)
    return [ScalingFit(-float(slope[u]), float(sc[lo[u]]), float(sc[hi[u]]), float(r2[u]), sc.copy(), values[u].copy())
            for u in range(values.shape[0])]


def higuchi_lengths(X: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Higuchi's mean curve length ``<L(k)>`` of each series of *X* (``(..., N)``) for each k (Higuchi 1988, eqs. 1–2).

    ``L_m(k) = [Σ_i |x(m+ik) − x(m+(i−1)k)|] (N−1) / (⌊(N−m)/k⌋ k) / k``,
    averaged over the offsets ``m = 0..k−1``.
    """
    X = np.asarray(X, dtype=float)
    n = X.shape[-1]
    out = np.empty((*X.shape[:-1], ks.size))
    for a, k in enumerate(int(k) for k in ks):
        steps = np.abs(X[..., k:] - X[..., :-k])      # |x(j+k) − x(j)|: offset m's terms are steps[..., m::k]
        rows = -(-steps.shape[-1] // k)
        padded = np.zeros((*X.shape[:-1], rows * k))
        padded[..., :steps.shape[-1]] = steps
        sums = padded.reshape(*X.shape[:-1], rows, k).sum(axis=-2)
        count = np.bincount(np.arange(steps.shape[-1]) % k, minlength=k)
        live = count >= 1
        out[..., a] = (sums[..., live] * (n - 1) / (count[live] * k) / k).mean(axis=-1)
    return out


def higuchi_fits(X: np.ndarray, kmax: int | None = None) -> list[ScalingFit]:
    """Higuchi fractal dimension of each row of *X* (``(U, N)``): ``D = −slope`` of ``log <L(k)>`` on ``log k``
    (eq. 3), k from 1 to *kmax* (default ``N/10``, at most 1000), the fit range from :func:`fit_ranges`;
    scales of zero curve length are left out of a row's fit."""
    X = np.atleast_2d(np.asarray(X, dtype=float))
    ks = log_scales(1, kmax or int(min(max(X.shape[1] // 10, 16), 1000)))
    lengths = higuchi_lengths(X, ks)
    ok = lengths > 0
    out: list[ScalingFit | None] = [None] * X.shape[0]
    whole = np.flatnonzero(ok.all(axis=1))
    for u, fit in zip(whole, _fits(ks, lengths[whole])):
        out[u] = fit
    for u in np.flatnonzero(~ok.all(axis=1)):
        out[u] = _fits(ks[ok[u]], lengths[u, ok[u]][None, :])[0]
    return [f for f in out if f is not None]


def higuchi(x: np.ndarray, kmax: int | None = None) -> ScalingFit:
    """:func:`higuchi_fits` of one series."""
    return higuchi_fits(np.asarray(x, dtype=float)[None, :], kmax)[0]


def box_counts(Y: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Boxes of side ε = s/(N−1) that the graph of each series of *Y* (``(..., N)``, rescaled to the unit square,
    consecutive samples joined) meets, for column widths s (in samples).

    Per column ``[js, (j+1)s]`` (endpoints shared, so the graph is connected) the
    count is ``⌊max/ε⌋ − ⌊min/ε⌋ + 1`` (the variation method of Dubuc et al. 1989).
    """
    Y = np.asarray(Y, dtype=float)
    Y2 = Y.reshape(-1, Y.shape[-1])
    n = Y2.shape[1]
    lo_y, span = Y2.min(axis=1, keepdims=True), np.ptp(Y2, axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        U = np.where(span > 0, (Y2 - lo_y) / np.where(span > 0, span, 1.0), 0.0)
    out = np.empty((Y2.shape[0], sizes.size))
    for a, s in enumerate(int(s) for s in sizes):
        eps = s / (n - 1)
        starts = np.arange(0, n - 1, s)
        ends = np.minimum(starts + s, n - 1)
        hi = np.maximum(np.maximum.reduceat(U[:, :-1], starts, axis=1), U[:, ends])
        lo = np.minimum(np.minimum.reduceat(U[:, :-1], starts, axis=1), U[:, ends])
        top = np.ceil(1.0 / eps - 1e-9) - 1          # the row of cells holding u = 1 (closed top edge)
        out[:, a] = (np.minimum(np.floor(hi / eps), top) - np.floor(lo / eps) + 1).sum(axis=1)
    return out.reshape(*Y.shape[:-1], sizes.size)


def box_countings(Y: np.ndarray, min_width: int = 4, max_width: int | None = None) -> list[ScalingFit]:
    """Box-counting dimension of the graph of each row of *Y* (``(U, N)``), ``D = −slope`` of ``log N(ε)`` on
    ``log ε``.

    Column widths run from *min_width* samples to *max_width* (default N/4;
    narrower columns measure
    the sampling more than the curve: a discrete walk's range over s steps is
    ``≈ 1.6√s − 1.2`` σ, Feller 1951), the fit range from :func:`fit_ranges`.

    Notes
    -----
    Box counting of a sampled graph is biased low at finite N (the range of s
    independent values grows like √(2 ln s)); measured at N = 4000: 1.38 ± 0.02
    for a Brownian walk and 1.78 ± 0.01 for white noise.  Prefer :func:`higuchi`
    (1.50 ± 0.02 and 2.000 ± 0.001 on the same series); Gneiting et al. (2012)
    reach the same ranking.
    """
    Y = np.atleast_2d(np.asarray(Y, dtype=float))
    n = Y.shape[1]
    sizes = log_scales(min(min_width, max(n // 8, 1)), max(min(max_width or n // 4, n // 4), 2))
    return _fits(sizes, box_counts(Y, sizes))   # the slope on ε = s/(N−1) is the slope on s


def box_counting(y: np.ndarray, min_width: int = 4, max_width: int | None = None) -> ScalingFit:
    """:func:`box_countings` of one series."""
    return box_countings(np.asarray(y, dtype=float)[None, :], min_width, max_width)[0]


# ------------------------------------------------------------- series -> table
def analyze_series(groups: Sequence[SeriesGroup], options: SpectrumOptions | None = None,
                   cache: DetrendCache | None = None) -> AnalysisResult:
    """``fractal`` table (one row per series) of every group's all-ranks series,
    detrended as :func:`~gradforensics.analysis.toolkit.signal.detrending.detrend` does for
    the spectrum (and winsorised the same way); through *cache* the residuals
    ``loss_spectrum`` computed where the windows agree (the same values)."""
    import pandas as pd

    opt = options or SpectrumOptions()
    arrays: dict[str, np.ndarray] = {}
    known = _residuals([g.combined for g in groups], opt, cache)
    rows = [_row(g.combined, arrays, known.get(id(g.combined))) for g in groups]
    return AnalysisResult(pd.DataFrame(rows, columns=list(COLUMNS)), arrays)


def fractal_window(n: int, opt: SpectrumOptions) -> int:
    """Savitzky–Golay window for the fractal analysis: the spectrum's ``2·nperseg + 1``
    or N/2, whichever is wider.  The detrender flattens a random walk at scales
    above ~W/16 (Higuchi) and ~W/8 (box counting), so the fits stop there."""
    return int(max(2 * (opt.nperseg or default_nperseg(n)) + 1, n // 2) | 1)


def _residuals(series: list[Series], opt: SpectrumOptions, cache: DetrendCache | None
               ) -> dict[int, tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None]]:
    """Each analysable series' winsorised residual and its two fits (None where nothing is left after
    detrending), keyed by the series' identity; the series of one length and window as one stack."""
    todo: dict[tuple[int, int], list[Series]] = {}
    for s in series:
        if s.n >= MIN_POINTS and np.ptp(s.y) > 0 and s.y.ndim == 1 and np.all(np.isfinite(s.y)):
            todo.setdefault((s.y.size, fractal_window(s.n, opt)), []).append(s)
    out: dict[int, tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None]] = {}
    for (_, w), same in todo.items():
        got = (cache or DetrendCache(max_bytes=0)).get_many([s.y for s in same], "savgol", w, opt.clip_mad)
        rs = [r for _, r, _ in got]
        live = [u for u, (s, r) in enumerate(zip(same, rs)) if _rough(r, s)]
        out.update((id(s), (r, None)) for s, r in zip(same, rs))
        if live:
            R = np.stack([rs[u] for u in live])
            fits = zip(higuchi_fits(R, kmax=max(8, w // 16)), box_countings(R, max_width=max(32, w // 8)))
            out.update((id(same[u]), (rs[u], f)) for u, f in zip(live, fits))
    return out


def _rough(r: np.ndarray, s: Series) -> bool:
    """Anything left after detrending (else the curve is its trend)."""
    return bool(np.std(r) > 1e-9 * max(float(np.std(s.y)), 1e-300))


def _row(s: Series, arrays: dict[str, np.ndarray],
         known: tuple[np.ndarray, tuple[ScalingFit, ScalingFit] | None] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"tensor": s.tensor, "head": None, "series": s.name, "n_points": s.n,
                           "detrend": "savgol", "note": ""}
    if known is None:
        return {**row, "note": f"too short or constant ({s.n} usable points, needs {MIN_POINTS})"}
    if known[1] is None:
        return {**row, "note": "nothing left after detrending (the curve is its trend: smooth)"}
    h, b = known[1]
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
