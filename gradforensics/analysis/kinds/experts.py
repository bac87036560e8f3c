"""Mixture-of-experts routing: collapse, dead and overloaded experts, a starved router (``router/<module>/*``).

Capture keeps, per record and router, each expert's share of the top-k assignments
(``load`` ``(N, E)``, sums to 1; attributes ``experts`` E and ``top_k`` k), its largest
share ``max_share`` and the entropy of the mean routing distribution (:mod:`gradforensics.recording.experts`).
Per router module, over the records (the *tail* is the last ``max(3, ceil(N / 8))`` records, its
median the level "now"):

* **concentration** ``c = (max_share - 1/E) / (1/k - 1/E)``: 0 is balanced routing (every expert
  its fair 1/E of the assignments), 1 the ceiling (one expert in every token's top k, share 1/k).
  The issue's "max share above 0.85" (top-1, E = 8) is ``c = 0.83``;
* **normalised entropy** ``h = entropy / log E``: 1 uniform mean routing, 0 collapse;
* **routing collapse** severity ``max(clip((c_tail - 0.4) / 0.6), clip((0.7 - h_tail) / 0.4))``:
  0.5 at ``c = 0.7`` or ``h = 0.5``, 1 at ``c = 1`` or ``h = 0.3``.  ``since_record``: the first
  record from which the concentration stays above its opening level plus a fifth of its rise
  (the opening: the median of the first tail-length records); the first record when it did not rise;
* **dead experts**: an expert whose load is 0 on each of the last ``K`` records or more
  (``K = DEAD_RECORDS = 8``, or a quarter of a shorter run, at least 3; records without tokens are
  skipped).  Severity ``0.5 + 0.5 * min(1, 2 d / E)`` for ``d`` dead experts: one dead of 8 is 0.62,
  a quarter of them 0.75, half 1;
* **overloaded experts**: tail-median load above ``min(2 / E, (1/E + 1/k) / 2)`` (twice the fair
  share, or half-way from it to the ceiling when top-k leaves less room).  They are named; their
  severity is the collapse severity (the top expert's share is the concentration);
* **starved router**: per record the router weight's gradient RMS (``sqrt(K_ii / size)`` of the Gram
  pass) over the median RMS of the expert units of the same layer (units ``grads/<unit>`` with attribute
  ``experts`` under the router's parent module; every experts unit when none is); ``grad_ratio`` is
  the median over the records.  Severity ``clip((-2 - log10 grad_ratio) / 4)``: 0 down to 1e-2, 0.5 at
  1e-4, 1 from 1e-6 (top-1 routing with normalised top-k weights gave 7e-10 against 1e-2 once fixed);
* **by source** (two sources or more, records of one source each): each source's mean load over the
  tail; ``source_spread`` the largest difference between two sources' loads of one expert over 1/k
  (1: one source sends all its tokens to the expert, the other none).  Sources of different domains
  routing to different experts is specialisation, the base rate: the spread is context (severity at
  most 0.45), named in the flag (its sources) when at least 0.5.

The router's flag carries the largest severity.  Fewer than :data:`MIN_RECORDS` records: not judged.
The gradient ratio needs the per-record Gram diagonal: above ``N₀`` (long history) it is NaN.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need, NotJudged
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.kspace import window_edges

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "DEAD_RECORDS", "MIN_RECORDS", "NAME", "ExpertsOptions",
           "collapse_severity", "compute", "concentration", "dead_experts", "dead_severity", "flags",
           "grad_severity", "onset_record", "overload_level", "plot"]

NAME = "experts"
MIN_RECORDS = 8
DEAD_RECORDS = 8
WINDOWS = 48
CONCENTRATION_LEVEL = 0.7      # severity 0.5
ENTROPY_LEVEL = 0.5            # severity 0.5
SOURCE_MAX = 0.45              # source spread is context
SOURCE_NAMED = 0.5             # a spread from which the flag names the two sources


@dataclass(frozen=True)
class ExpertsOptions(Options):
    """Options of the experts flags.

    Parameters
    ----------
    min_severity
        Flags below this severity are not emitted.
    dead_records
        K: an expert with load 0 on each of the last K records (or more) is dead.
    """

    min_severity: float = 0.1
    dead_records: int = DEAD_RECORDS

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"min_severity": Interval(float, 0, 1, "both"),
                                          "dead_records": Interval(int, 1, None)}


# --------------------------------------------------------------------- statistics
def concentration(share: Any, experts: int, top_k: int) -> np.ndarray:
    """``(share - 1/E) / (1/k - 1/E)``: 0 balanced, 1 one expert in every token's top k (NaN when k >= E)."""
    s = np.asarray(share, float)
    if top_k >= experts:
        return np.full(s.shape, np.nan)
    return (s - 1.0 / experts) / (1.0 / top_k - 1.0 / experts)


def collapse_severity(conc: float, entropy_norm: float) -> float:
    """``max(clip((c - 0.4) / 0.6), clip((0.7 - h) / 0.4))``: 0.5 at c = 0.7 or h = 0.5."""
    a = (conc - 0.4) / 0.6 if np.isfinite(conc) else 0.0
    b = (0.7 - entropy_norm) / 0.4 if np.isfinite(entropy_norm) else 0.0
    return float(np.clip(max(a, b), 0.0, 1.0))


def dead_severity(n_dead: int, experts: int) -> float:
    """``0.5 + 0.5 * min(1, 2 d / E)`` for d > 0 dead experts, else 0."""
    return 0.0 if n_dead <= 0 else float(0.5 + 0.5 * min(1.0, 2.0 * n_dead / experts))


def grad_severity(ratio: float) -> float:
    """``clip((-2 - log10 ratio) / 4)``: 0 down to 1e-2, 0.5 at 1e-4, 1 from 1e-6 (0 ratio: 1)."""
    if not np.isfinite(ratio) or ratio < 0:
        return 0.0
    if ratio == 0:
        return 1.0
    return float(np.clip((-2.0 - math.log10(ratio)) / 4.0, 0.0, 1.0))


def overload_level(experts: int, top_k: int) -> float:
    """The load above which an expert is overloaded: ``min(2/E, (1/E + 1/k) / 2)``."""
    return min(2.0 / experts, (1.0 / experts + 1.0 / top_k) / 2.0)


def dead_experts(load: np.ndarray, k_records: int) -> dict[int, int]:
    """Expert -> first record of its trailing run of zero load, for runs of at least *k_records* records
    (records whose load is NaN, no tokens, are skipped)."""
    ok = np.flatnonzero(np.isfinite(load).all(axis=1))
    out: dict[int, int] = {}
    if ok.size < k_records:
        return out
    zero = load[ok] == 0
    for e in range(load.shape[1]):
        nz = np.flatnonzero(~zero[:, e])
        start = int(nz[-1]) + 1 if nz.size else 0
        if ok.size - start >= k_records:
            out[e] = int(ok[start])
    return out


def onset_record(conc: np.ndarray, tail: int) -> int:
    """First record from which the concentration stays above its opening level plus a fifth of its rise
    (windowed over :data:`WINDOWS` windows); 0 when it did not rise by 0.1."""
    c = np.asarray(conc, float)
    fin = c[np.isfinite(c)]
    if fin.size < 2 * tail:
        return 0
    open_, close = float(np.median(fin[:tail])), float(np.median(fin[-tail:]))
    if close - open_ < 0.1:
        return 0
    edges = window_edges(c.size, WINDOWS)
    w = np.array([np.nanmedian(c[a:b]) if np.isfinite(c[a:b]).any() else np.nan for a, b in itertools.pairwise(edges)])
    below = np.flatnonzero(~(w > open_ + 0.2 * (close - open_)))
    start = int(below[-1]) + 1 if below.size else 0
    return int(edges[min(start, w.size - 1)])


def _layer_units(store: Any, router: str) -> list[str]:
    units = [t for t in store.tensors if store.experts_of(t)]
    parent = router.rpartition(".")[0]
    mine = [t for t in units if parent and t.startswith(parent + ".")]
    return mine or units


def _rms(ctx: Context, tensor: str) -> np.ndarray | None:
    g = ctx.grams.get((tensor, None)) if ctx.grams else None
    if g is None or not g.n_features:
        return None
    d = np.maximum(np.diag(np.asarray(g.gram, np.float64)), 0.0) / float(g.n_features)
    return np.where(np.asarray(g.nonfinite) == 0, np.sqrt(d), np.nan)


def _grad_ratio(ctx: Context, store: Any, router: str) -> tuple[float, float, float]:
    """(median ratio, median router RMS, median expert-unit RMS) over the records; NaN without Gram matrices."""
    r = _rms(ctx, f"{router}.weight")
    units = [u for u in (_rms(ctx, t) for t in _layer_units(store, router)) if u is not None]
    if r is None or not units:
        return np.nan, np.nan, np.nan
    peer = np.median(np.stack(units), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = r / peer
    ok = np.isfinite(ratio) & (peer > 0)
    if not ok.any():
        return np.nan, np.nan, np.nan
    return float(np.median(ratio[ok])), float(np.median(r[ok])), float(np.median(peer[ok]))


def _by_source(ctx: Context, load: np.ndarray, tail: int, top_k: int) -> tuple[float, int, tuple[str, ...], dict]:
    """(source spread, its expert, its two sources, each source's tail mean load)."""
    if len(ctx.sources) < 2 or "mixture" not in ctx.batches:
        return np.nan, -1, (), {}
    src = ctx.source_of_record()
    per: dict[str, np.ndarray] = {}
    for s, name in enumerate(ctx.sources):
        rows = np.flatnonzero(src == s)
        rows = rows[np.isfinite(load[rows]).all(axis=1)][-tail:]
        if rows.size:
            per[name] = load[rows].mean(axis=0)
    if len(per) < 2:
        return np.nan, -1, (), per
    names = list(per)
    m = np.stack([per[n] for n in names])
    e = int(np.argmax(m.max(axis=0) - m.min(axis=0)))
    hi, lo = names[int(np.argmax(m[:, e]))], names[int(np.argmin(m[:, e]))]
    return float((m[:, e].max() - m[:, e].min()) * top_k), e, (hi, lo), per


COLUMNS = ["tensor", "head", "experts", "top_k", "max_share_first", "max_share_last", "concentration_first",
           "concentration", "entropy_norm_first", "entropy_norm", "since_record", "since_step", "top_expert",
           "overloaded", "dead", "dead_since", "n_dead", "grad_ratio", "router_grad_rms", "expert_grad_rms",
           "source_spread", "source_expert", "source_pair", "aux_loss_first", "aux_loss_last",
           "model_aux_loss_first", "model_aux_loss_last", "collapse_severity", "dead_severity",
           "grad_severity", "source_severity", "severity"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    store = ctx.store
    modules = store.router_modules if store is not None else []
    n = ctx.n_records
    opt = ctx.options_for(NAME, ExpertsOptions)
    steps = np.asarray(ctx.batches.get("step", np.arange(n)), float)
    rows: list[dict[str, Any]] = []
    series: dict[str, np.ndarray] = {}
    not_judged: list[NotJudged] = []
    if modules and n < MIN_RECORDS:
        not_judged.append(NotJudged(NAME, f"{n} records with router statistics", f"≥ {MIN_RECORDS} records"))
        modules = []
    tail = max(3, math.ceil(n / 8))
    k_dead = min(opt.dead_records, max(3, n // 4))
    edges = window_edges(n, WINDOWS)
    model_aux = store.model_aux_loss() if store is not None and modules else None
    model_aux = np.full(n, np.nan) if model_aux is None else np.asarray(model_aux, float)
    for m in modules:
        assert store is not None
        load = np.asarray(store.router(m, "load"), float)
        attrs = store.arrays[f"router/{m}/load"].attrs
        experts = int(attrs.get("experts") or load.shape[1])
        top_k = int(attrs.get("top_k") or 1)
        share = np.asarray(store.router(m, "max_share"), float)
        hnorm = np.asarray(store.router(m, "entropy"), float) / math.log(experts) if experts > 1 else np.full(n, np.nan)
        conc = concentration(share, experts, top_k)
        aux = np.asarray(store.router(m, "aux_loss"), float) if store.has(f"router/{m}/aux_loss") else np.full(n, np.nan)
        fin = np.isfinite(load).all(axis=1)
        tail_load = np.nanmedian(load[fin][-tail:], axis=0) if fin.any() else np.full(experts, np.nan)

        def med(x: np.ndarray, last: bool = True) -> float:
            v = x[np.isfinite(x)]
            return float(np.median(v[-tail:] if last else v[:tail])) if v.size else np.nan

        c_last, h_last = med(conc), med(hnorm)
        since = onset_record(conc, tail)
        dead = dead_experts(load, k_dead)
        over = [int(e) for e in np.flatnonzero(tail_load > overload_level(experts, top_k))]
        ratio, r_rms, e_rms = _grad_ratio(ctx, store, m)
        spread, s_exp, pair, per = _by_source(ctx, load, tail, top_k)
        sev_c = collapse_severity(c_last, h_last)
        sev_d = dead_severity(len(dead), experts)
        sev_g = grad_severity(ratio)
        sev_s = float(np.clip(spread, 0.0, 1.0)) * SOURCE_MAX if np.isfinite(spread) else 0.0
        rows.append({
            "tensor": m, "head": None, "experts": experts, "top_k": top_k, "max_share_first": med(share, False),
            "max_share_last": med(share), "concentration_first": med(conc, False), "concentration": c_last,
            "entropy_norm_first": med(hnorm, False), "entropy_norm": h_last, "since_record": since,
            "since_step": int(steps[since]) if since < steps.size else None,
            "top_expert": int(np.nanargmax(tail_load)) if np.isfinite(tail_load).any() else -1,
            "overloaded": " ".join(map(str, over)), "dead": " ".join(map(str, sorted(dead))),
            "dead_since": min(dead.values()) if dead else None, "n_dead": len(dead), "grad_ratio": ratio,
            "router_grad_rms": r_rms, "expert_grad_rms": e_rms, "source_spread": spread, "source_expert": s_exp,
            "source_pair": " ".join(pair), "aux_loss_first": med(aux, False), "aux_loss_last": med(aux),
            "model_aux_loss_first": med(model_aux, False), "model_aux_loss_last": med(model_aux),
            "collapse_severity": sev_c, "dead_severity": sev_d,
            "grad_severity": sev_g, "source_severity": sev_s, "severity": max(sev_c, sev_d, sev_g, sev_s)})
        wl = np.stack([np.nanmean(load[a:b], axis=0) if fin[a:b].any() else np.full(experts, np.nan)
                       for a, b in itertools.pairwise(edges)])
        series[f"load/{m}"] = wl
        series[f"window_edges/{m}"] = edges
        if per:                  # by source: windows of about 2 records per source
            src = ctx.source_of_record()
            sedges = window_edges(n, max(2, n // (2 * len(ctx.sources))))
            series[f"source_edges/{m}"] = sedges
            for s, name in enumerate(ctx.sources):
                if name in per:
                    sl = []
                    for a, b in itertools.pairwise(sedges):
                        v = load[a:b][(src[a:b] == s) & fin[a:b]]
                        sl.append(v.mean(axis=0) if v.size else np.full(experts, np.nan))
                    series[f"load/{m}/{name}"] = np.stack(sl)
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["head"] = table["head"].astype("Int64")
    return AnalysisResult(table=table, series=series, not_judged=not_judged)


# ---------------------------------------------------------------------------- flags
def _fmt(x: Any, spec: str = ".3g") -> str:
    try:
        return format(float(x), spec) if np.isfinite(float(x)) else "n/a"
    except (TypeError, ValueError):
        return "n/a"


def _ints(s: Any) -> list[int]:
    return [int(v) for v in str(s).split()] if isinstance(s, str) and s else []


def _aux_text(row: dict[str, Any]) -> str:
    """", load-balancing loss a -> b (k balanced, E collapsed)" from the layer's aux loss (empty without it)."""
    if not np.isfinite(float(row["aux_loss_last"])):
        return ""
    text = (f", its load-balancing loss {_fmt(row['aux_loss_first'])} -> {_fmt(row['aux_loss_last'])} "
            f"({row['top_k']} balanced, up to {row['experts']} collapsed)")
    if np.isfinite(float(row["model_aux_loss_last"])):
        text += (f"; the model's reported aux_loss {_fmt(row['model_aux_loss_first'])} -> "
                 f"{_fmt(row['model_aux_loss_last'])}")
    return text


def _summary(row: dict[str, Any]) -> str:
    m, parts = row["tensor"], []
    if row["collapse_severity"] > 0:
        parts.append(f"routing collapsed onto expert {row['top_expert']} since record {row['since_record']}: max share "
                     f"{_fmt(row['max_share_first'])} -> {_fmt(row['max_share_last'])} (concentration "
                     f"{_fmt(row['concentration'], '.2f')}; 0 balanced 1/{row['experts']}, 1 the top-{row['top_k']} "
                     f"ceiling), routing entropy {_fmt(row['entropy_norm_first'], '.2f')} -> "
                     f"{_fmt(row['entropy_norm'], '.2f')} of log E" + _aux_text(row))
    if _ints(row["overloaded"]):
        parts.append(f"overloaded expert(s) {row['overloaded'].replace(' ', ', ')}")
    if row["n_dead"]:
        parts.append(f"{row['n_dead']} dead expert(s) {row['dead'].replace(' ', ', ')} (no tokens since record "
                     f"{row['dead_since']})")
    if row["grad_severity"] > 0:
        parts.append(f"the router's gradient is {_fmt(row['grad_ratio'])} of its experts' per parameter "
                     f"(RMS {_fmt(row['router_grad_rms'])} vs {_fmt(row['expert_grad_rms'])}): a starved router")
    if row["source_spread"] >= SOURCE_NAMED and row["source_pair"]:
        a, b = row["source_pair"].split()
        parts.append(f"sources {a} and {b} route differently to expert {row['source_expert']} (spread "
                     f"{_fmt(row['source_spread'], '.2f')} of 1/k; context: specialisation is the base rate)")
    return f"{m}: " + "; ".join(parts) + "."


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Per router module: one ``experts`` flag with the largest of its severities."""
    opt = ctx.options_for(NAME, ExpertsOptions)
    last = ctx.n_records - 1
    out: list[Flag] = []
    for row in result.table.to_dict("records"):
        sev = float(row["severity"])
        if sev < opt.min_severity:
            continue
        starts = [int(row["since_record"]) if row["collapse_severity"] > 0 else None,
                  int(row["dead_since"]) if row["n_dead"] else None]
        since = min([s for s in starts if s is not None], default=0)
        experts = sorted(set(_ints(row["overloaded"])) | set(_ints(row["dead"]))
                         | ({int(row["top_expert"])} if row["collapse_severity"] > 0 else set()))
        sources = tuple(row["source_pair"].split()) if row["source_spread"] >= SOURCE_NAMED else ()
        keys = ("concentration", "max_share_last", "entropy_norm", "n_dead", "grad_ratio", "collapse_severity",
                "dead_severity", "grad_severity", "source_severity", "source_spread", "router_grad_rms",
                "expert_grad_rms", "aux_loss_first", "aux_loss_last", "model_aux_loss_first", "model_aux_loss_last")
        evidence: dict[str, Any] = {k: float(row[k]) for k in keys} | {
            "since_record": int(since), "experts_named": experts, "dead_experts": _ints(row["dead"]),
            "overloaded_experts": _ints(row["overloaded"]), "experts": int(row["experts"]), "top_k": int(row["top_k"])}
        if row["source_severity"] >= sev and row["source_severity"] > 0:
            evidence["context"] = "specialisation"
        out.append(Flag(NAME, row["tensor"], None, sources, sev, (int(since), last), evidence, _summary(row)))
    return out


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Each expert's load per window of records (named experts bold), by source dashed; the fair 1/E and ceiling 1/k."""
    m = flag.tensor
    load = np.asarray(result.series[f"load/{m}"], float)
    edges = np.asarray(result.series[f"window_edges/{m}"], float)
    x = (edges[:-1] + edges[1:]) / 2
    named = set(flag.evidence.get("experts_named", []))
    e_count = load.shape[1]
    for e in range(e_count):
        bold = e in named
        ax.plot(x, load[:, e], lw=1.8 if bold else 0.8, color=f"C{e % 10}", alpha=1.0 if bold else 0.6,
                label=f"expert {e}" if bold or e_count <= 8 else None)
    styles = ["--", ":", "-."]
    by_source = sorted(k.rsplit("/", 1)[1] for k in result.series if k.startswith(f"load/{m}/"))
    if by_source:
        se = np.asarray(result.series[f"source_edges/{m}"], float)
        xs = (se[:-1] + se[1:]) / 2
    for i, s in enumerate(by_source[:3]):          # by source: the named experts (the first three sources)
        sl = np.asarray(result.series[f"load/{m}/{s}"], float)
        for e in sorted(named):
            ax.plot(xs, sl[:, e], lw=0.9, ls=styles[i], color=f"C{e % 10}", label=f"expert {e} [{s}]")
    ev = flag.evidence
    ax.axhline(1.0 / e_count, color="0.5", lw=0.8, ls="--", label="fair share 1/E")
    ax.axhline(1.0 / max(int(ev.get("top_k", 1)), 1), color="0.3", lw=0.8, ls=":", label="ceiling 1/k")
    if ev.get("since_record"):
        ax.axvline(ev["since_record"], color="0.3", lw=0.8)
    ax.set_xlabel("record")
    ax.set_ylabel("share of the top-k assignments")
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    ax.set_title(f"{m}: load per expert", fontsize=9)


#: A router that collapsed, starved, or left experts dead.
ADVICE = Advice(
    title="Mixture-of-experts routing",
    phrase="the router collapses, starves or leaves experts dead",
    evidence_keys={"concentration": "concentration", "max_share_last": "max expert share",
                   "entropy_norm": "routing entropy / log E", "n_dead": "dead experts",
                   "grad_ratio": "router / expert gradient per parameter"},
    remedies=(
        "Raise the load-balancing (auxiliary) loss coefficient (Switch: 1e-2), or add it if the run has none: it "
        "pushes the router back towards the fair 1/E share per expert.",
        "Add the router z-loss (ST-MoE: 1e-3 * logsumexp(router logits)^2): it keeps the router logits small, so "
        "one expert cannot take every token.",
        "Set a capacity factor (1.25-2): tokens over an expert's capacity overflow to the next expert instead of "
        "piling onto the overloaded one.",
        "Give the router its own, lower learning rate (or keep it in float32): a collapse starts at the record "
        "named, at the learning rate of that step.",
        "With top-1 routing do not normalise the top-k weights (a single weight normalised to 1 carries no "
        "gradient to the router): use top-2, or the unnormalised softmax probability as the weight.",
    ),
    references=("Fedus et al. 2022, Switch Transformers (load-balancing loss, capacity factor)",
                "Zoph et al. 2022, ST-MoE (router z-loss)"),
    time_axis=True)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot, kinds={NAME: ADVICE},
                    options=ExpertsOptions, long_history=True)
