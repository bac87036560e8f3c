"""Attention-logit growth and entropy collapse, per head (``attn/<module>/<stat>``).

Capture keeps, per record and head, the largest pre-softmax logit ``q·k/√d`` (after
RoPE, within the mask), the mean and minimum attention entropy over queries,
normalised by ``log n`` (1 uniform, 0 one-hot), and the share of one-hot queries
(:mod:`gradforensics.recording.attention`).  Per head, over windows of records:

* **entropy collapse** (kind ``attention_collapse``): the head's mean entropy at the
  end is near zero (severity 0.5 at 0.12, 1 at 0) or far below the median of the
  model's other heads (0.5 at 15 % of it) - *and* its logits are large: in
  training grown tenfold or more to a max logit of ~17 (0.5; 1 from 30 and a
  hundredfold), in replay beyond what healthy sharp heads reach (0.5 at ~95).  A
  sharp head with moderate logits (a healthy previous-token or sink head) is not a
  collapse, a one-hot head driven by growing logits is (Zhai et al. 2023;
  Dehghani et al. 2023).
* **logit growth** (kind ``attention_logits``; training): the windowed max logit
  rises (Spearman, p < 0.01), by a fold change from the opening window to the
  closing one, to a large value (severity 0.5 at ~95 and a tenfold rise, 1 at 300
  and a hundredfold); ``since_record`` is the first record from which it stays at
  twice its opening level.  In a replay store (one checkpoint) the same kind names
  the heads whose max logit is out of line with the model's other heads (0.5 at 4x
  their median, with the same level gate).

In training a collapse needs logits that grew: it is their growth seen in the entropy.
The head's ``attention_logits`` flag carries the larger of the two severities and its
``attention_collapse`` flag follows at :data:`SYMPTOM` of its own, so the cause leads.
Where these statistics are captured they, not the q/k weights' bound, judge the logits
(the spectral analysis's q/k growth is then context).

The fixes in the advice are the standard ones: QK-norm / QK-layernorm (Dehghani et
al. 2023; Wortsman et al. 2023), QK-clip at τ (rescale W_Q, W_K of a head whose max
logit exceeds τ, Kimi K2 2025), the z-loss, a lower learning rate on W_Q/W_K.

References
----------
Dehghani, M. et al. (2023). Scaling vision transformers to 22 billion parameters. ICML.
Zhai, S. et al. (2023). Stabilizing transformer training by preventing attention entropy collapse. ICML.
Wortsman, M. et al. (2023). Small-scale proxies for large-scale transformer training instabilities.
Kimi Team (2025). Kimi K2: open agentic intelligence (MuonClip / QK-clip).
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
from gradforensics.analysis.toolkit.stats import rank_trend

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.store.reader import Store

__all__ = ["ADVICE_COLLAPSE", "ADVICE_LOGITS", "ANALYSIS", "COLUMNS", "NAME", "SYMPTOM", "WINDOWS", "AttentionOptions",
           "collapse_severity", "compute", "flags", "head_rows", "lazy", "logit_level", "logits_severity", "plot"]


NAME = "attention"
WINDOWS = 32
#: In training, a head's collapse is reported at this share of its severity, under its logit growth (the cause).
SYMPTOM = 0.95


@dataclass(frozen=True)
class AttentionOptions(Options):
    """Options of the attention flags.

    Parameters
    ----------
    tau
        The QK-clip threshold the advice states (max logit a head is clipped to).
    trend_p
        Significance of the Spearman trend of the windowed max logit (training).
    min_severity
        Flags below this severity are not emitted.
    """

    tau: float = 100.0
    trend_p: float = 0.01
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"tau": Interval(float, 0, None, "neither"),
                                          "trend_p": Interval(float, 0, 0.5, "neither")}


# ---------------------------------------------------------------------- lazy pass
def lazy(store: Store) -> dict[str, Any]:
    """Per module and window of records: max of max_logit, mean of entropy_mean and onehot_frac, min of entropy_min."""
    out: dict[str, Any] = {}
    if not store.attn_modules:
        return out          # no attention statistics: dask.array is not imported for nothing
    import dask.array as da

    edges = window_edges(store.n_records, WINDOWS)
    for m in store.attn_modules:
        parts = {"max": ("max_logit", da.nanmax), "ent": ("entropy_mean", da.nanmean),
                 "emin": ("entropy_min", da.nanmin), "onehot": ("onehot_frac", da.nanmean)}
        for key, (stat, fn) in parts.items():
            x = store.lazy(f"attn/{m}/{stat}")
            out[f"{key}|{m}"] = da.stack([fn(x[a:b], axis=0) for a, b in itertools.pairwise(edges)])
    return out


# ------------------------------------------------------------------ severities
def _clip(x: float) -> float:
    return float(np.clip(x, 0.0, 1.0)) if np.isfinite(x) else 0.0


def logit_level(max_logit: float, low: float, high: float) -> float:
    """0 at or below *low*, 1 at or above *high*, log-linear between."""
    if not np.isfinite(max_logit) or max_logit <= low:
        return 0.0
    return _clip(np.log(max_logit / low) / np.log(high / low))


def collapse_severity(row: dict[str, Any], training: bool, trend_p: float) -> tuple[float, dict[str, float]]:
    """min(low entropy, large logits); low = max(near zero, far below the other heads).

    "Large logits": in training, logits that *grew* to where they make attention
    one-hot (a significant rise, tenfold or more, to 17+: 0.5; 30+ and a hundredfold: 1);
    in replay, where one checkpoint shows no growth, logits beyond what sharp heads of
    healthy models reach (0.5 at ~95, 1 at 300; all-MiniLM-L6-v2's sharpest head: 45).
    """
    near_zero = _clip((0.24 - row["entropy"]) / 0.24)
    rel = row["rel_entropy"]
    below = _clip(1.0 - rel / 0.3) if np.isfinite(rel) else 0.0
    if training:
        rising = np.isfinite(row["trend_p"]) and row["trend_p"] < trend_p and row["trend_rho"] > 0
        grown = _clip(np.log10(max(row["growth"], 1.0))) if rising else 0.0
        large = min(logit_level(row["max_logit"], 10.0, 30.0), grown)
    else:
        large = logit_level(row["max_logit"], 30.0, 300.0)
    parts = {"near_zero": near_zero, "below_others": below, "large_logits": large}
    return min(max(near_zero, below), large), parts


def logits_severity(row: dict[str, Any], training: bool, trend_p: float) -> tuple[float, dict[str, float]]:
    """Training: min(fold change, level) when the trend is significant; replay: min(out of line, level)."""
    level = logit_level(row["max_logit"], 30.0, 300.0)
    if training:
        rising = np.isfinite(row["trend_p"]) and row["trend_p"] < trend_p and row["trend_rho"] > 0
        fold = _clip(np.log10(max(row["growth"], 1.0)) / 2.0) if rising else 0.0
        return min(fold, level), {"fold": fold, "level": level}
    ratio = row["logit_ratio"]
    out_of_line = _clip(np.log(ratio / 2.0) / np.log(4.0)) if np.isfinite(ratio) and ratio > 2.0 else 0.0
    return min(out_of_line, level), {"out_of_line": out_of_line, "level": level}


# ------------------------------------------------------------------------ compute
def _onset(series: np.ndarray, edges: np.ndarray) -> int | None:
    """First record from which the windowed series stays at or above twice its opening window."""
    s = np.asarray(series, float)
    if s.size < 3 or not np.isfinite(s[0]) or s[0] <= 0:
        return None
    below = np.flatnonzero(~(s >= 2.0 * s[0]))
    start = int(below[-1]) + 1 if below.size else 0
    return int(edges[start]) if start < s.size else None


def head_rows(module: str, mx: np.ndarray, ent: np.ndarray, emin: np.ndarray, onehot: np.ndarray,
              edges: np.ndarray, training: bool) -> list[dict[str, Any]]:
    """One row per head of *module* from its windowed (W, H) statistics (relative columns filled later)."""
    rows = []
    for h in range(mx.shape[1]):
        first, last = float(mx[0, h]), float(np.nanmax(mx[:, h]) if not training else mx[-1, h])
        rho, p = rank_trend(mx[:, h], min_n=6, skip_nonfinite=True) if training else (np.nan, np.nan)
        growth = last / max(first, 1e-6) if training and np.isfinite(first) else np.nan
        rows.append({
            "tensor": module, "head": h, "max_logit": last, "max_logit_first": first,
            "entropy": float(ent[-1, h]), "entropy_first": float(ent[0, h]), "entropy_min": float(emin[-1, h]),
            "onehot_frac": float(onehot[-1, h]), "growth": growth, "trend_rho": rho, "trend_p": p,
            "since_record": _onset(mx[:, h], edges) if training and growth >= 2 else None,
        })
    return rows


def _relative(rows: list[dict[str, Any]]) -> None:
    """Each head's entropy over the median of the model's other heads, and its max logit likewise."""
    ent = np.array([r["entropy"] for r in rows], float)
    mx = np.array([r["max_logit"] for r in rows], float)
    for i, r in enumerate(rows):
        others = np.delete(np.arange(len(rows)), i)
        med_e = float(np.nanmedian(ent[others])) if others.size else np.nan
        med_m = float(np.nanmedian(mx[others])) if others.size else np.nan
        layer = [j for j in others if rows[j]["tensor"] == r["tensor"]]
        r["entropy_others"] = med_e
        r["entropy_layer"] = float(np.nanmedian(ent[layer])) if layer else np.nan
        r["rel_entropy"] = r["entropy"] / med_e if med_e > 0 else np.nan
        r["logit_ratio"] = r["max_logit"] / med_m if med_m > 0 else np.nan


COLUMNS = ["tensor", "head", "max_logit", "entropy", "growth", "since_record", "max_logit_first", "entropy_first",
           "entropy_min", "onehot_frac", "entropy_layer", "entropy_others", "rel_entropy", "logit_ratio",
           "trend_rho", "trend_p", "qk_tensors"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    lz = ctx.computed.get(NAME, {})
    edges = window_edges(ctx.n_records, WINDOWS)
    training = ctx.meta.mode == "training"
    rows: list[dict[str, Any]] = []
    series: dict[str, np.ndarray] = {}
    tensors = ctx.store.tensors if ctx.store is not None else []
    for m in sorted(k.split("|", 1)[1] for k in lz if k.startswith("max|")):
        w = {k: np.asarray(lz[f"{k}|{m}"], float) for k in ("max", "ent", "emin", "onehot")}
        new = head_rows(m, w["max"], w["ent"], w["emin"], w["onehot"], edges, training)
        for r in new:
            r["qk_tensors"] = ", ".join(t for t in tensors if t.startswith(m + ".") and _is_qk(t))
        rows.extend(new)
        series.update({f"max_logit/{m}": w["max"], f"entropy/{m}": w["ent"], f"window_edges/{m}": edges})
    _relative(rows)
    return AnalysisResult(table=pd.DataFrame(rows, columns=COLUMNS), series=series)


def _is_qk(tensor: str) -> bool:
    leaf = tensor.rsplit(".", 2)[-2] if tensor.count(".") >= 2 else tensor
    return leaf in ("q_proj", "k_proj", "query", "key", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


# -------------------------------------------------------------------------- flags
def _fmt(x: Any, spec: str = ".3g") -> str:
    try:
        return format(float(x), spec) if np.isfinite(float(x)) else "n/a"
    except (TypeError, ValueError):
        return "n/a"


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Per head: a collapse flag and a logit flag where their severities reach ``min_severity``."""
    opt = ctx.options_for(NAME, AttentionOptions)
    training = ctx.meta.mode == "training"
    last = ctx.n_records - 1
    out: list[Flag] = []
    for row in result.table.to_dict("records"):
        base = {k: row[k] for k in ("max_logit", "entropy", "entropy_min", "onehot_frac", "growth", "entropy_layer",
                                    "entropy_others", "logit_ratio")}
        base["tau"] = opt.tau
        qk = f"; its q/k projections: {row['qk_tensors']} (their spectral growth, if flagged, is this head's)" \
            if row["qk_tensors"] else ""
        where = f"{row['tensor']} head {row['head']}"
        sev, parts = collapse_severity(row, training, opt.trend_p)
        lsev, lparts = logits_severity(row, training, opt.trend_p)
        if training and sev > lsev:
            # in training a collapse needs logits that grew: it is their growth seen in the entropy, so the
            # growth (the cause) carries the head's severity and the collapse (the symptom) ranks just below
            lsev, lparts = sev, lparts | {"collapse": sev}
        if training:
            sev = SYMPTOM * sev
        if sev >= opt.min_severity:
            text = (f"{where}: attention entropy {_fmt(row['entropy'], '.3f')} (normalised; the model's other heads "
                    f"{_fmt(row['entropy_others'], '.2f')}), {_fmt(row['onehot_frac'], '.0%')} of queries one-hot, "
                    f"max logit {_fmt(row['max_logit'])}{qk}.")
            out.append(Flag("attention_collapse", row["tensor"], int(row["head"]), (), sev, (0, last),
                            base | parts, text))
        sev, parts = lsev, lparts
        if sev >= opt.min_severity:
            since = row["since_record"]
            since = int(since) if since is not None and np.isfinite(since) else 0
            grew = (f"grew {_fmt(row['max_logit_first'])} -> {_fmt(row['max_logit'])} ({_fmt(row['growth'], '.1f')}x)"
                    f" since record {since}" if training else
                    f"is {_fmt(row['max_logit'])}, {_fmt(row['logit_ratio'], '.1f')}x the median of the other heads")
            clip = (f"; QK-clip at tau={opt.tau:g} would scale its W_Q, W_K by "
                    f"{np.sqrt(opt.tau / row['max_logit']):.2f}" if row["max_logit"] > opt.tau else "")
            text = f"{where}: max attention logit {grew}; entropy {_fmt(row['entropy'], '.3f')}{clip}{qk}."
            out.append(Flag("attention_logits", row["tensor"], int(row["head"]), (), sev, (since, last),
                            base | parts, text))
    return out


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """The head's windowed max logit (log scale) with its entropy on a twin axis; the module's other heads faint."""
    m, h = flag.tensor, int(flag.head or 0)
    mx = np.asarray(result.series[f"max_logit/{m}"], float)
    ent = np.asarray(result.series[f"entropy/{m}"], float)
    edges = np.asarray(result.series[f"window_edges/{m}"], float)
    x = (edges[:-1] + edges[1:]) / 2
    for j in range(mx.shape[1]):
        if j != h:
            ax.plot(x, np.clip(mx[:, j], 1e-3, None), color="0.75", lw=0.8)
    ax.plot(x, np.clip(mx[:, h], 1e-3, None), color="C3", lw=1.5, label=f"head {h} max logit")
    ax.set_yscale("log")
    ax.set_xlabel("record")
    ax.set_ylabel("max attention logit q.k/sqrt(d)")
    twin = ax.twinx()
    twin.plot(x, ent[:, h], color="C0", ls="--", label=f"head {h} entropy")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("normalised entropy (1 uniform, 0 one-hot)")
    ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="lower left")
    ax.set_title(f"{m} head {h}: attention logits and entropy", fontsize=9)


_REMEDIES = (
    "Normalise queries and keys (QK-norm / QK-layernorm: LayerNorm or RMSNorm on q and k per head before q.k), "
    "which bounds the logits whatever W_Q, W_K do.",
    "Clip the logits of this head: QK-clip rescales W_Q and W_K of a head whose max logit exceeds tau "
    "(the evidence's tau, e.g. 100) by sqrt(tau / max logit) after each step.",
    "Lower the learning rate on W_Q/W_K (or the peak LR / longer warm-up) and add the z-loss (1e-4 * log^2 Z) "
    "on the output logits.",
)
_REFS = ("Dehghani et al. 2023, Scaling Vision Transformers to 22 Billion Parameters (QK-layernorm)",
         "Zhai et al. 2023, Stabilizing Transformer Training by Preventing Attention Entropy Collapse",
         "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
         "Kimi Team 2025, Kimi K2 (QK-clip)")

#: A head whose attention went one-hot with large logits.
ADVICE_COLLAPSE = Advice(
    title="Attention entropy collapse",
    cause="attention",
    phrase="attention heads have collapsed to one-hot attention",
    evidence_keys={"entropy": "entropy", "max_logit": "max logit", "onehot_frac": "one-hot share",
                   "entropy_others": "other heads' entropy"},
    remedies=_REMEDIES, references=_REFS)

#: A head whose max attention logit grows (training) or is out of line (replay).
ADVICE_LOGITS = Advice(
    title="Attention logit growth",
    cause="attention",
    phrase="attention logits grow without bound",
    evidence_keys={"max_logit": "max logit", "growth": "fold change", "logit_ratio": "x other heads",
                   "entropy": "entropy"},
    remedies=_REMEDIES, references=_REFS)

ANALYSIS = Analysis(name=NAME, needs=(Need.ACTS,), compute=compute, flags=flags, plot=plot, lazy=lazy,
                    kinds={"attention_collapse": ADVICE_COLLAPSE, "attention_logits": ADVICE_LOGITS},
                    options=AttentionOptions, long_history=True)
