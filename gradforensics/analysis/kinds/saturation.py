"""Bimodal activation saturation: units polarising to zero or to the top of their range.

Capture keeps, per record and unit, the share of tokens *near zero* (``frac_low``)
and *at the top of the range* (``frac_high``), with thresholds fixed per module at
its first record (bounds for tanh/sigmoid, the healthy 99th percentile of ``|a|``
for ReLU/GELU/SiLU; see :mod:`gradforensics.recording.actstats`).  From them:

* for a *bounded* activation (tanh, sigmoid, ``act_bounds``) a unit is **dead** in a
  record when ``frac_low ≥ pole`` (default 0.9: near zero on almost every token),
  **saturated** when ``frac_high ≥ pole``; for an *unbounded* one (ReLU, GELU, SiLU)
  only the capture's fact of a dead unit counts: near zero on *every* position of the
  batch (``acts/<module>/dead``) - a ReLU unit at zero on 90 % of the tokens is
  selective and learns from the rest, and one above the healthy range on every
  position (``saturated``) is in the linear part and passes its gradient (reported,
  not counted).  The module's *polar share* is the share of units that are polar;
* **dead for good**: units dead (saturated) on every record of the closing window of
  records, against the opening window; those that *died* in between get no gradient
  through the activation and do not come back (Lu et al. 2020) - a fact of the run;
* each unit's **polarity** ``frac_high - frac_low ∈ [-1, 1]`` places it between the
  dead pole (-1) and the saturated pole (+1).  The **bimodality** of the unit
  population, per window of records, is judged by a two-component Gaussian
  mixture against one component (BIC, Schwarz 1978) and the separation of the two
  camps, Ashman's ``D = √2 |μ₁ - μ₂| / √(σ₁² + σ₂²)`` (Ashman, Bird & Zepf 1994;
  ``D > 2`` is a clean split), each camp holding at least ``min_camp`` of the units.
  Only a bounded activation's camps are a finding: a ReLU/GELU layer always has a
  camp near zero and a spread of positive values - its baseline.
  Sarle's bimodality coefficient ``BC = (g² + 1) / (κ + 3(n-1)²/((n-2)(n-3)))``
  (SAS Institute 1990; Pfister et al. 2013) is reported too, but not flagged on: a
  skewed, unimodal population - the normal shape of a ReLU or GELU layer - already
  scores above its 5/9 threshold, and the dip test (Hartigan & Hartigan 1985) gives a
  p-value that, with thousands of units, flags any wrinkle and says nothing of
  where the camps are.  The mixture says where they are and how big.
* the **trend** across records (training mode): Spearman's rank correlation of the
  polar share with the record index, the rise from the opening window to the
  closing one, and the record since which the polar share stays above its opening
  level (*onset*) - for an unbounded activation context only (:data:`CONTEXT`): its
  units dead on every batch of the closing window decide;
* **per source**: the polar share of each source's batches (weighted by the batch
  mixture) since the onset, and a one-sided Mann-Whitney test of its pure batches
  against the others' - which data pushes the module to the poles.

References
----------
Ashman, K. M., Bird, C. M. & Zepf, S. E. (1994). Detecting bimodality in
    astronomical datasets. AJ 108, 2348.
Pfister, R. et al. (2013). Good things peak in pairs: a note on the bimodality
    coefficient. Front. Psychol. 4, 700.
Schwarz, G. (1978). Estimating the dimension of a model. Ann. Stat. 6, 461–464.
Hartigan, J. A. & Hartigan, P. M. (1985). The dip test of unimodality. Ann. Stat. 13, 70–84.
Lu, L. et al. (2020). Dying ReLU and initialization. Commun. Comput. Phys. 28, 1671.
Glorot, X. & Bengio, Y. (2010). Understanding the difficulty of training deep
    feedforward neural networks (saturation of sigmoid/tanh units). AISTATS.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.analysis.toolkit.stats import bimodality_coefficient, rank_trend

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.store.reader import Store

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "CONTEXT", "MAX_GMM_UNITS", "NAME", "NO_CAMPS", "PERSISTENT", "POLARITY_BINS",
           "POLE", "WINDOWS", "Camps", "Facts", "SaturationOptions", "compute", "flags", "lazy", "module_result",
           "onset_record", "persistent", "plot", "severity", "source_rows", "two_camps"]


NAME = "saturation"
POLE = 0.9                 # share of tokens that makes a unit dead / saturated in a record
WINDOWS = 8
POLARITY_BINS = np.linspace(-1.0, 1.0, 21)
MAX_GMM_UNITS = 4096       # units subsampled (seeded) for the mixture fit
#: Weight of an unbounded activation's per-batch trend: context, below "act" (units dead for good decide).
CONTEXT = 0.45


@dataclass(frozen=True)
class SaturationOptions(Options):
    """Options of the saturation flags.

    Parameters
    ----------
    min_camp
        Smallest share of units a mixture component must hold to count as a camp.
    min_gap
        Smallest distance in polarity (range 2) between the two camps' means: a
        split of a tight cluster is not two camps, however well separated in D.
    min_bic_gain
        How much lower the two-component BIC must be than the one-component BIC.
    trend_p
        Significance of the Spearman trend needed before the rise counts.
    min_severity
        Flags below this severity are not emitted.
    """

    min_camp: float = 0.1
    min_gap: float = 0.5
    min_bic_gain: float = 10.0
    trend_p: float = 0.01
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"min_camp": Interval(float, 0, 0.5, "neither"), "trend_p": Interval(float, 0, 0.5, "neither")}



# ---------------------------------------------------------------------- lazy pass
def lazy(store: Store) -> dict[str, Any]:
    """Per module: per-record dead / saturated shares and per-window unit means of the shares."""
    out: dict[str, Any] = {}
    if not store.act_modules:
        return out          # no activations: dask.array (1-1.6 CPU-s to import) is not needed
    import dask.array as da

    edges = window_edges(store.n_records, WINDOWS)
    for m in store.act_modules:
        low, high = store.lazy(f"acts/{m}/frac_low"), store.lazy(f"acts/{m}/frac_high")
        out[f"dead|{m}"] = (low >= POLE).mean(axis=1)
        out[f"saturated|{m}"] = (high >= POLE).mean(axis=1)
        for name, x in (("low_w", low), ("high_w", high)):
            out[f"{name}|{m}"] = da.stack([x[a:b].mean(axis=0) for a, b in itertools.pairwise(edges)])
        for fact, frac in (("dead", low), ("saturated", high)):
            # the capture's fact (zero / at the top on every position); stores written before it: frac == 1
            f = store.lazy(f"acts/{m}/{fact}") if store.has(f"acts/{m}/{fact}") else (frac >= 1.0)
            f = f.astype(bool)
            out[f"fact_{fact}|{m}"] = f.mean(axis=1)
            out[f"fact_{fact}_w|{m}"] = da.stack([f[a:b].all(axis=0) for a, b in itertools.pairwise(edges)])
    return out


# ---------------------------------------------------------------- bimodality maths
@dataclass(frozen=True)
class Camps:
    """Two-camp description of a unit population (low camp first)."""

    two_camps: bool
    separation: float          # Ashman's D
    means: tuple[float, float]
    weights: tuple[float, float]
    bic_gain: float            # BIC(1) - BIC(2)


NO_CAMPS = Camps(False, 0.0, (np.nan, np.nan), (np.nan, np.nan), 0.0)


def two_camps(x: np.ndarray, min_camp: float = 0.1, min_bic_gain: float = 10.0, min_gap: float = 0.5,
              seed: int = 0) -> Camps:
    """Fit 1 and 2 Gaussian components to the 1-D values *x*; describe the 2-component split."""
    from sklearn.mixture import GaussianMixture

    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 8 or np.ptp(x) < 1e-9:
        return NO_CAMPS
    if x.size > MAX_GMM_UNITS:
        x = np.random.default_rng(seed).choice(x, MAX_GMM_UNITS, replace=False)
    X = x[:, None]
    g1 = GaussianMixture(1, reg_covar=1e-4, random_state=seed).fit(X)
    g2 = GaussianMixture(2, reg_covar=1e-4, random_state=seed, n_init=2).fit(X)
    mu = g2.means_.ravel()
    var = g2.covariances_.ravel()
    w = g2.weights_.ravel()
    order = np.argsort(mu)
    mu, var, w = mu[order], var[order], w[order]
    d = float(np.sqrt(2.0) * abs(mu[1] - mu[0]) / np.sqrt(var[0] + var[1]))
    gain = float(g1.bic(X) - g2.bic(X))
    ok = gain > min_bic_gain and w.min() >= min_camp and d > 2.0 and mu[1] - mu[0] >= min_gap
    return Camps(bool(ok), d, (float(mu[0]), float(mu[1])), (float(w[0]), float(w[1])), gain)


def onset_record(p: np.ndarray, base: float, rise: float, noise: float = 0.0) -> int | None:
    """First record from which the smoothed polar share stays above its opening level.

    "Above" means above ``base + max(rise / 10, 3 noise, 0.02)``, *noise* being the
    standard deviation of the polar share over the opening window.

    The smoother is a centred moving mean over ``max(3, N/16)`` records (odd), so
    a source that polarises the module on only some batches still counts.
    """
    if rise < 0.05 or p.size < 4:
        return None
    k = max(3, (p.size // 16) | 1)
    smooth = np.convolve(np.pad(p, k // 2, mode="edge"), np.ones(k) / k, mode="valid")
    below = np.flatnonzero(smooth < base + max(rise / 10.0, 3.0 * noise, 0.02))
    if below.size == 0:
        return 0
    return int(below[-1] + 1) if below[-1] + 1 < p.size else None


# ------------------------------------------------------------------------ compute
def _activation(attrs: dict[str, Any]) -> str:
    b = attrs.get("bounds")
    return f"bounded [{b[0]:g}, {b[1]:g}]" if b else f"unbounded (scale {float(attrs.get('scale', np.nan)):.3g})"


@dataclass(frozen=True)
class Facts:
    """The capture's per-unit facts of one module: per record the share of units dead (saturated) on every
    position of the batch, and per window of records which units were so on every record of the window."""

    dead: np.ndarray          # (N,) share of units dead in the record
    saturated: np.ndarray     # (N,)
    dead_w: np.ndarray        # (W, U) bool: dead in every record of window w
    saturated_w: np.ndarray   # (W, U)


def persistent(facts: Facts, bounded: bool = True) -> dict[str, float]:
    """Units polar on every record of the opening and of the closing window, and those that died.

    Polar is dead or saturated for a *bounded* activation (both ends pass a vanishing gradient); for
    an unbounded one (ReLU, GELU, SiLU) dead only: a unit above the healthy range sits in the linear
    part of the activation and passes its gradient.  ``died`` is the share of all units that were not
    polar throughout the opening window and are throughout the closing one; ``died_rel`` the same as
    a share of the units alive at the opening.
    """
    dead, sat = np.asarray(facts.dead_w, bool), np.asarray(facts.saturated_w, bool)
    polar = dead | sat if bounded else dead
    first, last = polar[0], polar[-1]
    died = float(np.mean(last & ~first))
    alive = 1.0 - float(np.mean(first))
    return {"units_polar_first": float(np.mean(first)), "units_polar_last": float(np.mean(last)),
            "units_dead_last": float(np.mean(dead[-1])), "units_saturated_last": float(np.mean(sat[-1])),
            "units_died": died, "units_died_count": int(np.sum(last & ~first)),
            "died_rel": died / alive if alive > 0 else 0.0}


def module_result(module: str, dead: np.ndarray, sat: np.ndarray, low_w: np.ndarray, high_w: np.ndarray,
                  edges: np.ndarray, training: bool, opt: SaturationOptions, facts: Facts | None = None,
                  bounded: bool = True) -> tuple[dict[str, Any], dict]:
    """The module's table row and its series, from the lazy reductions.

    The polar share per record is, for a *bounded* activation, the share of units near a bound on
    almost every token (``frac >= POLE``); for an unbounded one (ReLU, GELU, SiLU) the share of
    units dead or saturated on *every* position of the batch (the capture's facts, *facts*): a ReLU
    unit at zero on 90 % of the tokens is selective, not dead, and still learns from the rest.  For an
    unbounded activation only dead units are polar: one above the healthy range on every position is
    in the activation's linear part and passes its gradient (reported as ``saturated_share``, not
    counted).
    """
    if not bounded and facts is not None:
        dead, sat = facts.dead, facts.saturated
        polar = np.asarray(dead, float)
    else:
        polar = np.asarray(dead, float) + np.asarray(sat, float)
    pol = np.asarray(high_w, float) - np.asarray(low_w, float)          # (W, U) unit polarity per window
    camps = [two_camps(p, opt.min_camp, opt.min_bic_gain, opt.min_gap) for p in pol]
    first, last = slice(int(edges[0]), int(edges[1])), slice(int(edges[-2]), int(edges[-1]))
    base, end = float(np.mean(polar[first])), float(np.mean(polar[last]))
    rho, p = rank_trend(polar, min_n=8) if training else (float("nan"), float("nan"))
    rise = end - base
    rising = training and p < opt.trend_p and rise > 0
    onset = onset_record(polar, base, rise, float(np.std(polar[first]))) if rising else None
    w_since = next((w for w in range(len(camps)) if all(c.two_camps for c in camps[w:])), None)
    c = camps[-1]
    row = {
        "tensor": module, "head": None, "source": "", "units": int(pol.shape[1]), "records": int(polar.size),
        "bounded": bounded,
        "dead_share": float(np.mean(np.asarray(dead, float)[last])),
        "saturated_share": float(np.mean(np.asarray(sat, float)[last])),
        "polar_share": end, "polar_share_first": base, "rise": rise,
        "rise_rel": rise / (1.0 - base) if base < 1.0 else 0.0, "trend_rho": rho, "trend_p": p,
        "onset_record": onset, "two_camps": c.two_camps, "separation": c.separation,
        "camp_low": c.means[0], "camp_high": c.means[1], "camp_low_share": c.weights[0],
        "camp_high_share": c.weights[1], "bimodality_coefficient": bimodality_coefficient(pol[-1]),
        "camps_since_record": None if w_since is None else int(edges[w_since]), "p_value": float("nan"),
        "window_first_start": int(edges[0]), "window_first_end": int(edges[1]) - 1,      # inclusive record ranges
        "window_last_start": int(edges[-2]), "window_last_end": int(edges[-1]) - 1,
        **(persistent(facts, bounded) if facts is not None else dict.fromkeys(PERSISTENT, float("nan"))),
    }
    series = {f"polar/{module}": polar, f"dead/{module}": np.asarray(dead, float),
              f"saturated/{module}": np.asarray(sat, float), f"window_edges/{module}": edges,
              f"separation/{module}": np.array([x.separation if x.two_camps else 0.0 for x in camps]),
              f"polarity_hist/{module}": np.stack([np.histogram(x, POLARITY_BINS)[0] / max(x.size, 1) for x in pol])}
    return row, series


PERSISTENT = ("units_polar_first", "units_polar_last", "units_dead_last", "units_saturated_last", "units_died",
              "units_died_count", "died_rel")


def source_rows(module: str, polar: np.ndarray, dead: np.ndarray, sat: np.ndarray, mixture: np.ndarray,
                pure: np.ndarray, sources: tuple[str, ...], since: int) -> list[dict[str, Any]]:
    """Per source: mixture-weighted polar share since *since*, and a one-sided Mann-Whitney p-value."""
    from scipy.stats import mannwhitneyu

    rows = []
    sl = slice(since, polar.size)
    for s, name in enumerate(sources):
        w = mixture[sl, s].astype(float)
        if w.sum() <= 0:
            continue
        mine, other = polar[sl][pure[sl] == s], polar[sl][(pure[sl] != s) & (pure[sl] >= 0)]
        p = (float(mannwhitneyu(mine, other, alternative="greater").pvalue)
             if mine.size >= 3 and other.size >= 3 and np.ptp(np.r_[mine, other]) > 0 else float("nan"))
        rest = (1.0 - w)
        rows.append({"tensor": module, "head": None, "source": name, "records": int((w > 0).sum()),
                     "dead_share": float(np.average(dead[sl], weights=w)),
                     "saturated_share": float(np.average(sat[sl], weights=w)),
                     "polar_share": float(np.average(polar[sl], weights=w)),
                     "polar_share_others": float(np.average(polar[sl], weights=rest)) if rest.sum() > 0 else np.nan,
                     "p_value": p, "onset_record": since})
    return rows


COLUMNS = ["tensor", "head", "source", "activation", "bounded", "units", "records", "dead_share", "saturated_share",
           "polar_share", "polar_share_first", "polar_share_others", "rise", "rise_rel", "trend_rho", "trend_p",
           "onset_record", *PERSISTENT, "window_first_start", "window_first_end",
           "window_last_start", "window_last_end", "two_camps", "separation", "camp_low",
           "camp_high", "camp_low_share", "camp_high_share", "bimodality_coefficient", "camps_since_record", "p_value"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, SaturationOptions)
    lz = ctx.computed.get(NAME, {})
    edges = window_edges(ctx.n_records, WINDOWS)
    training = ctx.meta.mode == "training"
    pure = ctx.source_of_record()
    rows: list[dict[str, Any]] = []
    series: dict[str, np.ndarray] = {}
    for m in sorted(k.split("|", 1)[1] for k in lz if k.startswith("dead|")):
        attrs = ctx.require_store().act_attrs(m)
        facts = (Facts(lz[f"fact_dead|{m}"], lz[f"fact_saturated|{m}"], lz[f"fact_dead_w|{m}"],
                       lz[f"fact_saturated_w|{m}"]) if f"fact_dead|{m}" in lz else None)
        row, s = module_result(m, lz[f"dead|{m}"], lz[f"saturated|{m}"], lz[f"low_w|{m}"], lz[f"high_w|{m}"],
                               edges, training, opt, facts, bounded=bool(attrs.get("bounds")))
        row["activation"] = _activation(attrs)
        rows.append(row)
        series.update(s)
        since = row["onset_record"] or 0
        rows.extend(source_rows(m, s[f"polar/{m}"], s[f"dead/{m}"], s[f"saturated/{m}"],
                                ctx.batches["mixture"], pure, ctx.sources, since))
    return AnalysisResult(table=pd.DataFrame(rows, columns=COLUMNS), series=series)


# -------------------------------------------------------------------------- flags
def severity(row: dict[str, Any], trend_p: float = 0.01) -> tuple[float, dict[str, float]]:
    """max(level, trend, died, camps), each judged against the run itself or against the physics.

    * ``died``: units alive in the opening window and dead (saturated) on *every* record of the closing
      one, as a share of the units alive at the opening: 0.5 at 20 %.  Dead on every input, a ReLU unit
      gets no gradient through the activation and cannot come back (a fact, no test needed; training
      mode, two units at least).
    * ``trend``: the per-record polar share's significant rise (Spearman p < *trend_p*), as a share of
      the units not polar at the opening: 0.5 at +20 % for a bounded activation.  For an unbounded one
      it is context, weighted by :data:`CONTEXT` (at most 0.45): the per-batch share counts units dead on
      one batch that fire on another - selective, and learning from those - and a GELU/SiLU unit near
      zero still has a (small) gradient and comes back; the units dead on *every* batch of the closing
      window (``died``, ``level``) are what is lost.
    * ``level``: for an unbounded activation the share of units dead or saturated on every record of
      the closing window, 0.5 at half the layer (whatever the run's history: that width is lost); for
      a bounded one the polar share (near a bound on almost every token), 0.5 at 35 %.
    * ``camps`` (bounded activations only): two camps of units at the two ends of the range, 0.5 at
      D = 2.5 with the outer camp at a pole.  A ReLU/GELU layer's units always fall into a camp near zero
      and a spread of positive values: its family baseline, not a finding.
    """
    bounded = bool(row.get("bounded", True))
    persisted = _num(row.get("units_polar_last"), float(row["polar_share"]))
    level = float(np.clip((row["polar_share"] - 0.10) / 0.5 if bounded else (persisted - 0.25) / 0.5, 0, 1))
    significant = _finite(row["trend_p"]) and row["trend_p"] < trend_p
    rise = _num(row.get("rise_rel"), float(row["rise"]))
    trend = float(np.clip(rise / 0.4, 0, 1)) if significant else 0.0
    if not bounded:
        trend *= CONTEXT
    died = (float(np.clip(_num(row.get("died_rel"), 0.0) / 0.4, 0, 1))
            if _finite(row["trend_p"]) and _num(row.get("units_died_count"), 0.0) >= 2 else 0.0)
    camps = float(np.clip((row["separation"] - 1.0) / 3.0, 0, 1)) if row["two_camps"] and bounded else 0.0
    if camps > 0:
        extent = max(float(row["camp_high"]), -float(row["camp_low"])) if _finite(row["camp_high"]) else 1.0
        camps *= float(np.clip((extent - 0.5) / 0.4, 0, 1))
    parts = {"level": level, "trend": trend, "died": died, "camps": camps}
    return max(parts.values()), parts


def _num(x: Any, default: float) -> float:
    return float(x) if _finite(x) else default


def _finite(x: Any) -> bool:
    try:
        return bool(np.isfinite(float(x)))
    except (TypeError, ValueError):
        return False


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per module whose units polarise; sources whose batches push it hardest are named."""
    opt = ctx.options_for(NAME, SaturationOptions)
    table = result.table.to_dict("records")
    out = []
    for row in (r for r in table if not r["source"]):
        sev, parts = severity(row, opt.trend_p)
        if sev < opt.min_severity:
            continue
        per_src = [r for r in table if r["tensor"] == row["tensor"] and r["source"]]
        culprits = tuple(r["source"] for r in sorted(per_src, key=lambda r: -r["polar_share"])
                         if _finite(r["p_value"]) and r["p_value"] < 0.01
                         and r["polar_share"] - r["polar_share_others"] >= 0.05)
        onset = row["onset_record"] if _finite(row["onset_record"]) else None
        since = int(onset) if onset is not None else 0
        ev = {k: row.get(k) for k in ("dead_share", "saturated_share", "polar_share", "polar_share_first", "rise",
                                      "trend_p", "two_camps", "separation", "camp_low", "camp_high",
                                      "bimodality_coefficient", "activation", *PERSISTENT)} | parts
        ev["source_polar_share"] = {r["source"]: r["polar_share"] for r in per_src}
        out.append(Flag(kind="saturation", tensor=row["tensor"], head=None, sources=culprits, severity=sev,
                        records=(since, ctx.n_records - 1), evidence=ev,
                        summary=_summary(row, onset, culprits, ev["source_polar_share"])))
    return out


def _summary(row: dict[str, Any], onset: Any, culprits: tuple[str, ...], by_src: dict[str, float]) -> str:
    if row.get("bounded", True) or not _finite(row.get("units_polar_last")):
        text = (f"{row['tensor']}: {row['dead_share']:.0%} of units dead and {row['saturated_share']:.0%} saturated "
                f"at the end of the run (polar share {row['polar_share_first']:.0%} -> {row['polar_share']:.0%}")
        text += f", rising since record {int(onset)})" if onset is not None else ")"
        if row["two_camps"] and row.get("bounded", True):
            text += (f"; the units split into two camps (polarity {row['camp_low']:+.2f} and "
                     f"{row['camp_high']:+.2f}, separation D={row['separation']:.1f})")
    else:
        text = _facts_text(row, onset)
    if culprits:
        text += "; batches from " + ", ".join(f"'{s}' ({by_src[s]:.0%})" for s in culprits) + " push it to the poles"
    return text + "."


def _facts_text(row: dict[str, Any], onset: Any) -> str:
    """The unbounded activation's sentence: units dead (saturated) on every batch, at the close and the opening."""
    a0, b0, a1, b1 = (int(row[k]) for k in ("window_first_start", "window_first_end", "window_last_start",
                                             "window_last_end"))
    n = int(row["units"])
    what = f"{row['units_dead_last']:.0%} of its {n} units dead"
    text = (f"{row['tensor']}: {what} on every batch of records {a1}-{b1}, against {row['units_polar_first']:.0%} "
            f"in records {a0}-{b0}")
    if row["units_died_count"] > 0:
        text += (f": {int(row['units_died_count'])} units ({row['died_rel']:.0%} of those alive at the start) "
                 f"died; a unit dead on every input gets no gradient through a ReLU (a vanishing one through "
                 f"GELU/SiLU)")
    text += f" (dead per batch {row['polar_share_first']:.0%} -> {row['polar_share']:.0%}"
    text += f", rising since record {int(onset)}" if onset is not None else ""
    text += ("; a unit dead on one batch that fires on another is selective: context"
             if row["polar_share"] - row["units_polar_last"] >= 0.05 else "") + ")"
    if row["units_saturated_last"] > 0:
        text += (f"; {row['units_saturated_last']:.0%} sit above the healthy range on every batch - the linear part "
                 f"of the activation, which passes its gradient (not counted)")
    return text


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Unit-polarity distribution per window (heat map) with the polar share per record on top."""
    m = flag.tensor
    hist = np.asarray(result.series[f"polarity_hist/{m}"], dtype=float)
    edges = np.asarray(result.series[f"window_edges/{m}"], dtype=float)
    ax.pcolormesh(edges, POLARITY_BINS, hist.T, cmap="viridis", shading="flat", vmin=0.0, vmax=1.0)
    ax.text(0.99, 0.01, "colour: share of units (0-1)", transform=ax.transAxes, ha="right", va="bottom",
            fontsize=7, color="w")
    ax.set_xlabel("record")
    ax.set_ylabel("unit polarity: share at top - share near zero")
    polar = np.asarray(result.series[f"polar/{m}"], dtype=float)
    ax.plot(np.arange(polar.size) + 0.5, 2 * polar - 1, color="w", lw=1, label="2 x polar share - 1")
    if flag.records[0] > 0:
        ax.axvline(flag.records[0], color="C3", ls="--", label=f"onset (record {flag.records[0]})")
    ax.legend(fontsize=7, loc="center left")
    ax.set_title(f"{m}: units split toward dead (-1) and saturated (+1)"
                 + (f" since record {flag.records[0]}" if flag.records[0] > 0 else ""), fontsize=9)


#: What a ``saturation`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Glorot2010] X. Glorot and Y. Bengio, "Understanding the difficulty of training deep feedforward
#:    neural networks", AISTATS 2010.
#: .. [Lu2019] L. Lu et al., "Dying ReLU and Initialization: Theory and Numerical Examples", 2019.
#: .. [Ioffe2015] S. Ioffe and C. Szegedy, "Batch Normalization", ICML 2015; J. L. Ba et al., "Layer
#:    Normalization", 2016.
ADVICE = Advice(
    title="Activation saturation",
    phrase="units are dead or pinned at the top of their range",
    evidence_keys={"dead_share": "dead share", "saturated_share": "saturated share", "polar_share": "polar share",
                   "rise": "rise of the polar share", "separation": "camp separation D",
                   "bimodality_coefficient": "bimodality"},
    remedies=(
        "Check the initialisation scale of the layer feeding these units (Glorot/He; smaller for deep "
        "stacks) and the LR: a large early step kills ReLU-family units for good.",
        "Add or move a normalisation before the activation (LayerNorm/RMSNorm), or switch to a smooth "
        "activation (GELU/SiLU) if units die."),
    references=("Glorot & Bengio 2010, Understanding the difficulty of training deep feedforward networks",
                "Lu et al. 2019, Dying ReLU and Initialization",
                "Ba et al. 2016, Layer Normalization"),
)

ANALYSIS = Analysis(name=NAME, needs=(Need.ACTS,), compute=compute, flags=flags, plot=plot, lazy=lazy,
                    kinds={"saturation": ADVICE}, options=SaturationOptions, long_history=True)
