"""Is it the learning rate? The top Hessian eigenvalue at the checkpoint against the optimizer's stability threshold.

On a quadratic, gradient descent with step η is stable along an eigen-direction
of curvature λ only if ``λη < 2``; heavy-ball momentum β moves the limit to
``λη < 2 + 2β``; Adam, read through its preconditioned Hessian ``P⁻¹H`` with
``P = diag(√v̂ + ε)``, to ``λ(P⁻¹H) η < (2 + 2β₁)/(1 − β₁)`` (38 at β₁ = 0.9).
Training at the *edge of stability* sits at that limit: the loss oscillates along
the top eigenvector and falls only on average (Cohen et al. 2021, 2022).

The capture (``gradforensics capture --curvature``) stores the top eigenvalues by
Lanczos for the whole model and each block (:mod:`gradforensics.store.probes`);
this analysis divides ``λη`` by the optimizer's threshold: the stability ratio
``r``.  ``r >= 1`` is a flag (severity 0.6 at r = 1, 0.95 from r = 2): the blocks
named are those with ``r >= 1`` on their own, in order of r, else those that hold
the top eigenvector's mass.  Below 1 there is no flag.

Table ``curvature.csv``: a row per block, source (empty = the mixture of the
replayed batches) and operator (``hessian``, ``preconditioned``), columns
``tensor`` (the block; ``model`` = all parameters), ``head``, ``source``,
``operator``, ``lambda_max``, ``lr``, ``threshold``, ``ratio``, ``mass``,
``iterations``, ``residual``, ``converged``.  A Lanczos run that did not converge
under-estimates λ (Ritz values bound the top eigenvalue from below), so r is then
a lower bound.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, NotJudged
from gradforensics.store.probes import read_curvature

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "WHOLE_MODEL", "compute", "curvature_table", "flags", "not_judged",
           "plot", "severity", "threshold"]

NAME = "curvature"
WHOLE_MODEL = "model"
COLUMNS = ("tensor", "head", "source", "operator", "lambda_max", "lr", "threshold", "ratio", "mass",
           "iterations", "residual", "converged")


def threshold(operator: str, hyper: dict[str, Any]) -> float:
    """The λ·η stability limit of *operator* under the optimizer in *hyper* (NaN where none applies)."""
    kind = hyper.get("optimizer")
    if operator == "preconditioned":
        b1 = float(hyper.get("beta1", 0.9))
        return (2.0 + 2.0 * b1) / (1.0 - b1) if kind == "adam" else math.nan
    if kind == "sgd":
        return 2.0
    if kind == "sgd-momentum":
        return 2.0 + 2.0 * float(hyper.get("momentum", 0.0))
    return math.nan                       # the raw Hessian under Adam has no such limit


def curvature_table(data: Any) -> pd.DataFrame:
    """``curvature.csv`` from a :class:`~gradforensics.store.probes.CurvatureData`."""
    import pandas as pd

    hyper, lrs = data.attrs.get("hyper", {}), data.attrs.get("lrs", {})
    mass: dict[tuple[str, str, str], float] = {}
    for row in data.rows:
        for block, share in (row.get("mass") or {}).items():
            mass[(block, row["source"], row["operator"])] = float(share)
    out = []
    for i, row in enumerate(data.rows):
        lam = float(data.eigenvalues[i, 0])
        lr = float(lrs.get(row["block"], hyper.get("lr", math.nan)))
        thr = threshold(row["operator"], hyper)
        key = (row["block"], row["source"], row["operator"])
        out.append({"tensor": row["block"], "head": None, "source": row["source"], "operator": row["operator"],
                    "lambda_max": lam, "lr": lr, "threshold": thr, "ratio": lam * lr / thr,
                    "mass": 1.0 if row["block"] == WHOLE_MODEL else mass.get(key, math.nan),
                    "iterations": int(data.iterations[i]), "residual": float(data.residuals[i, 0]),
                    "converged": bool(data.converged[i])})
    table = pd.DataFrame(out, columns=list(COLUMNS))
    table["head"] = table["head"].astype("Int64")
    return table


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    data = read_curvature(ctx.store) if ctx.store is not None else None
    if data is None:
        empty = pd.DataFrame(columns=list(COLUMNS))
        empty["head"] = empty["head"].astype("Int64")
        return AnalysisResult(table=empty)
    table = curvature_table(data)
    return AnalysisResult(table=table, not_judged=not_judged(table, data.attrs.get("hyper", {})))


def not_judged(table: pd.DataFrame, hyper: dict[str, Any]) -> list[NotJudged]:
    """The stability verdict a measured curvature could not give: no row has a finite stability ratio (the raw
    Hessian alone under Adam, no preconditioned row without the optimizer's second moments; or an optimizer
    or learning rate not known), so no ``curvature`` flag can fire."""
    if not len(table) or np.isfinite(table["ratio"].to_numpy(dtype=float)).any():
        return []
    from gradforensics.store.probes import NO_STABILITY_VERDICT, no_stability_verdict

    kind = hyper.get("optimizer")
    if no_stability_verdict(kind, table["operator"]):
        return [NotJudged(NAME, f"under Adam, whose threshold is on the preconditioned Hessian, "
                                f"{NO_STABILITY_VERDICT}",
                          "the optimizer state saved with the checkpoint (Adam's second moments, optimizer.pt), "
                          "captured with --curvature")]
    return [NotJudged(NAME, f"no stability threshold applies (optimizer {kind or 'unknown'}, learning rate "
                            f"{'unknown' if not np.isfinite(table['lr'].to_numpy(dtype=float)).any() else 'known'})",
                      "the optimizer and its learning rate at the checkpoint (capture --optimizer, --lr)")]


def severity(ratio: float) -> float:
    """0.6 at r = 1 rising to 0.95 at r = 2; below 1 a context value under 0.5 (0.45 r²)."""
    if not math.isfinite(ratio) or ratio <= 0:
        return 0.0
    if ratio < 1.0:
        return 0.45 * ratio * ratio
    return float(min(0.95, 0.6 + 0.35 * math.log2(ratio)))


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    t = result.table
    if t.empty:
        return []
    n = max(ctx.meta.n_records - 1, 0)
    out = []
    for op in ("hessian", "preconditioned"):
        whole = t[(t["tensor"] == WHOLE_MODEL) & (t["source"] == "") & (t["operator"] == op)]
        if whole.empty or not float(whole["ratio"].iloc[0]) >= 1.0:
            continue
        blocks = t[(t["tensor"] != WHOLE_MODEL) & (t["source"] == "") & (t["operator"] == op)]
        out.append(_flag(whole.iloc[0], blocks, t[(t["tensor"] == WHOLE_MODEL) & (t["source"] != "")
                                                   & (t["operator"] == op)], n))
    return out


def _named(blocks: pd.DataFrame) -> tuple[list[str], str]:
    """The blocks a flag names: r >= 1 on their own in order of r, else the top eigenvector's mass (>= 10 %)."""
    alone = blocks[blocks["ratio"] >= 1.0].sort_values("ratio", ascending=False, kind="stable")
    if not alone.empty:
        return list(alone["tensor"]), "unstable on their own"
    held = blocks[blocks["mass"] >= 0.1].sort_values("mass", ascending=False, kind="stable")
    return list(held["tensor"]), "holding the top eigenvector's mass"


def _flag(row: Any, blocks: pd.DataFrame, per_source: pd.DataFrame, last: int) -> Flag:
    r, lam, lr, thr = float(row["ratio"]), float(row["lambda_max"]), float(row["lr"]), float(row["threshold"])
    names, why = _named(blocks)
    top = names[0] if names else WHOLE_MODEL
    what = "lambda_max(P^-1 H)" if row["operator"] == "preconditioned" else "lambda_max(H)"
    src_r = dict(zip(per_source["source"], per_source["ratio"].astype(float)))
    hot = tuple(s for s, v in sorted(src_r.items(), key=lambda kv: -kv[1]) if v >= 1.0)
    text = (f"the learning rate is above what the curvature allows: {what} = {lam:.4g} at lr {lr:.3g} gives "
            f"lambda*lr = {lam * lr:.3g} >= {thr:.3g} (stability ratio {r:.2f}); blocks {why}: "
            f"{', '.join(names[:5]) or WHOLE_MODEL}. Lower the LR by >= {r:.2f}x, to <= {lr / r:.3g}; or warm it up.")
    evidence = {"lambda_max": lam, "lr": lr, "threshold": thr, "ratio": r, "lr_max": lr / r,
                "operator": row["operator"], "blocks": names,
                "block_ratios": {b: float(v) for b, v in zip(blocks["tensor"], blocks["ratio"])},
                "mass": {b: float(v) for b, v in zip(blocks["tensor"], blocks["mass"]) if math.isfinite(v)},
                "per_source": src_r, "converged": bool(row["converged"]), "iterations": int(row["iterations"])}
    return Flag(kind=NAME, tensor=top, head=None, sources=hot, severity=severity(r), records=(0, last),
                evidence=evidence, summary=text)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Stability ratio per block (the mixture), the limit at 1."""
    t = result.table
    op = flag.evidence.get("operator", "hessian")
    rows = t[(t["source"] == "") & (t["operator"] == op)]
    y = np.arange(len(rows))
    ax.barh(y, rows["ratio"].to_numpy(dtype=float), color="tab:orange")
    ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_yticks(y, list(rows["tensor"]))
    ax.set_xlabel("stability ratio  lambda*lr / threshold")
    ax.set_title(f"curvature at the checkpoint ({op})")


#: References
#: ----------
#: .. [Cohen2021] J. Cohen et al., "Gradient Descent on Neural Networks Typically Occurs at the Edge of
#:    Stability", ICLR 2021.
#: .. [Cohen2022] J. Cohen et al., "Adaptive Gradient Methods at the Edge of Stability", 2022.
#: .. [Gilmer2022] J. Gilmer et al., "A Loss Curvature Perspective on Training Instabilities of Deep Learning
#:    Models", ICLR 2022 (warm-up lowers the sharpness the LR meets).
ADVICE = Advice(
    title="Learning rate above the curvature's limit",
    cause="learning_rate",
    phrase="lambda*lr reaches the optimizer's stability threshold (the LR is too high for this curvature)",
    evidence_keys={"ratio": "stability ratio", "lambda_max": "lambda_max", "lr": "lr", "threshold": "threshold"},
    remedies=(
        "Lower the learning rate by at least the stability ratio (the flag gives the bound lr_max = lr / ratio).",
        "Or warm it up: a longer warm-up lets the sharpness settle below 2/lr before the peak LR.",
        "For Adam, the threshold is on the preconditioned sharpness: raising beta2 or epsilon also lowers it."),
    references=("Cohen et al. 2021, Gradient Descent ... at the Edge of Stability",
                "Cohen et al. 2022, Adaptive Gradient Methods at the Edge of Stability",
                "Gilmer et al. 2022, A Loss Curvature Perspective on Training Instabilities"),
)

ANALYSIS = Analysis(name=NAME, needs=(), compute=compute, flags=flags, plot=plot, kinds={NAME: ADVICE},
                    long_history=True)
