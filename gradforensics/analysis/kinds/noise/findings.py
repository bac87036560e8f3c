"""The noise analysis's flags: the run's finding, and tensors, heads and sources that stand out.

The rules (robust z-scores of log SNR upper bounds against the model's, noise out of line
per coordinate, noisier sources) are the package's docstring
(:mod:`gradforensics.analysis.kinds.noise`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import AnalysisResult, Context, Flag
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.kinds.noise.scale import BELOW_RESOLUTION, Z90, robust_z
from gradforensics.analysis.kinds.noise.table import MODEL, N_FEATURES
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.batches import full_batch, learning
from gradforensics.analysis.toolkit.units import head_of

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["LEARNING_WEIGHT", "NoiseOptions", "flags", "run_flag", "run_severity", "severity", "small_median"]

#: Severity weight of a tensor's noise finding in a training run whose loss falls: the model learns through
#: the noise, so it is context (below 0.5), not trouble.
LEARNING_WEIGHT = 0.45


@dataclass(frozen=True)
class NoiseOptions(Options):
    """Options of the noise analysis (``options={"noise": {...}}``).

    Attributes
    ----------
    min_records
        Records a row needs before it may be flagged.
    outlier_ratio
        How many times below the model's median SNR a tensor's upper bound must be (and
        how many times a source's noise ratio must exceed the model's usual one).
    outlier_z
        Robust z-score (median/MAD) a tensor, head or source must reach.
    """

    min_records: int = 8
    outlier_ratio: float = 4.0
    outlier_z: float = 3.5

    analysis_name = "noise"
    constraints: ClassVar[Constraints] = {"min_records": Interval(int, 3, None), "outlier_ratio": Interval(float, 1, None, "neither"),
                   "outlier_z": Interval(float, 0, None, "neither")}



def severity(snr: float, hi: float, ref: float | None, ratio: float, z: float = -math.inf, z_min: float = 3.5) -> float:
    """Severity of a tensor (head) with SNR upper bound *hi*, z-score *z* of log *hi*, against the model median *ref*.

    0 unless ``hi < 1``, ``z <= -z_min`` and ``hi * ratio < ref``; then 0.55-0.90, growing
    with how far past both thresholds it lies (full at ``z = -(z_min + 6.5)`` and
    ``ref / (hi ratio) = 25``).  (*snr* is unused beyond being finite or NaN: a tensor
    below resolution is judged by its upper bound.)
    """
    if not math.isfinite(hi) or hi >= 1 or ref is None or not ref > 0 or not hi * ratio < ref or not z <= -z_min:
        return 0.0
    hi_c = max(hi, 1e-6)
    strength = min((-z - z_min) / 6.5, math.log10(ref / (hi_c * ratio)) / math.log10(25))
    return 0.55 + 0.35 * float(np.clip(strength, 0, 1))


def run_severity(snr: float, hi: float) -> float:
    """The run-level finding: 0.15 when only the point estimate is below 1, 0.30-0.45 when confidently (never 0.5)."""
    if math.isfinite(snr) and snr >= 1:
        return 0.0
    if not math.isfinite(hi) or hi >= 1:
        return 0.15 if (math.isfinite(snr) or math.isfinite(hi)) else 0.0
    return 0.30 + 0.15 * float(np.clip(math.log10(1 / max(hi, 1e-4)) / 2, 0, 1))


def _upper(r: dict[str, Any]) -> float:
    """The SNR's upper 90% bound (the point estimate where there is no jackknife)."""
    hi = float(r["snr_hi"])
    return hi if math.isfinite(hi) else float(r["snr"])


def _level(r: dict[str, Any]) -> float:
    """Log SNR for the model's reference distribution; a row below resolution counts at its upper bound."""
    v = float(r["snr"]) if r["snr_note"] != BELOW_RESOLUTION else float(r["snr_upper"])
    return math.log(v) if v > 0 else math.nan


def _outliers(rows: list[dict[str, Any]], opts: NoiseOptions, ctx: Context | None = None,
              known: Mapping[int, float] | None = None) -> dict[int, float]:
    """id(row) -> severity for the rows whose SNR stands out below the rest of *rows*, with noise out of line."""
    levels = np.array([_level(r) for r in rows])
    ok = np.isfinite(levels)
    if ok.sum() < 3:
        return {}
    ref = math.exp(float(np.median(levels[ok])))
    excess = _noise_excess(rows, ctx, known)
    todo = [r for r in rows if r["n"] >= opts.min_records and math.isfinite(_upper(r))
            and excess.get(id(r), math.inf) >= math.log(opts.outlier_ratio)]   # else quiet (small mean, ordinary noise)
    zs = np.atleast_1d(robust_z(levels, np.array([math.log(max(_upper(r), 1e-12)) for r in todo])))   # one median
    out = {}
    for r, z in zip(todo, zs, strict=True):
        hi = _upper(r)
        sev = severity(float(r["snr"]), hi, ref, opts.outlier_ratio, float(z), opts.outlier_z)
        if sev > 0:
            out[id(r)] = sev
    return out


def _n_features(row: dict[str, Any], ctx: Context | None, known: Mapping[int, float] | None = None) -> float:
    """Coordinates of a row's tensor (head): from its Gram result (*known*: id(row) -> its ``n_features`` as the
    table's pass read it, :data:`N_FEATURES`), else the stored array; NaN when unknown."""
    if ctx is None:
        return math.nan
    v = known.get(id(row), math.nan) if known else math.nan
    if v > 0:
        return v
    g = ctx.grams.get((row["tensor"], row["head"])) if ctx.grams else None
    if g is not None and g.n_features > 0:
        return float(g.n_features)
    info = ctx.store.grads.get(row["tensor"]) if ctx.store is not None else None
    if info is None or len(info.shape) < 2:
        return math.nan
    size = float(np.prod(info.shape[1:], dtype=np.float64))
    return size / info.split if row["head"] is not None and info.split else size


def _noise_excess(rows: list[dict[str, Any]], ctx: Context | None,
                  known: Mapping[int, float] | None = None) -> dict[int, float]:
    """id(row) -> log of (lower 90% bound of its tr(Σ) per coordinate) / (its peers' median tr(Σ) per coordinate).

    A head's peers are the other heads of its tensor (same shape, same role) when there are
    at least two; otherwise, as for a whole tensor, every row of *rows*.  Rows whose size is
    unknown are left out (no entry: judged by their SNR alone).
    """
    per: dict[int, tuple[float, float]] = {}
    for r in rows:
        d, t, se = _n_features(r, ctx, known), float(r["trace_sigma"]), float(r["trace_sigma_se"])
        if not (d > 0 and t > 0):
            continue
        lo = t - Z90 * se if math.isfinite(se) else t
        per[id(r)] = (math.log(t / d), math.log(lo / d) if lo > 0 else -math.inf)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["head"] is not None and id(r) in per:
            groups.setdefault(r["tensor"], []).append(r)
    model = [v for v, _ in per.values()]
    model_median = float(np.median(model)) if model else math.nan      # the same median for every row: once
    out = {}
    for r in rows:
        if id(r) not in per:
            continue
        sib = [per[id(o)][0] for o in groups.get(r["tensor"], []) if o is not r] if r["head"] is not None else []
        out[id(r)] = per[id(r)][1] - (small_median(sib) if len(sib) >= 2 else model_median)
    return out


def small_median(values: list[float]) -> float:
    """The median of a short list of floats without NaN (a head's siblings: a few values, once per head),
    without ``np.median``'s per-call cost: the middle value, or the mean of the two middle values."""
    v = sorted(values)
    k = len(v) // 2
    return float(v[k]) if len(v) % 2 else float((v[k - 1] + v[k]) / 2)


def _noisier_sources(by_tensor: dict[str, list[dict[str, Any]]], opts: NoiseOptions) -> dict[str, list[tuple[str, float]]]:
    """tensor -> [(source, severity)] where a source's tr(Σ) stands out against the others' more than usual."""
    q: dict[str, dict[str, tuple[float, float]]] = {}   # source -> tensor -> (log ratio, log ratio of lower bound)
    for tensor, rows in by_tensor.items():
        tr = {r["source"]: (float(r["trace_sigma"]), float(r["trace_sigma_se"])) for r in rows
              if r["n"] >= opts.min_records and float(r["trace_sigma"]) > 0}
        for s, (t, se) in tr.items():
            others = [v for o, (v, _) in tr.items() if o != s]
            if not others:
                continue
            med = float(np.median(others))
            lo = t - Z90 * se if math.isfinite(se) else math.nan
            q.setdefault(s, {})[tensor] = (math.log(t / med), math.log(lo / med) if lo > 0 else -math.inf)
    out: dict[str, list[tuple[str, float]]] = {}
    for s, per in q.items():
        vals = np.array([v for v, _ in per.values()])
        if vals.size < 3:
            continue
        usual = float(np.median(vals))
        for tensor, (v, v_lo) in per.items():
            z = float(robust_z(vals, v))
            excess = v_lo - usual - math.log(opts.outlier_ratio)
            if z >= opts.outlier_z and excess >= 0:
                strength = min((z - opts.outlier_z) / 6.5, excess / math.log(25))
                out.setdefault(tensor, []).append((s, 0.55 + 0.35 * float(np.clip(strength, 0, 1))))
    return {t: sorted(v, key=lambda x: -x[1]) for t, v in out.items()}


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    opts = ctx.options_for("noise", NoiseOptions)
    t = result.table
    if t.empty:
        return []
    if full_batch(ctx.meta, ctx.batches) is not None:
        return []       # no sampling noise: the spread across records is the trajectory (the table's note says so)
    recs = t.to_dict("records")
    for r in recs:
        r["head"] = head_of(r["head"])
    usable = np.flatnonzero(ctx.batches["n_samples"] > 0)
    span = (int(usable[0]), int(usable[-1])) if usable.size else (0, 0)
    every = [r for r in recs if r["source"] == "" and r["tensor"] != MODEL]
    tensors = [r for r in every if r["head"] is None]
    heads = [r for r in every if r["head"] is not None]
    by_tensor: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r["source"] != "" and r["head"] is None and r["tensor"] != MODEL:
            by_tensor.setdefault(r["tensor"], []).append(r)
    noisy = _noisier_sources(by_tensor, opts)
    known = _known_features(t, recs)
    sev = {**_outliers(tensors, opts, ctx, known), **_outliers(heads, opts, ctx, known)}
    ref = {None: _median_snr(tensors), "head": _median_snr(heads)}
    out = [run_flag(recs, span, opts)] if any(r["tensor"] == MODEL for r in recs) else []
    weight = LEARNING_WEIGHT if learning(ctx.meta, ctx.batches) else 1.0
    for row in every:
        srcs = noisy.get(row["tensor"], []) if row["head"] is None else []
        s = weight * max([sev.get(id(row), 0.0)] + [v for _, v in srcs])
        if s > 0:
            out.append(_flag(row, s, ref[None if row["head"] is None else "head"], srcs, span,
                             un.is_experts(ctx, row["tensor"])))
    return [f for f in out if f is not None]


def _known_features(table: Any, recs: list[dict[str, Any]]) -> dict[int, float]:
    """id(record) -> its Gram result's ``n_features`` from the table's :data:`N_FEATURES` (empty when absent or not
    one value a row)."""
    raw = table.attrs.get(N_FEATURES)
    if not isinstance(raw, str) or len(raw) != 16 * len(recs):
        return {}
    try:
        values = np.frombuffer(bytes.fromhex(raw), dtype=np.float64).tolist()
    except ValueError:          # not ours: the Gram results, as without it
        return {}
    return dict(zip(map(id, recs), values, strict=True))


def _median_snr(rows: list[dict[str, Any]]) -> float | None:
    levels = np.array([_level(r) for r in rows])
    levels = levels[np.isfinite(levels)]
    return math.exp(float(np.median(levels))) if levels.size >= 3 else None


def _fmt_snr(r: dict[str, Any]) -> str:
    if r["snr_note"] == BELOW_RESOLUTION:
        up = float(r["snr_upper"])
        return "below resolution" + (f" (≤ {up:.3g})" if math.isfinite(up) else "")
    return f"{float(r['snr']):.3g}"


def _fmt_b(r: dict[str, Any]) -> str:
    if r["snr_note"] == BELOW_RESOLUTION:
        lo = float(r["b_simple_lo"])
        return f"≥ {lo:,.0f}" if math.isfinite(lo) else "unbounded"
    return f"{float(r['b_simple']):,.0f}"


def run_flag(recs: list[dict[str, Any]], span: tuple[int, int], opts: NoiseOptions) -> Flag | None:
    """The run-level finding: the model's B_simple against the batch used, per source; ``None`` when SNR >= 1."""
    model = [r for r in recs if r["tensor"] == MODEL]
    row = next(r for r in model if r["source"] == "")
    sev = run_severity(float(row["snr"]), _upper(row))
    if sev == 0 or row["n"] < opts.min_records:
        return None
    per = [r for r in model if r["source"] != ""]
    noisier = _noisier_overall(per, opts)
    how = (" (noise within sources; the SNR of a batch of the training mixture)"
           if row["estimator"] == "within sources" else "")
    text = (f"whole model: per-batch gradient SNR {_fmt_snr(row)}{how}, critical batch B_simple {_fmt_b(row)} samples "
            f"vs {float(row['batch_size']):.3g} per batch")
    if per:
        text += "; per source: " + ", ".join(f"{r['source']} B_simple {_fmt_b(r)}" for r in per)
    if noisier:
        text += f"; source {', '.join(noisier)} is much noisier than the others"
    text += (". Steps are noise-dominated at this point of training (normal near convergence): a larger batch "
             "(or a lower LR) buys a proportionally cleaner step.")
    return Flag(kind="noise", tensor=MODEL, head=None, sources=tuple(noisier), severity=sev, records=span,
                evidence=_evidence(row, None) | {"per_source_b_simple": {r["source"]: _num(r["b_simple"]) for r in per}},
                summary=text)


def _noisier_overall(per: list[dict[str, Any]], opts: NoiseOptions) -> list[str]:
    """Sources whose model-level tr(Σ) lower bound is ``outlier_ratio`` times the other sources' median."""
    out = []
    for r in per:
        others = [float(o["trace_sigma"]) for o in per if o is not r and float(o["trace_sigma"]) > 0]
        lo = float(r["trace_sigma"]) - Z90 * float(r["trace_sigma_se"])
        if others and lo > opts.outlier_ratio * float(np.median(others)):
            out.append(str(r["source"]))
    return out


def _num(v: Any) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def _evidence(row: dict[str, Any], ref: float | None) -> dict[str, Any]:
    return {"snr": float(row["snr"]), "snr_lo": float(row["snr_lo"]), "snr_hi": float(row["snr_hi"]),
            "snr_upper": float(row["snr_upper"]), "snr_note": str(row["snr_note"]),
            "b_simple": float(row["b_simple"]), "batch_size": float(row["batch_size"]), "g2": float(row["g2"]),
            "trace_sigma": float(row["trace_sigma"]), "n": int(row["n"]), "estimator": str(row["estimator"]),
            "model_median_snr": ref, "from_sketch": bool(row["from_sketch"])}


def _flag(row: dict[str, Any], sev: float, ref: float | None, noisy: list[tuple[str, float]],
          span: tuple[int, int], experts: bool = False) -> Flag:
    head = row["head"]
    where = un.where(row["tensor"], head, experts)
    hi = _upper(row)
    text = f"{where}: per-batch gradient SNR {_fmt_snr(row)} (upper 90% bound {hi:.3g})"
    if ref is not None and hi < ref:
        text += f", {ref / max(hi, 1e-12):.3g}x below the model's median {ref:.3g}" + (
            " over heads" if head is not None else "")
    if noisy:
        text += f"; source {', '.join(s for s, _ in noisy)} is measurably noisier here than elsewhere in the model"
    text += (f". Critical batch B_simple {_fmt_b(row)} samples vs {float(row['batch_size']):.3g} per batch: this "
             "tensor's updates are mostly noise while the rest of the model learns; lower its learning rate, or look "
             "at what feeds it.")
    evidence = _evidence(row, ref) | {"source_severity": {s: round(v, 4) for s, v in noisy}}
    if experts and head is not None:
        evidence["expert"] = int(head)
    return Flag(kind="noise", tensor=row["tensor"], head=head, sources=tuple(s for s, _ in noisy),
                severity=float(min(1.0, sev)), records=span, evidence=evidence, summary=text)

