"""Gradient noise: the critical batch size of the run, and tensors or heads that stand out.

The statistics are McCandlish et al. (2018)'s gradient noise scale
``B_simple = tr(Σ)/|G|²`` (eq. 2.8) and the per-batch ``SNR = |G|²/(tr(Σ)/B) =
B/B_simple``, estimated from each Gram matrix without bias, with delete-one jackknife
bounds (:mod:`~gradforensics.analysis.kinds.noise.scale`).  In a replay whose batches
are each of one source, ``tr(Σ)`` is estimated *within* sources (around each source's
own mean) and ``|G|²`` is the mean gradient of a batch of the training mixture, so
the spread between the sources' means is not counted as noise.

Noise is a property of the run before it is one of a tensor: a converged checkpoint
has a small mean gradient, so a low SNR everywhere is the normal state there.  So:

* **the run** gets one finding, on the tensor ``whole model``: the model's ``B_simple``
  (``|G|²`` and ``tr(Σ)`` summed over its tensors) against the batch actually used,
  per source too; it never reaches 0.5 (a small batch for this point of training is a
  setting, not a sick layer);
* **a tensor (or head)** is flagged only as an *outlier of the same model*: the robust
  z-score (median/MAD, Iglewicz & Hoaglin 1993) of the log of its SNR's upper 90%
  bound against the log SNRs of the model's tensors (heads: of its heads) is at most
  ``-outlier_z``, that bound is below 1 and ``outlier_ratio`` times below the median,
  *and* its noise is out of line: the jackknife lower bound of its ``tr(Σ)`` per
  coordinate is ``outlier_ratio`` times its peers' median (a head's peers: the other
  heads of its tensor; a tensor's: the model's tensors).  A low SNR from a vanishing
  mean under ordinary noise is a *quiet* tensor (converged, or unused by this data:
  layer-0 q/k of a model whose data needs no attention, a bias the loss barely
  moves), the normal state near convergence, not a noise finding;
* **a source** is named on a flag only when it is *measurably noisier* there: the log
  ratio of its ``tr(Σ)`` to the other sources' median is an outlier (z ≥ ``outlier_z``)
  among the model's tensors, and its jackknife lower bound is still ``outlier_ratio``
  times the ratio the model usually has;
* **full-batch training** (every record the whole data set: ``n_samples`` equal to the
  store's ``extra["dataset_size"]`` on every record, or ``extra["full_batch"]``) has no
  sampling noise: what varies between records is the trajectory (curvature, learning
  rate), not noise, so no flag is raised and the table's ``batch_note`` says so;
* in a **training** store whose recorded loss falls over the run (by 5 % or more), a
  tensor's or head's noise finding is weighted by :data:`LEARNING_WEIGHT` (context
  below 0.5): the model learns through that noise.

The table (its design, each unit's rows, the ``whole model`` rows) is
:mod:`~gradforensics.analysis.kinds.noise.table`; the flags are
:mod:`~gradforensics.analysis.kinds.noise.findings`.

References
----------
McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch
Training", arXiv:1812.06162.  Iglewicz & Hoaglin (1993), "How to Detect and Handle
Outliers" (the modified z-score, 3.5).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need, NotJudged
from gradforensics.analysis.kinds.noise.findings import NoiseOptions, flags
from gradforensics.analysis.kinds.noise.scale import BELOW_RESOLUTION
from gradforensics.analysis.kinds.noise.table import MODEL, N_FEATURES, noise_table
from gradforensics.analysis.toolkit.batches import full_batch

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["ADVICE", "ANALYSIS", "FULL_BATCH", "compute", "plot"]

#: The note of every row of a full-batch run: no flag, since there is no sampling noise to measure.
FULL_BATCH = ("full batch (every record the whole data set of {} samples): no sampling noise; the spread "
              "across records is the trajectory, not noise")


def compute(ctx: Context) -> AnalysisResult:
    not_judged = _not_judged(ctx)           # of the store's records (not the long history's super-records)
    long = ctx.long is not None
    if long:                        # long histories: the same estimators on the per-window, per-source means
        ctx = ctx.super_records()
    table = noise_table(ctx.grams, ctx.batches["n_samples"], ctx.source_of_record(), ctx.sources,
                        ctx.batches.get("mixture"), ctx.meta.mode)
    if long:                        # the super-records' Gram results are not the ones the flags' ctx holds
        table.attrs.pop(N_FEATURES, None)
    size = full_batch(ctx.meta, ctx.batches)
    if size is not None and len(table):
        table["batch_note"] = FULL_BATCH.format(size)
    return AnalysisResult(table=table, not_judged=not_judged)


def _not_judged(ctx: Context) -> list[NotJudged]:
    """No noise flag below ``min_records`` records (the option gates every flag): say so when the store has fewer."""
    need = ctx.options_for("noise", NoiseOptions).min_records
    n = ctx.n_records
    if n >= need:
        return []
    return [NotJudged("noise", f"too few records for a noise scale: {n}", f"≥ {need} records (option min_records)")]



# ------------------------------------------------------------------- plot
def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """SNR per tensor (or per head of the model) with 90% bounds; the flagged one in red.

    A row below resolution is drawn as an open marker at its upper bound; the run-level
    finding draws every tensor with the whole model's SNR as a line.
    """
    t = result.table
    if "snr_note" not in t:       # results a store kept from before the below-resolution columns
        t = t.assign(snr_note="", snr_upper=t["snr"])
    every = t[(t["source"] == "") & (t["tensor"] != MODEL)]
    if flag.head is None:
        rows = every[every["head"].isna()]
        labels = list(rows["tensor"])
        hit = [lab == flag.tensor for lab in labels]
    else:
        rows = every[every["head"].notna()]
        labels = [f"{tn.rsplit('.', 2)[-2] if tn.count('.') >= 2 else tn} h{int(h)}"
                  for tn, h in zip(rows["tensor"], rows["head"])]
        hit = [tn == flag.tensor and int(h) == flag.head for tn, h in zip(rows["tensor"], rows["head"])]
    floor = 1e-4
    below = (rows["snr_note"] == BELOW_RESOLUTION).to_numpy()
    snr = rows["snr"].astype(float).to_numpy()
    snr = np.maximum(np.where(below, rows["snr_upper"].astype(float).to_numpy(), snr), floor)
    snr = np.nan_to_num(snr, nan=floor)
    lo = np.maximum(rows["snr_lo"].astype(float).fillna(floor).to_numpy(), floor)
    hi = np.maximum(rows["snr_hi"].astype(float).fillna(floor).to_numpy(), floor)
    x = np.arange(len(rows))
    colors = np.array(["tab:red" if h else "tab:blue" for h in hit])
    ax.errorbar(x, snr, yerr=[np.maximum(snr - lo, 0), np.maximum(hi - snr, 0)], fmt="none", ecolor="0.5")
    ax.scatter(x[~below], snr[~below], c=list(colors[~below]), zorder=3)
    if below.any():
        ax.scatter(x[below], snr[below], facecolors="none", edgecolors=list(colors[below]), zorder=3,
                   label="below resolution (upper bound)")
    ax.axhline(1.0, color="tab:orange", linestyle="--", label="SNR = 1 (random walk)")
    if flag.tensor == MODEL:
        ev = flag.evidence
        level = ev.get("snr") if ev.get("snr_note") != BELOW_RESOLUTION else ev.get("snr_upper")
        if isinstance(level, (int, float)) and math.isfinite(level) and level > 0:
            ax.axhline(level, color="tab:red", label="whole model" + (" (upper bound)" if level != ev.get("snr") else ""))
    ax.set_yscale("log")
    every_k = max(1, -(-len(x) // 64))   # at most 64 labels (as the report thins them): 2,000 cost seconds
    ax.set_xticks(x[::every_k], labels[::every_k], rotation=90, fontsize=6)
    ax.set_ylabel("per-batch SNR = |G|²/(tr Σ/B)")
    word = "expert" if "expert" in flag.evidence else "head"
    ax.set_title(f"gradient noise: {flag.tensor}" + ("" if flag.head is None else f" {word} {flag.head}"))
    ax.legend(loc="best", fontsize=7)


#: What a ``noise`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [McCandlish2018] S. McCandlish et al., "An Empirical Model of Large-Batch Training", 2018.
ADVICE = Advice(
    title="Gradient noise",
    phrase="gradient noise swamps the signal",
    evidence_keys={"snr": "SNR", "b_simple": "B_simple", "snr_upper": "SNR ≤", "batch_size": "batch"},
    remedies=(
        "Whole model below SNR 1: the batch is below the critical batch size B_simple = tr(Σ)/|G|² for this point "
        "of training (normal near convergence); raise it toward B_simple if steps are wasted on noise.",
        "One tensor or head far below the rest: lower that tensor's learning rate or look at what feeds it "
        "(its inputs' scale, a dead or saturated unit upstream); a named source: check that source's data.",
        "Or lower the LR in proportion (the noise temperature is LR/B); gradient accumulation gets the batch "
        "without memory."),
    references=("McCandlish et al. 2018, An Empirical Model of Large-Batch Training",),
    cause="data",
)

ANALYSIS = Analysis(name="noise", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"noise": ADVICE}, options=NoiseOptions, long_history=True)
