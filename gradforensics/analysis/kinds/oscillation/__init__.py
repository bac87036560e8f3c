"""Oscillation between opposing directions: does a tensor's gradient flip back and forth?

For each tensor and head, from its Gram matrix ``K`` only (see :mod:`~gradforensics.analysis.toolkit.kspace`):

* **consecutive-record cosines** ``cos(g_i, g_{i+1})`` (negative on a period-2 flip);
* the **principal directions** of the records: eigenpairs ``(λ_k, u_k)`` of the
  centred ``H K H``; the records' scores on direction ``v_k`` are ``u_k √λ_k``
  and their *uncentred* projections ``<g_i, v_k> = (K u_k)_i / √λ_k``
  (kernel PCA with a linear kernel; Schölkopf, Smola & Müller 1998);
* the **alternation** of each of the top three score series: the periodogram
  ordinate ``I_f`` of Fourier frequency ``f`` over the centred sum of squares is
  ``Beta(d_f/2, (N-1-d_f)/2)`` under i.i.d. Gaussian records (``d_f`` = 2, or 1 at
  the Nyquist frequency, so a period-2 flip is covered), exactly, because the
  eigenvectors of a Wishart matrix are Haar-distributed and the ratio is scale
  free (Fisher 1929's g test, per ordinate, Bonferroni over the frequencies and
  components).  Only periods with at least ``min_cycles`` cycles in the records
  count, so a slow trend (drift's business) is not an oscillation.  That null is exact in a
  ``replay`` store; in a ``training`` store the records are SGD's, red or reversing by
  themselves, and the test is against healthy training noise instead
  (:func:`~gradforensics.analysis.kinds.oscillation.stats.noise_tests`: a flip beyond the
  batch-noise lag-1 autocorrelation -1/2, a slow period above its fitted continuum);
* the **poles**: the optimal two-group split of the scores (1-D 2-means); the
  mean uncentred projection of each pole (opposite signs: the gradient along
  ``v`` reverses), the bimodality coefficient of the scores
  ``BC = (γ² + 1) / (κ + 3(n-1)²/((n-2)(n-3)))`` (SAS; Pfister et al. 2013;
  > 5/9 suggests bimodality), and the sources sitting at each pole;
* ``source_r2``: the share of the score variance explained by the records'
  source mixture (least squares on ``batches/mixture``).

**Oscillation vs conflict.**  In a ``replay`` store no optimizer step separates
the records: their order is the capture schedule, and with sources interleaved
round-robin two conflicting sources alternate exactly like a period-2 flip.  So
in replay mode the records are first centred *per source* (``K ← E K E`` with
``E = I - A(AᵀA)⁻¹Aᵀ``): a difference between the sources' mean gradients cannot
show up here and is left to :mod:`.conflict`.  In a ``training`` store the
alternation *is* the training dynamics (the weights zig-zag whatever the cause),
so it is flagged, and the sources at each pole are named; ``source_r2`` near 1
says the zig-zag follows the data order and the cure is in the data mix.

Severity = ``significance(p, n_units) × clip(reversal / 0.5, 0, 1) ×
(0.6 + 0.4 · bimodality)``, where ``reversal = min(|μ+|, |μ−|) / max(|μ+|, |μ−|)``
when the poles' mean projections have opposite signs (else 0) and
``bimodality = clip((BC - 1/3) / (5/9 - 1/3), 0, 1)`` (0 for a Gaussian, 1 at the
uniform's 5/9).  Then the severity follows the tensor's share of the oscillating energy:
a whole tensor's is weighted by ``0.4 + 0.6 · E / E_max`` (``E`` the energy of its
oscillating direction, ``λ`` of the component, and ``E_max`` the largest among the
model's tensors oscillating at the same period, to the nearest record: one oscillation),
a head's by its tensor's weight: the zig-zag is where the energy flips, not in a bias
that merely follows.  Oscillations at other periods are other events and are not
weighed against each other.

The statistics are :mod:`gradforensics.analysis.kinds.oscillation.stats`; this module
tabulates, weighs, flags and draws them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice, Finding
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.engine.bandstats import oscillation_edges
from gradforensics.analysis.kinds.oscillation.stats import (
    Component,
    band_oscillation,
    consecutive_cosines,
    oscillation_slab,
)
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.parallel import map_slabs
from gradforensics.store.names import layer_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "ADVICE",
    "ANALYSIS",
    "COLUMNS",
    "DATA_ORDER",
    "MIN_RECORDS",
    "SHARE_FULL",
    "OscillationAdvice",
    "OscillationOptions",
    "compute",
    "compute_long",
    "data_order",
    "flags",
    "plot",
    "severity",
    "weigh_by_energy",
]


COLUMNS = [
    "tensor", "head", "layer", "n_records", "n_excluded", "consec_cos", "component", "explained",
    "period_records", "period_steps", "p_value", "bimodality_coefficient", "pole_pos", "pole_neg",
    "reversal", "source_r2", "sources_pos", "sources_neg", "record_first", "record_last", "energy",
    "energy_share", "severity",
]
#: Steps of history below which no oscillation can reach 0.5 (the spectral test's p-value): a planted
#: square wave at SNR 200 reaches 0.44 with 38 records, 0.56 with 40 (``tests/test_not_judged.py``).
MIN_RECORDS = 40
#: Share of the scores' variance the source mixture explains above which the oscillation is the data order
#: (its flag's ``evidence["cause"]`` is ``"data"``: the verdict and the advice follow it).
DATA_ORDER = 0.5
ENERGY_FLOOR = 0.4        # severity weight of the tensor with the least oscillating energy (the largest: 1)


@dataclass(frozen=True)
class OscillationOptions(Options):
    """``components``: principal directions examined; ``min_cycles``: fewest cycles for a period."""

    components: int = 3
    min_cycles: int = 3

    analysis_name = "oscillation"
    constraints: ClassVar[Constraints] = {"components": Interval(int, 1, None), "min_cycles": Interval(int, 2, None)}


# ---------------------------------------------------------------- severity
def severity(p: float, n_tests: int, reversal: float, bc: float) -> float:
    bimod = fl.ramp(bc - 1.0 / 3.0, 5.0 / 9.0 - 1.0 / 3.0)
    return fl.significance(p, n_tests) * fl.ramp(reversal, 0.5) * (0.6 + 0.4 * bimod)


# ------------------------------------------------------------------ analysis
def _slab_of(slab: list[un.Unit], mix: np.ndarray, replay: bool, opts: OscillationOptions, sources: tuple[str, ...],
             ) -> list[tuple[dict[str, Any], Component | None, np.ndarray | None]]:
    """The rows, components and consecutive cosines of a slab of units (module-level: it runs on dask workers
    too)."""
    ccs = [consecutive_cosines(u.gram) if u.n > 1 else None for u in slab]    # the row's mean and the series
    done = oscillation_slab([(u.gram, mix[u.records], cc) for u, cc in zip(slab, ccs)], replay, opts, sources)
    return [(*rc, cc) for rc, cc in zip(done, ccs, strict=True)]


def compute(ctx: Context) -> AnalysisResult:
    """The oscillation table, projection and consecutive-cosine series of every tensor and head."""
    res = compute_long(ctx) if ctx.long is not None else _compute(ctx)
    res.not_judged = fl.short_history(ctx, "oscillation", MIN_RECORDS)
    return res


def _compute(ctx: Context) -> AnalysisResult:
    opts = ctx.options_for("oscillation", OscillationOptions)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)), dtype=np.float64)
    replay = ctx.meta.mode == "replay"
    rows = []
    proj_pack, cc_pack = un.SeriesPack(), un.SeriesPack()
    units = un.units(ctx)
    dsteps: dict[bytes, float] = {}
    done = map_slabs(functools.partial(_slab_of, mix=mix, replay=replay, opts=opts, sources=ctx.sources), units)
    for u, (row, comp, ucc) in zip(map(units.info, range(len(units))), done, strict=True):
        key = u.records.tobytes()
        if key not in dsteps:           # one median per distinct record set (a tensor's heads share theirs)
            dsteps[key] = float(np.median(np.diff(step[u.records]))) if u.n > 1 else math.nan
        dstep = dsteps[key]
        row.update(tensor=u.tensor, head=u.head, layer=u.layer, n_excluded=u.n_excluded,
                   record_first=0, record_last=ctx.n_records - 1, period_steps=row.get("period_records", math.nan) * dstep if not replay else math.nan)
        rows.append(row)
        if comp is not None:
            proj = np.full(ctx.n_records, np.nan)
            proj[u.records] = comp.proj
            proj_pack.add(u.tensor, u.head, proj)
        if ucc is not None:
            cc = np.full(ctx.n_records, np.nan)
            cc[u.records[1:]] = ucc
            cc_pack.add(u.tensor, u.head, cc)
    table = _frame(rows)
    n_tests = int(table["p_value"].notna().sum())
    table["severity"] = [severity(p, n_tests, r, bc) for p, r, bc in
                         zip(table["p_value"], table["reversal"], table["bimodality_coefficient"])]
    weigh_by_energy(table)
    return AnalysisResult(table=table, series={**proj_pack.to_series("projection"),
                                               **cc_pack.to_series("consecutive_cosine")})


def weigh_by_energy(table: Any) -> None:
    """Severity x (ENERGY_FLOOR + (1 - ENERGY_FLOOR) E/E_max) by the whole tensor's oscillating energy share
    among the tensors oscillating at its period (module docstring)."""
    if "energy" not in table or not len(table):
        return
    whole = table.loc[table["head"].isna()].set_index("tensor")
    energy = whole["energy"].astype(float)
    period = np.round(whole["period_records"].astype(float)).fillna(-1.0)     # one oscillation = one period
    live = np.isfinite(energy) & whole["severity"].gt(0)
    top = energy.where(live).groupby(period).transform("max")
    if not (np.isfinite(top) & (top > 0)).any():
        table["energy_share"] = math.nan
        return
    share = table["tensor"].map(energy / top.where(top > 0)).astype(float)
    table["energy_share"] = share
    w = ENERGY_FLOOR + (1 - ENERGY_FLOOR) * np.clip(share.fillna(0.0).to_numpy(), 0.0, 1.0)
    table["severity"] = table["severity"].to_numpy() * w


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    table = pd.DataFrame(rows, columns=COLUMNS)
    for col in ("head", "layer", "record_first", "record_last"):
        table[col] = table[col].astype("Int64")
    return table


# ------------------------------------------------------- long histories (band)
def compute_long(ctx: Context) -> AnalysisResult:
    """Oscillation above ``N₀`` records: the windowed band test of every tensor and head.

    The consecutive-record cosines are kept per window of the band test (series
    ``window_consecutive_cosine``: window centre, mean cosine), not per record.
    """
    assert ctx.long is not None
    step = np.asarray(ctx.batches.get("step", np.arange(ctx.n_records)), dtype=np.float64)
    edges = oscillation_edges(ctx.n_records, ctx.long.design.band, ctx.long.design.edges)
    centre = (edges[:-1] + edges[1:] - 1) / 2.0
    rows = []
    cc_pack, win_pack = un.SeriesPack(), un.SeriesPack()
    dstep = float(np.median(np.diff(step))) if step.size > 1 else math.nan
    for (tensor, head), g in sorted(ctx.long.grams.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        res = band_oscillation(g.moments, edges)
        n_ok = g.n_records - int(g.bad.size)
        row = {"tensor": tensor, "head": head, "layer": layer_of(tensor), "n_records": n_ok,
               "n_excluded": ctx.n_records - n_ok, "consec_cos": g.moments.consecutive_cosine(),
               **{k: v for k, v in res.items() if not k.startswith("window_")}}
        row["period_steps"] = row.get("period_records", math.nan) * dstep
        row["reversal"] = math.nan
        rows.append(row)
        cc_pack.add(tensor, head, np.c_[centre, g.moments.window_cosines()])
        if "window_t" in res:
            win_pack.add(tensor, head, np.c_[centre, res["window_t"], res["window_share"]])
    table = _frame(rows)
    n_tests = int(table["p_value"].notna().sum())
    replay = ctx.meta.mode == "replay"
    table["severity"] = [0.0 if replay else fl.significance(p, n_tests) * fl.ramp(share, SHARE_FULL)
                         for p, share in zip(table["p_value"], table["explained"])]
    return AnalysisResult(table=table, series={**cc_pack.to_series("window_consecutive_cosine"),
                                               **win_pack.to_series("window_oscillation")})


SHARE_FULL = 0.2    # long histories: the oscillating share of the gradient energy at which the effect saturates


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per oscillating tensor (or the heads that localise it), over the records where it oscillates."""
    out = []
    for r in result.table.itertuples(index=False):
        if not r.severity >= fl.REPORT_FLOOR:
            continue
        head = un.head_of(r.head)
        poles = [s for s in (r.sources_pos, r.sources_neg) if isinstance(s, str) and s]
        src = tuple(dict.fromkeys(x for s in poles for x in s.split(";")))
        span = (int(r.record_first), int(r.record_last)) if un.head_of(getattr(r, "record_first", None)) is not None \
            else (0, ctx.n_records - 1)
        experts = un.is_experts(ctx, r.tensor)
        summary = _summary(r, head, ctx.meta.mode, experts) if ctx.long is None else _summary_long(r, head, experts)
        ev = _evidence(r) | ({"expert": head} if experts and head is not None else {})
        if ctx.long is None and data_order(r, ctx.meta.mode):     # the cause the summary names: the verdict's too
            ev["cause"] = "data"
        out.append(Flag(kind="oscillation", tensor=r.tensor, head=head, sources=src, severity=float(r.severity),
                        records=span, evidence=ev, summary=summary))
    t = result.table
    involved = fl.involved_heads(t, (t["reversal"] > 0) & (t["p_value"] < 0.05))
    return fl.dedupe_heads(out, un.heads_per_tensor(t), involved, by_sources=False)


def _evidence(r: Any) -> dict[str, Any]:
    return {"period_records": r.period_records, "period_steps": r.period_steps, "p_value": r.p_value,
            "pole_pos": r.pole_pos, "pole_neg": r.pole_neg, "reversal": r.reversal,
            "bimodality_coefficient": r.bimodality_coefficient, "consec_cos": r.consec_cos,
            "explained": r.explained, "source_r2": r.source_r2}


def _summary_long(r: Any, head: int | None, experts: bool = False) -> str:
    where = un.where(r.tensor, head, experts)
    steps = f" (~{r.period_steps:.0f} steps)" if np.isfinite(r.period_steps) else ""
    return (f"{where}: gradient oscillates with a period of {r.period_records:.0f} records{steps} over records "
            f"{int(r.record_first)}-{int(r.record_last)} ({100 * r.explained:.0f}% of the gradient energy; "
            f"consecutive-record cosine {r.consec_cos:.2f}, {fl.fmt_p(r.p_value)}; banded Gram, long history).")


def data_order(r: Any, mode: str) -> bool:
    """Whether the records' source explains the zig-zag (``source_r2`` above :data:`DATA_ORDER`, sources at the
    poles, a ``training`` store): then its cause is the data order, not the learning rate."""
    r2 = getattr(r, "source_r2", math.nan)
    return (mode == "training" and bool(r.sources_pos or r.sources_neg)
            and isinstance(r2, (int, float)) and math.isfinite(r2) and r2 > DATA_ORDER)


def _summary(r: Any, head: int | None, mode: str, experts: bool = False) -> str:
    where = un.where(r.tensor, head, experts)
    steps = f" (~{r.period_steps:.0f} steps)" if np.isfinite(r.period_steps) else ""
    s = (f"{where}: gradient flips between opposite directions every {r.period_records:.1f} records{steps} "
         f"along principal direction {int(r.component)} ({100 * r.explained:.0f}% of the record variance; "
         f"poles at {r.pole_pos:+.3g} and {r.pole_neg:+.3g}, consecutive-record cosine {r.consec_cos:.2f}, "
         f"{fl.fmt_p(r.p_value)})")
    pos, neg = r.sources_pos or "mixed", r.sources_neg or "mixed"
    if r.sources_pos or r.sources_neg:
        s += f"; sources at the poles: + {pos}, - {neg}"
        if data_order(r, mode):
            s += f" (the data order explains {100 * r.source_r2:.0f}% of it: mix sources within batches; see conflict)"
    return s + "."


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """The records' projection on the oscillating direction, record by record."""
    proj = un.unit_series(result.series, "projection", flag.tensor, flag.head)
    win = un.unit_series(result.series, "window_oscillation", flag.tensor, flag.head)
    if proj is None and win is not None:
        _plot_windows(win, flag, ax)
        return
    if proj is not None:
        x = np.flatnonzero(np.isfinite(proj))
        y = proj[x]
        ax.plot(x, y, "-", lw=0.6, color="0.6")
        ax.scatter(x, y, s=8, c=np.where(y >= np.median(y), "C3", "C0"), zorder=3)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("record")
    ax.set_ylabel("projection on principal direction")
    where = un.where(flag.tensor, flag.head, "expert" in flag.evidence)
    period = flag.evidence.get("period_records")
    ptxt = f"period {period:.1f} records" if isinstance(period, (int, float)) and np.isfinite(period) else ""
    ax.set_title(f"oscillation: {where}\npoints alternate above and below 0: the update reverses ({ptxt})",
                 fontsize=9)


def _plot_windows(win: np.ndarray, flag: Flag, ax: Axes) -> None:
    """Long histories: the oscillating share of the gradient energy per window, the flagged stretch shaded."""
    ok = np.isfinite(win[:, 0])
    ax.plot(win[ok, 0], win[ok, 2], "o-", ms=3)
    ax.axvspan(flag.records[0], flag.records[1], color="C3", alpha=0.15)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("record (window centre)")
    ax.set_ylabel("oscillating share of gradient energy")
    where = un.where(flag.tensor, flag.head, "expert" in flag.evidence)
    ax.set_title(f"oscillation: {where}\nper window, at the flagged period (banded Gram)", fontsize=9)


#: What an ``oscillation`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Cohen2021] J. Cohen et al., "Gradient Descent on Neural Networks Typically Occurs at the Edge of
#:    Stability", ICLR 2021.
#: .. [Goyal2017] P. Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017 (warmup).
#: .. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training
#:    instabilities", 2023.
@dataclass(frozen=True)
class OscillationAdvice(Advice):
    """The data remedy first when the data order explains every flag of the group (``evidence["cause"]``)."""

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        items = list(self.remedies)
        if flags and all(f.evidence.get("cause") == "data" for f in flags):
            return [items[-1], *items[:-1]]
        return items


ADVICE = OscillationAdvice(
    title="Oscillation",
    phrase="updates flip between two opposing directions",
    evidence_keys={"period_records": "records per period", "consec_cos": "consecutive-record cos",
                   "bimodality_coefficient": "bimodality", "p_value": "p"},
    remedies=(
        "Lower the LR (or its peak), or lengthen warmup: sign-flipping updates along the top direction are "
        "the edge-of-stability signature of a step too large for the local curvature.",
        "With Adam: raise beta2 (e.g. 0.95 -> 0.98/0.99) or epsilon so the second-moment estimate "
        "stops chasing spikes; clip gradients.",
        "If the poles are data sources, the oscillation is a mixture conflict: see the conflict remedies."),
    references=("Cohen et al. 2021, Gradient Descent ... at the Edge of Stability",
                "Goyal et al. 2017, Accurate, Large Minibatch SGD (warmup)",
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities"),
    time_axis=True,
    records_map="a run flipping between two directions zig-zags between two clouds in the step panel",
    cause="learning_rate",
)

ANALYSIS = Analysis(name="oscillation", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"oscillation": ADVICE}, options=OscillationOptions, long_history=True)
