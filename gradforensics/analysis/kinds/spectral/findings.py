"""The spectral analysis's flags: q/k growth (logit scale), gradient rank collapse, alpha out of range.

The severities and their thresholds; the statistics are the package's
(:mod:`gradforensics.analysis.kinds.spectral`).

q/k growth is judged from the weights only where nothing else can judge it better and the weights bound
the logits: where the store holds the *measured* attention logits of the q/k's attention module
(``attn/<module>/max_logit``: the attention analysis's ``attention_logits`` judges them), where a q/k
normalisation sits between the projections and the dot product (the recorder's ``model.qk_norm``:
LayerNorm/RMSNorm modules on q and k), or where the run states a QK-clip (``extra.qk_clip``: the max logit
is clipped to tau after every step), the weights' growth is **context**: its severity is scaled by
:data:`CONTEXT` (below 0.5) and its summary says why.

alpha below the healthy range is judged against what the fit supports and against the run itself
(:func:`alpha_context`): a finding needs alpha below the range by :data:`ALPHA_Z` standard errors of the
fit over a tail of :data:`MIN_TAIL` or more eigenvalues, and a layer that stands out from the model's
other weight matrices (their median alpha inside the range, or this one a robust outlier below them).
Otherwise it is context (scaled by :data:`CONTEXT`) and its summary says why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import AnalysisResult, Flag
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.kinds.spectral.reads import partner_of
from gradforensics.analysis.kinds.spectral.recurrent import recurrent_flags
from gradforensics.analysis.toolkit.flagging import dedupe_heads
from gradforensics.analysis.toolkit.units import head_of, heads_per_tensor, is_experts, where
from gradforensics.errors import GradforensicsError, SpecError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gradforensics.analysis.contract.model import Context

__all__ = ["ALPHA_Z", "CONTEXT", "LOGIT_FULL", "LOGIT_OK", "MIN_TAIL", "NAME", "SpectralOptions", "alpha_context", "alpha_se", "alpha_severity", "collapse_severity",
           "flags", "growth_severity", "logit_severity", "qk_guard", "qk_severity"]

NAME = "spectral"
MIN_TAIL = 10              # alpha with a shorter tail is not flagged
#: Standard errors by which an alpha must sit below the range to be a finding (the fit's support).
ALPHA_Z = 2.0
#: Logit scale (largest attention logit the q/k weights give inputs of unit RMS) below which growth is no flag,
#: and at which the severity is 1 (healthy tiny models trained at ordinary learning rates end near 3-10;
#: their twins at 10x the learning rate at 80-150: docs/calibration.md).
LOGIT_OK = 20.0
LOGIT_FULL = 200.0
#: Scale of a q/k growth severity whose logits are judged elsewhere or bounded (measured logits, a q/k
#: norm, QK-clip): the growth is context, never a finding (< 0.5).
CONTEXT = 0.45
# Embedding tables are lookups, not linear maps: the 2-6 range is not theirs (a healthy
# BERT position-embedding table has alpha 1.55).  Reported, never flagged on alpha.
_EMBEDDING = re.compile(r"embed|(^|[._])(wte|wpe|tok_embeddings)([._]|$)")


@dataclass(frozen=True)
class SpectralOptions(Options):
    """Options of the spectral analysis's flags.

    Parameters
    ----------
    alpha_range
        Healthy range of alpha; outside it a flag is raised (mild above, stronger below).
    growth_half
        Spectral-norm growth ratio (last / first snapshot) of a q/k projection that
        scores severity 0.5; its square scores 1.  Default 3: a q and a k that both
        grow 3-fold let the attention logits grow 9-fold.  Weights that merely
        double from their initialisation stay below 0.5.
    top_k
        ``k`` of the top-k share column.
    min_severity
        Flags below this severity are not emitted.
    """

    alpha_range: tuple[float, float] = (2.0, 6.0)
    growth_half: float = 3.0
    top_k: int = 5
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"growth_half": Interval(float, 1, None, "neither"), "top_k": Interval(int, 1, None)}

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = self.alpha_range                   # a pair in order: not a simple range
        if not 1.0 < lo < hi:
            raise SpecError(f"spectral: alpha_range must be (lo, hi) with 1 < lo < hi; got {self.alpha_range!r}.")



# -------------------------------------------------------------------------- flags
def growth_severity(ratio: float, half: float = 3.0) -> float:
    """0 at no growth, 0.5 at *half*-fold growth, 1 at its square (log scale in between)."""
    if not np.isfinite(ratio) or ratio <= 1.0:
        return 0.0
    return float(min(1.0, 0.5 * np.log(ratio) / np.log(half)))


def logit_severity(scale: float, first: float = math.nan, mid: float = math.nan) -> float:
    """Severity of a q/k pair's logit scale: 0 up to :data:`LOGIT_OK`, 1 at :data:`LOGIT_FULL` (log scale),
    times ``0.7 + 0.3 t`` with ``t`` the trend (1 when it still grew by 25 % or more over the second half of
    the snapshots, 0 when it stopped growing)."""
    if not np.isfinite(scale) or scale <= LOGIT_OK:
        return 0.0
    level = min(1.0, math.log(scale / LOGIT_OK) / math.log(LOGIT_FULL / LOGIT_OK))
    trend = 1.0
    if np.isfinite(mid) and mid > 0:
        trend = float(np.clip(math.log(max(scale / mid, 1e-12)) / math.log(1.25), 0.0, 1.0))
    return level * (0.7 + 0.3 * trend)


def qk_severity(r: dict[str, Any], growth_half: float = 3.0) -> float:
    """A q/k row's growth severity: on the absolute logit scale where its pair has one (the k side of such a
    pair is judged with its q), else on the fold change of its spectral norm (a q/k without its partner)."""
    if r["role"] not in ("q", "k", "qkv"):
        return 0.0
    if bool(r.get("qk_pair", False)):
        return logit_severity(r.get("logit_scale", math.nan), r.get("logit_scale_first", math.nan),
                              r.get("logit_scale_mid", math.nan))
    return growth_severity(r["norm_growth"], growth_half)


def collapse_severity(drop: float) -> float:
    """0.5 when the gradient's stable rank fell 2^1.5 ≈ 2.8-fold, 1 at 8-fold.

    *drop* is the median stable rank of the first half of the windows over the
    last one, counted only when the last two windows both sit below every window
    of the first half (1 otherwise).
    """
    if not np.isfinite(drop) or drop <= 1.0:
        return 0.0
    return float(min(1.0, np.log2(drop) / 3.0))


def alpha_severity(alpha: float, lo: float = 2.0, hi: float = 6.0) -> float:
    """Below *lo*: 0.5 at ``lo - 1/3``, 0.9 at most; above *hi*: mild (at most 0.3, under-trained).

    The level only: whether a level below *lo* is a finding or context is :func:`alpha_context`'s call."""
    if not np.isfinite(alpha):
        return 0.0
    if alpha < lo:
        return float(min(0.9, 1.5 * (lo - alpha)))
    if alpha > hi:
        return float(min(0.3, 0.05 * (alpha - hi)))
    return 0.0


def alpha_se(alpha: float, n_tail: int) -> float:
    """Standard error of the maximum-likelihood power-law exponent, ``(alpha - 1) / sqrt(n_tail)``
    (Clauset, Shalizi & Newman 2009, eq. 3.2); NaN without a fit."""
    if not np.isfinite(alpha) or n_tail <= 0:
        return math.nan
    return float((alpha - 1.0) / math.sqrt(n_tail))


def alpha_context(alpha: float, n_tail: int, peers: Sequence[float], lo: float = 2.0) -> tuple[str, str] | None:
    """Why an alpha below *lo* is context, not a finding, or None (a finding): ``(reason, clause)``.

    A finding needs both

    * **the fit's support** (``"fit"``): a tail of at least :data:`MIN_TAIL` eigenvalues and alpha below
      *lo* by at least :data:`ALPHA_Z` standard errors (:func:`alpha_se`);
    * **a layer that stands out from its run** (``"run"``): *peers*, the alphas of the model's other
      weight matrices (supported fits), have their median inside the range (``>= lo``: the rest of the
      model stays put while this layer's tail grew heavy), or this alpha lies below their median by more
      than :data:`ALPHA_Z` + 1 = 3 times ``sqrt(se² + s²)``, ``s = 1.4826 MAD`` of the peers (a robust
      outlier).  Without peers the fit is all there is.

    Where the whole model sits below *lo*, heavy tails are the run's regime (small matrices learning fast
    grow them in every layer), not one layer's pathology.
    """
    se = alpha_se(alpha, n_tail)
    if n_tail < MIN_TAIL or not np.isfinite(se) or lo - alpha < ALPHA_Z * se:
        return "fit", (f"the fit cannot tell it from {lo:g}: {n_tail} eigenvalues in the tail, standard error "
                       f"{se:.2f} (Clauset et al. 2009), alpha less than {ALPHA_Z:g} standard errors below {lo:g}")
    p = np.asarray([a for a in peers if np.isfinite(a)], dtype=np.float64)
    if p.size == 0:
        return None
    med = float(np.median(p))
    spread = 1.4826 * float(np.median(np.abs(p - med)))
    if med >= lo or med - alpha > (ALPHA_Z + 1) * math.hypot(se, spread):
        return None
    return "run", (f"the rest of the model is heavy-tailed too (median alpha {med:.2f} over {p.size} other weight "
                   f"matrices, spread {spread:.2f}): a heavy tail in every layer is how this run learns, not one "
                   f"layer's trouble")


def _rows(table: Any, matrix: str) -> list[dict[str, Any]]:
    return [r for r in table.to_dict("records") if r["matrix"] == matrix]


def _head(r: dict[str, Any]) -> int | None:
    return head_of(r["head"])


def qk_guard(tensor: str, attn_modules: list[str], norms: list[str], qk_clip: Any = None,
             measured: Any = None) -> tuple[str, str] | None:
    """Why the weight growth of q/k *tensor* is context, or None: ``(reason, clause)``.

    ``"measured"``: a module in *attn_modules* (those with ``attn/<module>/...`` statistics) holds the tensor
    (its name is a prefix of the tensor's); ``"qk_norm"``: a module of *norms* (the recorder's
    ``model.qk_norm``) is a child of a module that holds the tensor (``...attn.q_norm`` beside
    ``...attn.c_attn.weight``); ``"qk_clip"``: the run states a QK-clip threshold.  *measured(module)* gives
    the measured max logit at the end of the run for the clause (None: not said).
    """
    owner = next((m for m in sorted(attn_modules, key=len, reverse=True) if tensor.startswith(m + ".")), None)
    if owner is not None:
        mx = measured(owner) if measured is not None else None
        level = f" (max {mx:.3g} over the last records)" if mx is not None and np.isfinite(mx) else ""
        return "measured", (f"the attention logits of {owner} are measured{level}: they, not this bound, say "
                            f"whether the logits grow (attention_logits), so the weights' growth is context")
    near = [n for n in norms if tensor.startswith(n.rsplit(".", 1)[0] + ".") or "." not in n]
    if near:
        return "qk_norm", (f"a q/k normalisation ({', '.join(near)}) sits between these projections and the dot "
                           f"product: whatever W_Q, W_K do, it bounds the logits, so the weights' growth is context")
    if qk_clip is not None:
        return "qk_clip", (f"the run clips the max attention logit to {qk_clip} (QK-clip): the weights' growth "
                           f"cannot grow the logits past it, so it is context")
    return None


def _measured(ctx: Context) -> Any:
    """``module -> measured max attention logit`` over the last eighth of the records (max over heads)."""
    store = ctx.store

    def read(module: str) -> float | None:
        if store is None:
            return None
        try:
            x = np.asarray(store.read(f"attn/{module}/max_logit"), float)
        except (KeyError, OSError, GradforensicsError):   # unreadable: only the number leaves the clause
            return None
        tail = x[-max(1, len(x) // 8):]
        return float(np.nanmax(tail)) if tail.size and np.isfinite(tail).any() else None

    return read


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Norm growth in q/k projections, gradient rank collapse, alpha outside the healthy range, a recurrent
    weight's spectral norm jumping (:mod:`~gradforensics.analysis.kinds.spectral.recurrent`)."""
    opt = ctx.options_for(NAME, SpectralOptions)
    table = result.table
    out: list[Flag] = []
    weights = _rows(table, "weight")
    whole = {r["tensor"]: r for r in weights if _head(r) is None}
    attn = list(ctx.store.attn_modules) if ctx.store is not None else []
    norms = [str(n) for n in (ctx.meta.model.get("qk_norm") or [])]
    clip = ctx.meta.extra.get("qk_clip")
    measured = _measured(ctx)
    fits = {r["tensor"]: float(r["alpha"]) for r in whole.values()
            if r["alpha_n_tail"] >= MIN_TAIL and np.isfinite(r["alpha"]) and not _EMBEDDING.search(r["tensor"].lower())}
    experts = {t for t in table["tensor"].unique() if is_experts(ctx, str(t))} if len(table) else set()
    # an expert is a matrix of its own: judged as a whole tensor is (alpha, rank collapse), named "expert e"
    own = [r for r in weights if _head(r) is None or r["tensor"] in experts]
    for r in weights:
        sev = qk_severity(r, opt.growth_half)
        if _head(r) is not None:   # a head only when it grows clearly faster than its tensor
            sev = sev if sev - qk_severity(whole[r["tensor"]], opt.growth_half) >= 0.15 else 0
        guard = qk_guard(r["tensor"], attn, norms, clip, measured) if sev >= opt.min_severity else None
        if guard is not None:
            sev = CONTEXT * sev
        if sev >= opt.min_severity:
            out.append(_growth_flag(r, sev, whole, guard))
    for r in own:
        a_flag = _alpha_flag(r, opt, fits)
        if a_flag is not None:
            out.append(a_flag)
    if ctx.meta.mode == "training":
        for r in _rows(table, "gradient"):
            sev = collapse_severity(r["stable_rank_drop"])
            if sev >= opt.min_severity and (_head(r) is None or r["tensor"] in experts):
                out.append(_flag(r, sev, "rank_collapse", (
                    f"{_where(r)}: the window-mean gradient's stable rank fell "
                    f"{r['stable_rank_drop']:.1f}-fold, to {r['stable_rank']:.1f}, between records {r['record_first']} and {r['record_last']}: its "
                    f"updates collapse onto {max(1, round(r['stable_rank']))} direction(s).")))
    out = [_expert(f) if f.tensor in experts else f for f in out]
    n_experts = {t: n for t, n in heads_per_tensor(table).items() if t in experts}
    kept = [f for f in out if f.tensor not in experts]
    for reason in dict.fromkeys(f.evidence.get("reason") for f in out if f.tensor in experts):
        kept += dedupe_heads([f for f in out if f.tensor in experts and f.evidence.get("reason") == reason],
                             n_experts, by_sources=False)
    return kept + recurrent_flags(result, opt.min_severity)


def _where(r: dict[str, Any]) -> str:
    """The row's tensor, with ``head h`` (``expert e`` once :func:`_expert` renames it)."""
    return where(r["tensor"], _head(r))


def _expert(f: Flag) -> Flag:
    """A flag on an expert of a mixture-of-experts unit: ``evidence["expert"]``, its summary says ``expert e``."""
    if f.head is None:
        return f
    head = f"{f.tensor} head {f.head}"
    return replace(f, evidence={**f.evidence, "expert": f.head},
                   summary=f.summary.replace(head, f"{f.tensor} expert {f.head}", 1))


def _alpha_flag(r: dict[str, Any], opt: SpectralOptions, fits: dict[str, float]) -> Flag | None:
    """The alpha flag of a whole tensor's row, or None: a level below the range is a finding only where
    :func:`alpha_context` finds none, else scaled by :data:`CONTEXT` and its summary says why."""
    if _EMBEDDING.search(r["tensor"].lower()) or r["alpha_n_tail"] < MIN_TAIL:
        return None
    lo, hi = opt.alpha_range
    sev = alpha_severity(r["alpha"], lo, hi)
    if sev < opt.min_severity:
        return None
    n_tail = int(r["alpha_n_tail"])
    se = alpha_se(r["alpha"], n_tail)
    text = (f"{_where(r)}: the eigenvalue spectrum of WᵀW has power-law exponent alpha={r['alpha']:.2f} "
            f"(± {se:.2f} over a tail of {n_tail} eigenvalues) at record {r['record_last']}, outside the healthy "
            f"{lo:g}-{hi:g}: ")
    why = None
    if r["alpha"] < lo:
        why = alpha_context(r["alpha"], n_tail, [a for t, a in fits.items() if t != r["tensor"]], lo)
        text += "a very heavy tail, typical of an over-fit or ill-conditioned layer"
    else:
        text += "a random-like, under-trained layer"
    if why is not None:
        sev = CONTEXT * sev
        text = text.replace(", typical of an over-fit or ill-conditioned layer", "") + f"; but {why[1]}: context"
    if sev < opt.min_severity:
        return None
    f = _flag(r, sev, "alpha", text + ".")
    ev = {**f.evidence, "alpha_n_tail": n_tail, "alpha_se": se}
    if why is not None:
        ev["context"] = why[0]
    return replace(f, evidence=ev)


def _flag(r: dict[str, Any], sev: float, reason: str, summary: str) -> Flag:
    ev = {k: r[k] for k in ("matrix", "sigma_max", "norm_growth", "stable_rank", "stable_rank_first", "alpha",
                            "alpha_ks", "exact")}
    ev["reason"] = reason
    return Flag(kind="spectral", tensor=r["tensor"], head=_head(r), sources=(), severity=float(sev),
                records=(int(r["record_first"]), int(r["record_last"])), evidence=ev, summary=summary)


def _growth_flag(r: dict[str, Any], sev: float, whole: dict[str, dict[str, Any]],
                 guard: tuple[str, str] | None = None) -> Flag:
    f = _weight_growth_flag(r, sev, whole)
    if guard is None:
        return f
    text = f.summary[:-1]
    for clause in (": softmax saturates there, watch for entropy collapse, consider QK-norm",
                   ": watch for entropy collapse, consider QK-norm"):
        text = text.replace(clause, "")
    return replace(f, summary=text + f"; but {guard[1]}.", evidence={**f.evidence, "context": guard[0]})


def _weight_growth_flag(r: dict[str, Any], sev: float, whole: dict[str, dict[str, Any]]) -> Flag:
    partner = partner_of(r["tensor"])
    pr = whole.get(partner) if partner else None
    text = (f"{_where(r)}: spectral norm grew x{r['norm_growth']:.2f} ({r['sigma_max_first']:.3g} -> {r['sigma_max']:.3g}) "
            f"between records {r['record_first']} and {r['record_last']}")
    if np.isfinite(r.get("logit_scale", math.nan)):
        text += (f"; its q/k weights can now give an attention logit of {r['logit_scale']:.3g} to inputs of unit RMS "
                 f"(‖W_Qᵀ W_K‖₂ d/√d_head; {r['logit_scale_mid']:.3g} half-way, {r['logit_scale_first']:.3g} at "
                 f"the start): softmax saturates there, watch for entropy collapse, consider QK-norm")
        f = _flag(r, sev, "norm_growth", text + ".")
        return replace(f, evidence={**f.evidence, "logit_scale": r["logit_scale"], "cause": "attention"})
    if pr is not None and np.isfinite(pr["norm_growth"]):
        text += (f"; with {partner} (x{pr['norm_growth']:.2f}) the attention logits can grow "
                 f"x{r['norm_growth'] * pr['norm_growth']:.2f}: watch for entropy collapse, consider QK-norm")
    f = _flag(r, sev, "norm_growth", text + ".")
    f = replace(f, evidence={**f.evidence, "cause": "attention"})
    if pr is not None:
        return replace(f, evidence={**f.evidence, "partner": partner, "partner_growth": pr["norm_growth"]})
    return f

