"""Precision floor: weight updates the number format rounds away, and fp16 gradient range.

Without fp32 master weights an optimizer step stores ``w ← round_f(w + Δ)`` in the
training format ``f``.  When ``|Δ|`` is below half the spacing of ``f`` at ``w``
(half an ULP), round-to-nearest gives ``w`` back: the update is *swamped* and that
weight stops learning (Micikevicius et al. 2018, §3.1; Kalamkar et al. 2019 for
bfloat16).  From consecutive weight snapshots ``W_t, W_{t+1}`` this analysis
measures, per tensor:

* ``swamped_bf16`` / ``swamped_fp16``: the share of non-zero per-step updates
  ``Δ = (W_{t+1} - W_t) / steps`` with ``round_f(round_f(w) + Δ) == round_f(w)``,
  i.e. updates that would be lost if the weights were kept in bfloat16 (8
  significant bits, ULP ``2^(e-7)``) or float16 (11 bits, ULP ``2^(e-10)``,
  subnormal spacing ``2^-24``).  This is the exact rounding rule, not only
  ``|Δ| < ULP/2``: at a power of two the spacing below ``w`` is half the spacing
  above it, and ties go to even.
* ``swamped_fp8_e4m3`` / ``swamped_fp8_e5m2``: the same for FP8 (OCP/NVIDIA FP8
  formats: E4M3 with 4 significant bits, normal range ``[2^-6, 448]``, subnormal
  spacing ``2^-9``; E5M2 with 3 bits, ``[2^-14, 57344]``, spacing ``2^-16``), after
  a per-tensor *power-of-two amax scale*: the snapshot ``W_t`` and its update are
  multiplied by ``s = 2^floor(log2(max_f / amax|W_t|))`` (the largest power of two
  that keeps ``amax`` finite), as FP8 recipes scale every tensor before the cast.
  A power of two scales exactly, so in the normal range only the mantissa bits decide.
* ``lost_share``: among elements whose gradient was non-zero on a record between
  the two snapshots, the share whose stored weight did not change at all - updates
  *already* being lost, when the snapshots themselves are low precision.
* ``grad_underflow_fp16`` / ``grad_subnormal_fp16`` / ``grad_overflow_fp16``: the
  share of non-zero gradient values that, multiplied by the loss scale ``s``,
  fall below ``2^-24`` (flushed to zero in fp16), in ``[2^-24, 2^-14)`` (fp16
  subnormal: fewer significant bits), or reach ``2^16`` (overflow to inf; fp16's
  largest finite value is 65504).  They come from an exact histogram of base-2
  exponents, so they are exact for power-of-two scales (what dynamic loss scaling
  uses) and within one binade otherwise.
* ``grad_underflow_fp8_e4m3`` / ``grad_subnormal_fp8_e4m3`` (and ``_e5m2``): the
  share of non-zero gradient values below the smallest FP8 subnormal, or in the
  subnormal range, after the power-of-two amax scale of the tensor's gradients
  (amax over all the stored records: delayed scaling with a history that spans the
  capture).  That scale cannot overflow, so there is no FP8 overflow column.  Exact:
  a power-of-two scale moves the thresholds onto powers of two.

Snapshots are assumed taken at ``record()`` time, before that record's optimizer
step: the gradients of records ``r_t .. r_{t+1}-1`` drive ``W_t → W_{t+1}``.

References
----------
Micikevicius, P. et al. (2018). Mixed precision training. ICLR.
Micikevicius, P. et al. (2022). FP8 formats for deep learning. arXiv:2209.05433.
Kalamkar, D. et al. (2019). A study of BFLOAT16 for deep learning training. arXiv:1905.12322.
IEEE 754-2008, §4.3.1 (round to nearest, ties to even).

The number-format maths live in :mod:`~gradforensics.analysis.kinds.precision.formats` and the
reads (snapshot pairs, slab reductions) in :mod:`~gradforensics.analysis.kinds.precision.pairs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.kinds.precision.formats import (
    COUNTS,
    EXP_MAX,
    EXP_MIN,
    FLAG_FORMATS,
    FP8,
    ULP_EDGES,
    fp8_gradient_shares,
    fp16_gradient_shares,
)
from gradforensics.analysis.kinds.precision.pairs import lazy, slab_reductions
from gradforensics.analysis.toolkit.flagging import dedupe_heads
from gradforensics.analysis.toolkit.units import head_of, heads_per_tensor, where
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context

__all__ = ["ADVICE", "ANALYSIS", "HIGH_PRECISION", "NAME", "WHATIF_WEIGHT", "PrecisionOptions", "compute", "flags",
           "plot", "run_format", "severity", "swamped_share", "tensor_row", "underflow_severity"]


NAME = "precision"
#: The ``dtypes`` root attribute's names -> the formats here (``fp32``/``fp64``: nothing is swamped).
DTYPE_FORMATS = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}
#: Severity weight of swamping in a format the run does not keep its weights in: a what-if, context below 0.5.
WHATIF_WEIGHT = 0.45
#: Formats whose lost updates (below half their ULP: < 2^-24 of the weight) cannot matter in any run length.
HIGH_PRECISION = ("fp32", "fp64")
#: Share of the gradient energy (sum of g^2) carried by fp16-flushed values at which underflow counts in full.
UNDERFLOW_ENERGY_FULL = 0.01


@dataclass(frozen=True)
class PrecisionOptions(Options):
    """Options of the precision analysis.

    Parameters
    ----------
    loss_scale
        Scale the gradients are multiplied by before the fp16 cast (the run's
        recorded loss scale).  Default: ``extra["loss_scale"]`` of the store, else 1.
    format
        ``"bf16"`` or ``"fp16"``: the format whose swamped share is checked.  Default:
        the run's own (the store's ``dtypes`` root attribute: the master weights'
        dtype, else the parameters'); bf16 when the store records none (the summary
        says so).  A format the run does not keep its weights in (an fp32 run checked
        for bf16) is a what-if: its severity is weighted by :data:`WHATIF_WEIGHT`,
        context below 0.5.  With ``"fp16"`` the gradient underflow is flagged too,
        weighted by the flushed values' share of the gradient energy.
    min_severity
        Flags below this severity are not emitted.
    """

    loss_scale: float | None = None
    format: str | None = None
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"loss_scale": [Interval(float, 0, None, "neither"), None]}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format is not None and self.format not in FLAG_FORMATS:         # the message tests and users match: "format must be one of"
            raise SpecError(f"precision: format must be one of {FLAG_FORMATS}; got {self.format!r}.")


# ------------------------------------------------------------------------ compute
def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")


def tensor_row(tensor: str, pairs: list[dict[str, Any]] | None, grad_hist: np.ndarray | None,
               loss_scale: float, grad_amax: float | None = None, run: dict[str, int] | None = None) -> dict[str, Any]:
    """One table row from the pair counts, the gradient exponent histogram, the gradient amax and the whole
    run's net update counts (*run*: :func:`~gradforensics.analysis.kinds.precision.formats.run_counts`)."""
    tot = {k: sum(int(p[k]) for p in pairs or []) for k in COUNTS}
    has_grad = any(p["has_grad"] for p in pairs or [])
    row: dict[str, Any] = {
        "tensor": tensor, "head": None, "n_pairs": len(pairs or []),
        "record_first": pairs[0]["records"][0] if pairs else None,
        "record_last": pairs[-1]["records"][1] if pairs else None,
        "updated_share": _ratio(tot["updated"], tot["n"]),
        "swamped_bf16": _ratio(tot["swamped_bf16"], tot["updated"]),
        "swamped_fp16": _ratio(tot["swamped_fp16"], tot["updated"]),
        **{f"swamped_{f}": _ratio(tot[f"swamped_{f}"], tot["updated"]) for f in FP8},
        **{f"net_swamped_{f}": _ratio(tot[f"net_swamped_{f}"], tot["updated"]) for f in FLAG_FORMATS},
        "snapshot_gap": float(np.median([p["steps"] for p in pairs])) if pairs and "steps" in pairs[0] else 1.0,
        "lost_share": _ratio(tot["lost"], tot["grad_nonzero"]) if has_grad else float("nan"),
        "median_update_ulps_bf16": _median_ulps(pairs),
        "loss_scale": loss_scale,
        **{f"run_swamped_{f}": _ratio(run[f"run_swamped_{f}"], run["n"]) if run else float("nan")
           for f in FLAG_FORMATS},
    }
    hist = grad_hist if grad_hist is not None else np.zeros(EXP_MAX - EXP_MIN + 3, np.int64)
    row.update(fp16_gradient_shares(hist, loss_scale))
    row.update(fp8_gradient_shares(hist, grad_amax if grad_hist is not None else None))
    row["grad_zero_share"] = _ratio(hist[-2], hist[:-1].sum()) if grad_hist is not None else float("nan")
    return row


def _median_ulps(pairs: list[dict[str, Any]] | None) -> float:
    """Median of ``|Δ| / ULP_bf16(w)`` from the pooled histogram (bin centre, as a ratio)."""
    if not pairs:
        return float("nan")
    h = np.sum([p["ulp_hist"] for p in pairs], axis=0)
    if h.sum() == 0:
        return float("nan")
    i = int(np.searchsorted(np.cumsum(h), h.sum() / 2))
    return float(2.0 ** ((ULP_EDGES[i] + ULP_EDGES[i + 1]) / 2))


def _expert_rows(tensor: str, pairs: list[dict[str, Any]] | None, hists: dict[int, np.ndarray] | None,
                 amaxes: dict[int, float] | None, runs: list[dict[str, int]] | None,
                 scale: float) -> list[dict[str, Any]]:
    """One row per expert of a mixture-of-experts unit (``head`` = the expert), as a whole tensor's: its own
    pair counts, gradient exponent histogram and amax, and net update over the run."""
    n = len(pairs[0]["experts"]) if pairs and "experts" in pairs[0] else len(hists or {})
    out = []
    for e in range(n):
        own = [p["experts"][e] for p in pairs] if pairs and "experts" in pairs[0] else None
        row = tensor_row(tensor, own, (hists or {}).get(e), scale, (amaxes or {}).get(e),
                         runs[e] if runs and e < len(runs) else None)
        out.append({**row, "head": e})
    return out


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, PrecisionOptions)
    scale = opt.loss_scale or float(ctx.meta.extra.get("loss_scale", 1.0) or 1.0)
    lz = ctx.computed.get(NAME, {})
    tensors = sorted({k.split("|", 1)[1] for k in lz})
    rows, series = [], {}
    for t in tensors:
        pairs = lz.get(f"pairs|{t}")
        hist, amax = lz.get(f"grad_exp|{t}"), lz.get(f"grad_amax|{t}")
        per_hist, per_amax = lz.get(f"grad_exp_experts|{t}"), lz.get(f"grad_amax_experts|{t}")
        if per_hist:                    # a mixture-of-experts unit: the whole unit's from its experts'
            hist, amax = np.sum(list(per_hist.values()), axis=0), max(per_amax.values())
        rows.append(tensor_row(t, pairs, hist, scale, amax, lz.get(f"run|{t}")))
        rows += _expert_rows(t, pairs, per_hist, per_amax, lz.get(f"run_experts|{t}"), scale)
        if pairs and "experts" in pairs[0]:
            for e in range(len(pairs[0]["experts"])):
                series[f"ulp_hist/{t}/{e}"] = np.sum([p["experts"][e]["ulp_hist"] for p in pairs], axis=0)
        if pairs:
            series[f"ulp_hist/{t}"] = np.sum([p["ulp_hist"] for p in pairs], axis=0)
            for f in ("bf16", *FP8):
                series[f"swamped_{f}/{t}"] = np.array([_ratio(p[f"swamped_{f}"], p["updated"]) for p in pairs])
            series[f"pair_records/{t}"] = np.array([p["records"] for p in pairs], dtype=np.int64)
    series["ulp_edges"] = ULP_EDGES
    cols = ["tensor", "head", "n_pairs", "record_first", "record_last", "updated_share", "swamped_bf16",
            "swamped_fp16", "swamped_fp8_e4m3", "swamped_fp8_e5m2", "lost_share", "median_update_ulps_bf16",
            "grad_underflow_fp16", "grad_subnormal_fp16", "grad_overflow_fp16", "grad_underflow_fp8_e4m3",
            "grad_subnormal_fp8_e4m3", "grad_underflow_fp8_e5m2", "grad_subnormal_fp8_e5m2", "grad_zero_share",
            "loss_scale", "net_swamped_bf16", "net_swamped_fp16", "snapshot_gap", "grad_underflow_fp16_energy",
            "run_swamped_bf16", "run_swamped_fp16"]
    return AnalysisResult(table=pd.DataFrame(rows, columns=cols), series=series)


# -------------------------------------------------------------------------- flags
def run_format(meta: Any) -> str | None:
    """The format the run keeps its weights in (``dtypes``: master, else parameters), or None when not recorded."""
    d = getattr(meta, "dtypes", None) or {}
    name = d.get("master") or d.get("parameters")
    return DTYPE_FORMATS.get(name, name) if name else None


def swamped_share(row: dict[str, Any], fmt: str) -> float:
    """The swamped share severity reads: per step when snapshots are a step apart; between snapshots K steps
    apart, the share whose whole K-step update is swamped (the per-step average ``Δ/K`` counts updates that
    cancel inside the gap as swamped and over-counts; the table keeps both, and ``snapshot_gap``)."""
    gap = _num(row.get("snapshot_gap", 1.0)) or 1.0
    return _num(row[f"swamped_{fmt}"]) if gap <= 1.0 else _num(row.get(f"net_swamped_{fmt}"))


def underflow_severity(row: dict[str, Any]) -> float:
    """fp16 underflow share weighted by the flushed values' share of the gradient energy."""
    share = _num(row["grad_underflow_fp16"])
    energy = _num(row.get("grad_underflow_fp16_energy", 1.0))
    return share * min(1.0, energy / UNDERFLOW_ENERGY_FULL)


def severity(row: dict[str, Any], fmt: str, own: str | None) -> tuple[float, dict[str, float]]:
    """max(swamped, lost, underflow), each as this run can suffer it.

    * In the run's own format (or an unrecorded one, *own* None) the swamped share and the fp16
      underflow count in full.  In a format the run does not keep its weights in (a what-if) they are
      context: weighted by :data:`WHATIF_WEIGHT`, and by the share of elements the whole run moved by
      half an ULP of that format or more (``1 - run_swamped``): a tensor whose net change over the run
      stays below the format's resolution - a bias before a normalisation, whose gradient is rounding
      noise - had nothing for that format to round away.
    * ``lost`` (weights with a gradient that did not change at all) counts where the snapshots are in a
      coarse format; in an fp32/fp64 run a lost update is below 2^-24 of its weight, too small to move it
      in any run one trains, and is no finding.
    """
    whatif = own is not None and own != fmt
    reach = 1.0 - _num(row.get(f"run_swamped_{fmt}")) if whatif and _finite(row.get(f"run_swamped_{fmt}")) else 1.0
    weight = WHATIF_WEIGHT * reach if whatif else 1.0
    parts = {"swamped": swamped_share(row, fmt) * weight,
             "lost": _num(row["lost_share"]) if own not in HIGH_PRECISION else 0.0,
             "underflow": (underflow_severity(row) if fmt == "fp16" else 0.0) * weight}
    return float(min(max(parts.values()), 1.0)), parts


def _finite(x: Any) -> bool:
    try:
        return bool(np.isfinite(float(x)))
    except (TypeError, ValueError):
        return False


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """A flag per tensor whose updates are swamped in the run's format (a what-if format: context), or lost."""
    opt = ctx.options_for(NAME, PrecisionOptions)
    own = run_format(ctx.meta)
    fmt = opt.format or (own if own in FLAG_FORMATS else "bf16")
    whatif = own is not None and own != fmt
    out = []
    for row in result.table.to_dict("records"):
        sev, parts = severity(row, fmt, own)
        if sev < opt.min_severity:
            continue
        sw = swamped_share(row, fmt)
        under = underflow_severity(row) if fmt == "fp16" else 0.0
        first = int(row["record_first"]) if row["n_pairs"] else 0
        last = int(row["record_last"]) if row["n_pairs"] else max(ctx.n_records - 1, 0)
        lost_leads = parts["lost"] >= max(parts["swamped"], parts["underflow"])
        text = _summary(row, fmt, sw, parts["lost"], under, first, last) + _format_note(own, fmt, row, lost_leads)
        head = head_of(row["head"])
        out.append(Flag(
            kind="precision", tensor=row["tensor"], head=head, sources=(), severity=sev,
            records=(first, last),
            evidence={k: row.get(k) for k in ("swamped_bf16", "swamped_fp16", "lost_share", "median_update_ulps_bf16",
                                              "grad_underflow_fp16", "grad_overflow_fp16", "loss_scale",
                                              "snapshot_gap", "grad_underflow_fp16_energy", f"run_swamped_{fmt}")}
            | {"format": fmt, "run_format": own or "unknown", "whatif": whatif} | parts
            | ({"expert": head} if head is not None else {}),
            summary=text))
    # an expert flagged alone names it (the whole unit's flag, diluted by the other experts, dropped); every
    # expert flagged: the whole unit's flag alone
    return dedupe_heads(out, heads_per_tensor(result.table), by_sources=False)


def _format_note(own: str | None, fmt: str, row: dict[str, Any], lost_leads: bool = False) -> str:
    gap = _num(row.get("snapshot_gap", 1.0)) or 1.0
    note = (f" (snapshots {gap:g} steps apart: the share is of updates swamped over the whole gap; per step "
            f"{_num(row[f'swamped_{fmt}']):.0%} at most)") if gap > 1 else ""
    if own is None:
        return note + f" The store records no dtypes (root attribute 'dtypes'): {fmt} weights assumed."
    if own != fmt and lost_leads:        # lost in the run's own snapshots: a problem of this run, whatever fmt
        return note + f" The run keeps its weights in {own}: the stored {own} weights themselves lost these updates."
    if own != fmt:
        note += f" The run keeps its weights in {own}, so {fmt} is a what-if: context, not a problem of this run"
        still = _num(row.get(f"run_swamped_{fmt}"))
        if still >= 0.5:
            note += (f"; over the whole run {still:.0%} of its weights moved by less than half a {fmt} ULP: "
                     f"{fmt} would have had little of this tensor's learning to round away")
        return note + "."
    return note


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return 0.0
    return v if np.isfinite(v) else 0.0


def _summary(row: dict[str, Any], fmt: str, sw: float, lost: float, under: float, first: int, last: int) -> str:
    t = where(row["tensor"], head_of(row["head"]), experts=True)       # only an expert's row has a head
    if lost >= max(sw, under):
        return (f"{t}: {lost:.0%} of the weights that had a non-zero gradient between records {first} and {last} "
                f"did not change at all in the stored snapshots: updates are already rounded away; keep fp32 "
                f"master weights or raise the learning rate for this tensor.")
    if under > sw:
        return (f"{t}: {_num(row['grad_underflow_fp16']):.0%} of its gradient values, "
                f"{_num(row.get('grad_underflow_fp16_energy')):.2g} of its gradient energy, fall below fp16's "
                f"smallest subnormal (2^-24) at loss scale {row['loss_scale']:g}: raise the loss scale or train in bf16.")
    return (f"{t}: {sw:.0%} of its weight updates between records {first} and {last} are smaller than half a "
            f"{fmt} ULP of the weight (median update {row['median_update_ulps_bf16']:.2g} bf16 ULP): without fp32 "
            f"master weights this tensor stops learning.")


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Histogram of per-step update size in bf16 ULPs of the weight, with the half-ULP lines."""
    edges = np.asarray(result.series["ulp_edges"])
    own = result.series.get(f"ulp_hist/{flag.tensor}/{flag.head}") if flag.head is not None else None
    h = np.asarray(own if own is not None else result.series.get(f"ulp_hist/{flag.tensor}", np.zeros(edges.size - 1)),
                   dtype=float)
    share = h / h.sum() if h.sum() else h
    ax.bar(edges[:-1], share, width=np.diff(edges), align="edge", color="0.6", edgecolor="0.3")
    ax.axvline(-1.0, color="C3", lw=2, label="bf16: half an ULP")
    ax.axvline(-4.0, color="C0", lw=2, ls="--", label="fp16: half an ULP")
    ax.set_xlabel("log2( |per-step update| / bf16 ULP of the weight )")
    ax.set_ylabel("share of updated elements")
    sw = flag.evidence.get("swamped_bf16")
    ax.set_title(f"{flag.tensor}: updates left of the red line are rounded away in bf16"
                 + (f" ({sw:.0%})" if isinstance(sw, float) and np.isfinite(sw) else ""), fontsize=9)
    ax.legend(fontsize=8)


#: What a ``precision`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Micikevicius2018] P. Micikevicius et al., "Mixed Precision Training", ICLR 2018.
#: .. [Zamirai2020] P. Zamirai et al., "Revisiting BFloat16 Training", 2020.
ADVICE = Advice(
    title="Precision floor",
    phrase="updates fall below the weights' precision floor",
    evidence_keys={"swamped_bf16": "swamped in bf16", "lost_share": "unchanged share",
                   "swamped_fp16": "swamped in fp16", "grad_underflow_fp16": "fp16 gradient underflow",
                   "grad_overflow_fp16": "fp16 gradient overflow",
                   "median_update_ulps_bf16": "median update (bf16 ULPs)"},
    remedies=(
        "Keep fp32 master weights (mixed precision) so small updates accumulate instead of rounding away.",
        "Or use stochastic rounding / Kahan-compensated summation for bf16 weight updates.",
        "For fp16 gradient underflow/overflow: dynamic loss scaling."),
    references=("Micikevicius et al. 2018, Mixed Precision Training",
                "Zamirai et al. 2020, Revisiting BFloat16 Training"),
    cause="precision",
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRADS, Need.WEIGHTS), compute=compute, flags=flags, plot=plot,
                    kinds={"precision": ADVICE}, options=PrecisionOptions, lazy=lazy, long_history=True,
                    slab_reductions=slab_reductions)
