"""Gradient noise scale ``B_simple = tr(Σ)/|G|²`` and per-batch SNR (McCandlish et al. 2018).

Record *i* is the mean gradient of a batch of ``B_i`` samples:
``g_i = G + ε_i`` with ``Cov(ε_i) = Σ / B_i``, so (McCandlish et al. 2018, eq. A.1)

    E|g_i|² = |G|² + tr(Σ)/B_i,          E<g_i, g_j> = |G|²  (i ≠ j).

With ``w_i = B_i`` the unbiased estimates from the Gram matrix ``K`` are

    |G|²^ = (Σ_{i≠j} w_i w_j K_ij) / (Σ_{i≠j} w_i w_j),
    tr(Σ)^ = (1/n) Σ_i B_i (K_ii - |G|²^).

For equal ``B`` they are exactly the paper's two-batch-size estimators with
``B_small = B`` and ``B_big = N B`` (eq. A.2-A.3: ``|G|² = (B_big|g_big|² -
B_small|g_small|²)/(B_big - B_small)``), since ``|ḡ|² = ΣK/N²``.  Then

    B_simple = tr(Σ)/|G|²      (eq. 2.8, the critical-batch estimate),
    SNR = |G|² / (tr(Σ)/B) = B / B_simple   (per-batch signal-to-noise).

Uncertainty: a delete-one jackknife in K-space (O(n²)); ``snr_lo``/``snr_hi``
are the two-sided 90% bounds, so ``snr_hi`` is a one-sided 95% upper bound.

When to worry: at SNR ≲ 1 a batch gradient is mostly noise and the updates of
that tensor are close to a random walk.  A whole model at SNR < 1 is a small
batch for this point of training (severity ≤ 0.45); a layer or head whose SNR
is confidently below 1 *and* several times below the rest of the model, or a
source several times noisier than the others in a layer, is a finding
(severity > 0.5).  In ``training`` mode ``G`` moves between records, which
biases ``|G|²`` down and ``B_simple`` up; compare layers with each other.

References
----------
McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch
Training", arXiv:1812.06162.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.engine.model import (
    Advice,
    Analysis,
    AnalysisResult,
    Context,
    Flag,
    GramResult,
    Need,
    Options,
)
from gradforensics.analysis.engine.units import head_of
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

Z90 = 1.6448536269514722
COLUMNS = ("tensor", "head", "source", "n", "batch_size", "g2", "trace_sigma", "b_simple", "snr", "snr_se",
           "snr_lo", "snr_hi", "b_simple_lo", "b_simple_hi", "from_sketch")


@dataclass(frozen=True)
class NoiseOptions(Options):
    """Options of the noise analysis (``options={"noise": {...}}``).

    Attributes
    ----------
    min_records
        Records a row needs before it may be flagged.
    outlier_ratio
        How many times below the model's (or the other sources') SNR a row's
        upper bound must be to count as standing out.
    """

    min_records: int = 8
    outlier_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.min_records < 3:
            raise SpecError(f"noise option min_records must be >= 3; got {self.min_records}.")
        if not self.outlier_ratio > 1:
            raise SpecError(f"noise option outlier_ratio must be > 1; got {self.outlier_ratio}.")


# -------------------------------------------------------------- estimates
def noise_estimate(gram: np.ndarray, n_samples: np.ndarray) -> dict[str, float]:
    """|G|², tr(Σ), B_simple and per-batch SNR from a Gram matrix (see the module docstring).

    Parameters
    ----------
    gram
        (n, n) Gram matrix of the n usable records.
    n_samples
        (n,) batch size of each record (unequal sizes are handled).

    Returns
    -------
    dict
        ``n, batch_size, g2, trace_sigma, b_simple, snr, snr_se, snr_lo, snr_hi,
        b_simple_lo, b_simple_hi``.  NaN where undefined (n < 2; no
        jackknife below n = 3); ``b_simple`` is inf where ``|G|²^ <= 0``.
    """
    k = np.asarray(gram, dtype=np.float64)
    b = np.asarray(n_samples, dtype=np.float64)
    n = b.size
    out = dict.fromkeys(COLUMNS[3:-1], math.nan)
    out["n"] = n
    if n < 2:
        return out
    d = np.diag(k)
    v = k @ b
    w1, w2, bd = b.sum(), (b * b).sum(), (b * d).sum()
    g2 = (b @ v - (b * b * d).sum()) / (w1 * w1 - w2)
    tr = (bd - g2 * w1) / n
    bref = float(b.mean())
    snr = _ratio(g2 * bref, tr)
    out.update(batch_size=bref, g2=float(g2), trace_sigma=float(tr), snr=snr, b_simple=_b_simple(bref, snr))
    if n >= 3:
        with np.errstate(divide="ignore", invalid="ignore"):
            g2_m = (b @ v - (b * b * d).sum() - 2 * b * (v - b * d)) / ((w1 - b) ** 2 - (w2 - b * b))
            tr_m = (bd - b * d - g2_m * (w1 - b)) / (n - 1)
            snr_m = g2_m * bref / tr_m
        if np.all(np.isfinite(snr_m)):
            se = float(np.sqrt((n - 1) / n * ((snr_m - snr_m.mean()) ** 2).sum()))
            lo, hi = snr - Z90 * se, snr + Z90 * se
            out.update(snr_se=se, snr_lo=lo, snr_hi=hi, b_simple_lo=_b_simple(bref, hi),
                       b_simple_hi=_b_simple(bref, lo))
    return out


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return float(num / den)
    return math.inf if num > 0 else math.nan


def _b_simple(batch: float, snr: float) -> float:
    """B_simple = B / SNR; inf where the signal estimate is not positive."""
    if math.isnan(snr):
        return math.nan
    return batch / snr if snr > 0 else math.inf


def noise_rows(g: GramResult, n_samples: np.ndarray, source_index: np.ndarray,
               sources: tuple[str, ...]) -> list[dict[str, Any]]:
    """Table rows of one tensor (or head): all sources, then each source with >= 2 pure records."""
    usable = g.finite & (n_samples > 0)
    rows = []
    for s, label in [(-2, ""), *enumerate(sources)]:
        mask = usable if s == -2 else usable & (source_index == s)
        if s != -2 and mask.sum() < 2:
            continue
        idx = np.flatnonzero(mask)
        est = noise_estimate(g.gram[np.ix_(idx, idx)], n_samples[idx])
        rows.append({"tensor": g.tensor, "head": g.head, "source": label, **est, "from_sketch": g.from_sketch})
    return rows


def noise_table(grams: dict[tuple[str, int | None], GramResult], n_samples: np.ndarray, source_index: np.ndarray,
                sources: tuple[str, ...]) -> pd.DataFrame:
    """The ``noise.csv`` table: a row per tensor, head and source (``source`` empty = all)."""
    import pandas as pd

    rows = []
    for key in sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        rows += noise_rows(grams[key], np.asarray(n_samples), source_index, sources)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table["head"] = table["head"].astype("Int64")
    return table


def compute(ctx: Context) -> AnalysisResult:
    table = noise_table(ctx.grams, ctx.batches["n_samples"], ctx.source_of_record(), ctx.sources)
    return AnalysisResult(table=table)


# ------------------------------------------------------------------ flags
def severity(snr: float, hi: float, ref: float | None, ratio: float) -> float:
    """Severity of a row with SNR *snr* and upper bound *hi*, against reference SNR *ref*.

    0 when the SNR is not below 1; 0.15 when only the point estimate is; 0.30-0.45
    when confidently below 1 (higher the lower ``hi``); 0.55-0.90 when also
    ``hi * ratio < ref`` (standing out by ``ratio`` to ``25 * ratio``).
    """
    if not (math.isfinite(snr) and math.isfinite(hi)) or (snr >= 1 and hi >= 1):
        return 0.0
    hi_c = max(hi, 1e-4)
    sev = 0.15 if hi >= 1 else 0.30 + 0.15 * float(np.clip(math.log10(1 / hi_c) / 2, 0, 1))
    if ref is not None and ref > 0 and hi < 1 and hi_c * ratio < ref:
        sev = max(sev, 0.55 + 0.35 * float(np.clip(math.log10(ref / (hi_c * ratio)) / math.log10(25), 0, 1)))
    return sev


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    opts = ctx.options_for("noise", NoiseOptions)
    t = result.table
    if t.empty:
        return []
    recs = t.to_dict("records")
    for r in recs:
        r["head"] = head_of(r["head"])
    every = [r for r in recs if r["source"] == ""]
    whole = [float(r["snr"]) for r in every if r["head"] is None and math.isfinite(r["snr"])]
    ref = float(np.median(whole)) if len(whole) >= 3 else None
    by_source: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for r in recs:
        if r["source"] != "" and r["n"] >= opts.min_records:
            by_source.setdefault((r["tensor"], r["head"]), []).append(r)
    usable = np.flatnonzero(ctx.batches["n_samples"] > 0)
    span = (int(usable[0]), int(usable[-1])) if usable.size else (0, 0)
    out = []
    for row in every:
        if row["n"] < opts.min_records:
            continue
        sev = severity(row["snr"], row["snr_hi"], ref, opts.outlier_ratio)
        if row["head"] is not None and sev <= 0.5:
            sev = 0.0   # a head is flagged only when it stands out
        noisy = _noisy_sources(by_source.get((row["tensor"], row["head"]), []), opts)
        sev = max([sev] + [s for _, s in noisy])
        if sev > 0:
            out.append(_flag(row, row["head"], sev, ref, noisy, span))
    return out


def _noisy_sources(rows: list[dict[str, Any]], opts: NoiseOptions) -> list[tuple[str, float]]:
    """Sources whose SNR in this tensor (head) stands out below the other sources'."""
    out = []
    for r in rows:
        others = [float(o["snr"]) for o in rows if o is not r and math.isfinite(o["snr"])]
        if not others:
            continue
        sev = severity(r["snr"], r["snr_hi"], float(np.median(others)), opts.outlier_ratio)
        if sev > 0.5:
            out.append((str(r["source"]), sev))
    return sorted(out, key=lambda s: -s[1])


def _flag(row: Any, head: int | None, sev: float, ref: float | None, noisy: list[tuple[str, float]],
          span: tuple[int, int]) -> Flag:
    where = row["tensor"] + ("" if head is None else f" head {head}")
    snr, lo, hi = float(row["snr"]), float(row["snr_lo"]), float(row["snr_hi"])
    text = f"{where}: per-batch gradient SNR {snr:.3g} (90% CI {lo:.3g} to {hi:.3g})"
    if ref is not None and ref > 0 and hi < ref:
        text += f", {ref / max(hi, 1e-12):.3g}x below the model's median {ref:.3g}"
    if noisy:
        text += f"; source {', '.join(s for s, _ in noisy)} is much noisier than the others here"
    text += (f"; updates are mostly noise. Critical batch B_simple ~ {row['b_simple']:.3g} samples vs "
             f"{row['batch_size']:.3g} per batch: raise the batch size or lower this tensor's learning rate.")
    evidence = {"snr": snr, "snr_lo": lo, "snr_hi": hi, "b_simple": float(row["b_simple"]),
                "batch_size": float(row["batch_size"]), "g2": float(row["g2"]),
                "trace_sigma": float(row["trace_sigma"]), "n": int(row["n"]),
                "model_median_snr": ref, "from_sketch": bool(row["from_sketch"]),
                "source_severity": {s: round(v, 4) for s, v in noisy}}
    return Flag(kind="noise", tensor=row["tensor"], head=head, sources=tuple(s for s, _ in noisy),
                severity=float(min(1.0, sev)), records=span, evidence=evidence, summary=text)


# ------------------------------------------------------------------- plot
def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """SNR per tensor (or per head of the flagged tensor) with 90% bounds; the flagged one in red."""
    t = result.table
    every = t[t["source"] == ""]
    if flag.head is None:
        rows = every[every["head"].isna()]
        labels = list(rows["tensor"])
        hit = [lab == flag.tensor for lab in labels]
    else:
        rows = every[(every["tensor"] == flag.tensor) & every["head"].notna()]
        labels = [f"h{int(h)}" for h in rows["head"]]
        hit = [int(h) == flag.head for h in rows["head"]]
    floor = 1e-3
    snr = np.maximum(rows["snr"].astype(float).fillna(floor).to_numpy(), floor)
    lo = np.maximum(rows["snr_lo"].astype(float).fillna(floor).to_numpy(), floor)
    hi = np.maximum(rows["snr_hi"].astype(float).fillna(floor).to_numpy(), floor)
    x = np.arange(len(rows))
    colors = ["tab:red" if h else "tab:blue" for h in hit]
    ax.errorbar(x, snr, yerr=[np.maximum(snr - lo, 0), np.maximum(hi - snr, 0)], fmt="none", ecolor="0.5")
    ax.scatter(x, snr, c=colors, zorder=3)
    ax.axhline(1.0, color="tab:orange", linestyle="--", label="SNR = 1 (random walk)")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=90, fontsize=6)
    ax.set_ylabel("per-batch SNR = |G|²/(tr Σ/B)")
    ax.set_title(f"gradient noise: {flag.tensor}" + ("" if flag.head is None else f" head {flag.head}"))
    ax.legend(loc="best", fontsize=7)


#: What a ``noise`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [McCandlish2018] S. McCandlish et al., "An Empirical Model of Large-Batch Training", 2018.
ADVICE = Advice(
    title="Gradient noise",
    phrase="gradient noise swamps the signal",
    evidence_keys=("snr", "b_simple", "batch"),
    remedies=(
        "Raise the batch size toward B_simple = tr(Σ)/|G|² (the critical batch size estimate); "
        "below it, steps are noise-dominated.",
        "Or lower the LR in proportion (the noise temperature is LR/B); gradient accumulation gets the batch "
        "without memory."),
    references=("McCandlish et al. 2018, An Empirical Model of Large-Batch Training",),
)

ANALYSIS = Analysis(name="noise", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"noise": ADVICE}, options=NoiseOptions)
