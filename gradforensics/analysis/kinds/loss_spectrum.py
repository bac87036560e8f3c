"""Loss-curve spectrum: a detrended Welch periodogram tested against AR(1) red noise.

A training loss decays, and the noise around that decay is *red*: batch-to-batch
losses are correlated through the slowly moving weights.  A peak in the raw
periodogram of a loss curve therefore means little.  This analysis detrends
each series with a filter of known power gain, estimates its Welch spectrum,
fits an AR(1) background to the residual through that gain, tests every
frequency with the χ² confidence of Torrence & Compo (1998, eq. 18), corrects
for testing many frequencies (Benjamini–Hochberg by default) and reports the
peaks that survive, with harmonics grouped under their fundamental; each step is
described in :mod:`gradforensics.analysis.toolkit.signal.spectrum`.

The maths are pure functions over stacks of 1-D arrays in :mod:`gradforensics.analysis.toolkit.signal`
(:func:`~gradforensics.analysis.toolkit.signal.spectrum.line_spectra`); this module turns their
result into the ``loss_spectrum`` table (its peaks in the series' units), flags
(a family correction over the gradient norms, a severity) and figures.  The
:data:`ANALYSIS` entry runs them on a store's series (``batches/loss`` and the
per-tensor gradient norms) and, through its ``series`` hook, on the series of
``gradforensics loss``.

References
----------
Torrence, C. & Compo, G. P. (1998). A practical guide to wavelet analysis.
    Bull. Amer. Meteor. Soc. 79, 61–78 (eqs. 16–18).
Welch, P. D. (1967). The use of fast Fourier transform for the estimation of power
    spectra. IEEE Trans. Audio Electroacoust. 15, 70–73.
Percival, D. B. & Walden, A. T. (1993). Spectral Analysis for Physical
    Applications. Cambridge University Press (eq. 292b).
Savitzky, A. & Golay, M. J. E. (1964). Anal. Chem. 36, 1627–1639; Schafer, R. W.
    (2011). What is a Savitzky–Golay filter? IEEE Signal Process. Mag. 28, 111–117.
Benjamini, Y. & Hochberg, Y. (1995). Controlling the false discovery rate.
    J. R. Stat. Soc. B 57, 289–300.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice, Finding
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit.batches import full_batch
from gradforensics.analysis.toolkit.series import series_compute
from gradforensics.analysis.toolkit.signal.detrending import DetrendCache
from gradforensics.analysis.toolkit.signal.spectrum import MIN_POINTS, LineSpectrum, SpectrumOptions, line_spectra

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from gradforensics.analysis.toolkit.series import Series, SeriesGroup

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "FREQ_UNITS", "NAME", "SpectrumAdvice", "analyze_series", "compute", "family",
           "flags_from_table",
           "plot", "plot_detrended", "plot_spectrum", "severity"]


NAME = "loss_spectrum"


# ------------------------------------------------------------- series -> table
COLUMNS = ("tensor", "head", "series", "period_steps", "power", "p_value", "p_adjusted", "significant",
           "frequency", "frequency_unit", "period", "period_unit", "harmonic_of", "harmonic_number",
           "power_ratio", "amplitude", "excess_share", "ar1", "dof", "nperseg", "detrend", "level_shifts",
           "n_points", "n_filled", "n_duplicates", "n_nonfinite", "n_clipped", "record_first", "record_last",
           "note")
FREQ_UNITS = {"step": "1/step", "s": "Hz", "record": "1/record"}


def analyze_series(groups: Sequence[SeriesGroup], options: SpectrumOptions | None = None,
                   cache: DetrendCache | None = None) -> AnalysisResult:
    """The ``loss_spectrum`` table and figure series of every group's all-ranks series.

    One row per reported peak (significant ones; else the strongest candidate,
    ``significant`` False; else one row with a ``note``).  *cache* shares each
    series' detrended residual with ``fractal`` (the same values, read-only).
    """
    import pandas as pd

    opt = options or SpectrumOptions()
    rows: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    todo = [g.combined for g in groups if g.combined.n >= MIN_POINTS and np.ptp(g.combined.y) > 0]
    spectra = dict(zip(map(id, todo), line_spectra([s.y for s in todo], opt, cache)))   # same-length series stacked
    for g in groups:
        rows += _series_rows(g.combined, opt, arrays, spectra.get(id(g.combined)))
    return AnalysisResult(pd.DataFrame(rows, columns=list(COLUMNS)), arrays)


def _base_row(s: Series) -> dict[str, Any]:
    q = s.quality
    return {"tensor": s.tensor, "head": None, "series": s.name, "period_unit": s.unit,
            "frequency_unit": FREQ_UNITS.get(s.unit, f"1/{s.unit}"), "n_points": s.n, "n_filled": q.n_filled,
            "n_duplicates": q.n_duplicates, "n_nonfinite": q.n_nonfinite, "record_first": s.records[0],
            "record_last": s.records[1], "note": "; ".join(q.notes())}


def _series_rows(s: Series, opt: SpectrumOptions, arrays: dict[str, np.ndarray], res: LineSpectrum | None
                 ) -> list[dict[str, Any]]:
    base = _base_row(s)
    if s.n < MIN_POINTS:
        return [{**base, "note": _join(f"too short: {s.n} usable points, needs {MIN_POINTS}", base["note"])}]
    if res is None:
        return [{**base, "note": _join("constant series", base["note"])}]
    _store_arrays(s, res, arrays)
    var = float(np.var(res.detrended.residual)) or 1.0
    more = res.n_significant - len(res.significant)
    common = {**base, "ar1": res.ar1, "dof": res.dof, "nperseg": res.nperseg, "detrend": opt.detrend,
              "level_shifts": len(res.detrended.shifts), "n_clipped": res.n_clipped,
              "note": _join(base["note"], f"{more} more significant peaks not listed" if more > 0 else "")}
    if not res.peaks:
        return [{**common, "note": _join("no local maximum in the tested band", base["note"])}]
    rows = []
    for pk in res.peaks:
        f = pk.frequency / s.dt
        fund = res.peaks[pk.harmonic_of] if pk.harmonic_of is not None else None
        rows.append({**common, "frequency": f, "period": 1.0 / f, "period_steps": s.steps_per_unit / f,
                     "power": pk.power * s.dt, "p_value": pk.p_value, "p_adjusted": pk.p_adjusted,
                     "significant": pk.significant, "power_ratio": pk.ratio, "amplitude": pk.amplitude,
                     "excess_share": pk.excess / var, "harmonic_number": pk.harmonic_number,
                     "harmonic_of": s.dt / fund.frequency if fund is not None else np.nan})
    return rows


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _store_arrays(s: Series, res: LineSpectrum, arrays: dict[str, np.ndarray]) -> None:
    """Figure series, keyed ``<series>/<what>`` (frequencies in cycles per unit)."""
    det = res.detrended
    k = s.name
    arrays[f"{k}/freq"] = res.freq / s.dt
    for what in ("power", "background", "threshold", "threshold_nominal"):
        arrays[f"{k}/{what}"] = getattr(res, what) * s.dt
    arrays[f"{k}/tested"] = res.tested.astype(np.uint8)
    if res.significant:  # no empty arrays: an HDF5 store cannot hold a zero-length analysis array
        arrays[f"{k}/peaks"] = np.array([p.frequency / s.dt for p in res.significant], dtype=float)
    arrays[f"{k}/x"] = s.x[det.offset:]
    arrays[f"{k}/residual"] = det.residual
    arrays[f"{k}/trend"] = det.trend
    arrays[f"{k}/y"] = s.y[det.offset:]


# ------------------------------------------------------------------------ flags
def severity(p_adjusted: float, alpha: float, excess_share: float) -> float:
    """Severity of a significant peak: ``0.3 + 0.7 · s · e``.

    ``s = clip(log10(alpha / p_adj) / 4, 0, 1)`` is the significance margin (0 at
    the threshold, 1 ten thousand times beyond it) and ``e = clip(excess_share /
    0.05, 0, 1)`` the effect size (1 once the peak carries 5 % of the detrended
    variance): a peak must be both clearly real and not negligible to pass 0.5.
    What red noise produces by chance (p_adj within a decade of alpha) stays
    near 0.3; measured maximum over 3200 trend + AR(1) series: 0.40.
    """
    s = float(np.clip(np.log10(alpha / max(p_adjusted, 1e-300)) / 4.0, 0.0, 1.0))
    e = float(np.clip(excess_share / 0.05, 0.0, 1.0))
    return 0.3 + 0.7 * s * e


def family(series_name: str) -> str:
    """Series tested together: the per-tensor gradient norms are one family."""
    return "grad_norm" if series_name.startswith("grad_norm/") else "series"


def flags_from_table(table: pd.DataFrame, options: SpectrumOptions | None = None) -> list[Flag]:
    """One ``loss_spectrum`` flag per significant fundamental.

    A flag also needs ``p_adjusted · n_family < alpha``: Bonferroni over the series
    of its family (every gradient norm is tested, so without it a healthy model
    with hundreds of tensors would raise a few flags by chance).
    """
    opt = options or SpectrumOptions()
    if table.empty:
        return []
    analysed = table[table["ar1"].notna()] if "ar1" in table else table.iloc[:0]
    sizes = analysed.groupby(analysed["series"].map(family))["series"].nunique().to_dict()
    significant = table[table["significant"].astype("boolean").fillna(False).astype(bool)]
    loss_tested = bool((analysed["series"] == LOSS).any())
    loss_steps = [float(p) for p in significant.loc[significant["series"] == LOSS, "period_steps"]]
    out = []
    for _, row in significant.iterrows():
        n_fam = int(sizes.get(family(row["series"]), 1))
        if row["harmonic_number"] != 1 or row["p_adjusted"] * n_fam >= opt.alpha:
            continue
        harm = table[(table["series"] == row["series"]) & np.isclose(table["harmonic_of"], row["period"])]
        sev = severity(row["p_adjusted"] * n_fam, opt.alpha, row["excess_share"])
        alone = family(row["series"]) == "grad_norm" and loss_tested and not shares_period(
            float(row["period_steps"]), loss_steps)
        out.append(_flag(row, [float(p) for p in harm["period"]], min(sev, CONTEXT) if alone else sev, n_fam,
                         alone=alone))
    return out


LOSS = "batches/loss"
CONTEXT = 0.45       # a tensor's ringing the loss does not share: reported, below "act"


def shares_period(period_steps: float, loss_periods: list[float], rel: float = 0.1) -> bool:
    """True when the loss has a significant line within *rel* of *period_steps* (one period, not a harmonic).

    A gradient norm ringing at a period the loss does not show is that tensor's optimizer dynamics (heavy-ball
    momentum rings at a period set by lr x curvature, a healthy run's stiff directions included): context.
    """
    return any(abs(period_steps / p - 1.0) <= rel for p in loss_periods if np.isfinite(p) and p > 0)


def _flag(row: Any, harmonics: list[float], sev: float, n_fam: int, alone: bool = False) -> Flag:
    unit = {"step": "steps", "s": "s", "record": "records"}.get(row["period_unit"], row["period_unit"])
    what = "the gradient norm of " + row["tensor"] if family(row["series"]) == "grad_norm" else row["series"]
    harm = f", with harmonics at {', '.join(f'{h:.4g}' for h in harmonics)} {unit}" if harmonics else ""
    summary = (f"{what} oscillates with a period of {row['period']:.4g} {unit} (amplitude {row['amplitude']:.3g}, "
               f"{row['excess_share']:.0%} of the detrended variance; p = {row['p_adjusted']:.2g} against AR(1) "
               f"red noise){harm}.")
    if alone:
        summary += (" Context: the loss shows no line at this period, so it is this tensor's own dynamics "
                    "(momentum and Adam ring at a period set by the learning rate and the curvature), not a "
                    "periodic loss.")
    evidence = {"series": row["series"], "period": row["period"], "period_unit": row["period_unit"],
                "period_steps": row["period_steps"], "power": row["power"], "frequency": row["frequency"],
                "p_value": row["p_value"],
                "p_adjusted": row["p_adjusted"], "family_size": n_fam, "power_ratio": row["power_ratio"],
                "amplitude": row["amplitude"], "excess_share": row["excess_share"], "ar1": row["ar1"],
                "harmonics": harmonics, "loss_shares_period": not alone}
    return Flag(kind="loss_spectrum", tensor=row["tensor"], head=None, sources=(), severity=float(min(sev, 1.0)),
                records=(int(row["record_first"]), int(row["record_last"])), evidence=evidence, summary=summary)


# ------------------------------------------------------------------------- plots
def _unit(result: AnalysisResult, series: str) -> str:
    t = result.table
    rows = t[t["series"] == series] if "series" in t else t.iloc[:0]
    return str(rows["period_unit"].iloc[0]) if len(rows) and isinstance(rows["period_unit"].iloc[0], str) else "step"


def plot_spectrum(result: AnalysisResult, series: str, ax: Axes) -> None:
    """Welch spectrum of *series* with its AR(1) background, the χ² confidence
    lines (per-bin and multiple-testing corrected) and the significant peaks;
    the band outside the test (removed by the detrending) is greyed."""
    from matplotlib.ticker import NullFormatter

    s = result.series
    if f"{series}/freq" not in s:
        ax.text(0.5, 0.5, f"{series}: no spectrum (too short or constant)", ha="center", transform=ax.transAxes)
        return
    f, keep = s[f"{series}/freq"], s[f"{series}/freq"] > 0
    ax.loglog(f[keep], s[f"{series}/power"][keep], color="C0", lw=1, label="Welch spectrum")
    ax.loglog(f[keep], s[f"{series}/background"][keep], color="k", lw=1, ls="--", label="AR(1) background")
    ax.loglog(f[keep], s[f"{series}/threshold_nominal"][keep], color="0.6", lw=0.8, ls=":", label="per-bin χ² line")
    ax.loglog(f[keep], s[f"{series}/threshold"][keep], color="C3", lw=0.8, ls="-.", label="corrected χ² line")
    tested = s[f"{series}/tested"].astype(bool)
    if tested.any() and not tested[keep].all():
        ax.axvspan(f[keep][0], f[tested][0], color="0.9", zorder=0, label="removed by detrending")
    for fp in s.get(f"{series}/peaks", np.zeros(0)):
        ax.axvline(fp, color="C3", alpha=0.4, lw=1)
        ax.annotate(f"{1 / fp:.4g}", (fp, 1.0), xycoords=("data", "axes fraction"), fontsize=7, ha="center",
                    va="top", color="C3")
    unit = _unit(result, series)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(FREQ_UNITS.get(unit, f"1/{unit}").join(("frequency (", ")")) + f"; peaks labelled by period ({unit})")
    ax.set_ylabel("power density")
    ax.set_title(series, fontsize=9)
    ax.legend(fontsize=7, loc="lower left")


def plot_detrended(result: AnalysisResult, series: str, ax: Axes) -> None:
    """The detrended curve (residual) of *series* the spectrum was computed on."""
    s = result.series
    if f"{series}/residual" not in s:
        ax.text(0.5, 0.5, f"{series}: no detrended curve", ha="center", transform=ax.transAxes)
        return
    ax.plot(s[f"{series}/x"], s[f"{series}/residual"], color="C0", lw=0.6)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xlabel(_unit(result, series))
    ax.set_ylabel("detrended value")
    ax.set_title(f"{series} (detrended)", fontsize=9)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Evidence of a ``loss_spectrum`` flag: the spectrum of its series."""
    plot_spectrum(result, str(flag.evidence.get("series", flag.tensor)), ax)


def _flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Flags for a store's series; none in replay mode.

    A replay store's records are batches run through one fixed checkpoint, usually
    interleaved round-robin by source: the record index is not time, and a loss
    "period" equal to the number of sources is the interleaving, not the training
    run.  The table is still computed (it shows what the interleaving does); the
    training run's own loss log is analysed with ``gradforensics loss LOG``.
    """
    if ctx.meta.mode == "replay":
        return []
    out = flags_from_table(result.table, ctx.options_for(NAME, SpectrumOptions))
    size = full_batch(ctx.meta, ctx.batches)
    if size is None:
        return out
    note = (f" Every record is the whole data set ({size} samples): there is no data order, so the period is "
            "the optimisation's own (a period of 2 steps is the step flipping across a sharp direction: see "
            "oscillation).")
    return [replace(f, evidence={**f.evidence, "cause": "learning_rate", "full_batch": True},
                    summary=f.summary + note) for f in out]


@dataclass(frozen=True)
class SpectrumAdvice(Advice):
    """Data-order advice only when the batches differ: a full-batch run's line is the learning rate's."""

    #: First remedy of a line in full-batch training (no data order exists).
    FULL_BATCH_REMEDY: ClassVar[str] = (
        "Full-batch training has no data order: a line at 2 steps is the update overshooting a sharp direction "
        "(edge of stability); lower the learning rate below 2/lambda_max, or warm it up.")

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        items = list(self.remedies)
        if flags and all(f.evidence.get("full_batch") for f in flags):
            return [self.FULL_BATCH_REMEDY, *items[1:]]
        return items


#: What a ``loss_spectrum`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Welch1967] P. D. Welch, "The use of fast Fourier transform for the estimation of power spectra", 1967.
ADVICE = SpectrumAdvice(
    title="Periodic loss / gradient norm",
    phrase="the per-record series (loss or gradient norm) is periodic",
    evidence_keys={"period_steps": "period", "power": "power", "p_value": "p"},
    remedies=(
        "A peak at a fixed period in steps is usually data order: shards, epochs or a sorted-by-length "
        "loader repeating; shuffle across shards and check the period against the shard size.",
        "A peak at the LR schedule's period (restarts, cyclic LR) is the schedule; align or remove it.",
        "A peak at the gradient-accumulation or logging interval is an artefact of how the loss was measured."),
    references=("Welch 1967, spectral estimation; peaks tested against an AR(1) red-noise background",),
    time_axis=True,
    cause="data",
)

_series_compute = series_compute(NAME, analyze_series, shares_detrending=True)


def compute(ctx: Context) -> AnalysisResult:
    """The table of the store's series (:func:`analyze_series`), and ``not_judged`` on a history shorter than
    :data:`~gradforensics.analysis.toolkit.signal.spectrum.MIN_POINTS` steps (no spectrum is estimated)."""
    res = _series_compute(ctx)
    res.not_judged = fl.short_history(ctx, "loss_spectrum", MIN_POINTS)
    return res


ANALYSIS = Analysis(name=NAME, needs=(), compute=compute,
                    flags=_flags, plot=plot,
                    kinds={"loss_spectrum": ADVICE}, options=SpectrumOptions, series=analyze_series,
                    long_history=True)
