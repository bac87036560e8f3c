"""The optimizer's own state: a stale preconditioner, ε-dominated tensors, outlying updates, stale rows.

``capture --curvature`` summarises the checkpoint's optimizer state per tensor
(:mod:`gradforensics.store.probes`, ``optim/``); ``Recorder(optimizer=opt)`` the live
state per record, per tensor and per row of each 2-D tensor (``optim_live/``,
:mod:`gradforensics.recording.optimlive`).  Four findings:

* **stale preconditioner** - on the replayed batches the median over a tensor's
  elements of ``g²/v̂`` (the squared gradient over Adam's bias-corrected second
  moment) is ``>= 10``.  At a steady state it sits near 1 or below (0.45 is the
  median of χ²₁); far above, ``v̂`` has decayed while the tensor's gradients were
  small and Adam's next steps on it are up to ``√(g²/v̂)`` times its usual size:
  the loss-spike mechanism of Molybog et al. 2023.  Severity 0.5 at 10, 0.9 from
  1000.
* **ε-dominated** - the share of elements with ``√v̂ < ε``; Adam then acts as SGD
  with step ``lr/ε`` there.  Context (below 0.5) on its own: it matters when the
  gradients come back, which the stale finding measures.
* **update/weight out of line** - the RMS of the next update over the weight's RMS,
  against the median over the model's 2-D tensors; ``>= 10x`` the median is a
  flag (0.5, 0.9 from 1000x), ``>= 4x`` context.
* **stale rows** (live only) - rows of a 2-D tensor whose gradient its second moment
  has not seen (``v̂`` ~0: rows first seen late, or back after a long absence), at a
  record where they stand out from the run's own base rate of such rows and the loss
  spikes there or just after: cause "optimizer state" (:mod:`.rows`).  Without a spike:
  context.

The three per-tensor findings read the checkpoint's ``optim/``; a store with only the
live state is judged on the median of its last :data:`LAST` live records (the state the
run ended in; one batch's g²/v̂ is heavy-tailed: a healthy LLaMA's LayerNorm weight reads
a median g²/v̂ of 56 on one batch, 0.1-10 on the ones before).

Table ``optimizer.csv``: a row per tensor: ``tensor``, ``head``, ``update_rms``,
``weight_rms``, ``update_ratio``, ``relative_update``, ``eps_share``, ``m_norm``,
``sqrt_v_norm``, ``ratio_q50``, ``ratio_q90``, ``ratio_q99``, ``ratio_max``, ``step``,
``matrix``, ``origin`` (``checkpoint`` or ``live``), and from the live per-row tails
``stale_record``, ``stale_rows`` (count there), ``stale_base`` (the run's base rate),
``loss_z`` (the loss spike there, noise units), ``stale_indices`` (the rows, space-separated).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag
from gradforensics.analysis.kinds.optimizer.rows import StaleEvent, base_rate, loss_spike_z, severity, stale_event
from gradforensics.store.probes import OptimData, read_optim

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.advice import Finding

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "compute", "flags", "optimizer_table", "plot", "severity_log"]

NAME = "optimizer"
COLUMNS = ("tensor", "head", "update_rms", "weight_rms", "update_ratio", "relative_update", "eps_share",
           "m_norm", "sqrt_v_norm", "ratio_q50", "ratio_q90", "ratio_q99", "ratio_max", "step", "matrix", "origin",
           "stale_record", "stale_rows", "stale_base", "loss_z", "stale_indices")
LAST = 10               # live records whose median stands for the state the run ended in
LIVE = "optim_live"     # the live group (DESIGN.md names it optim/; the checkpoint's summary is there)
STALE = 10.0            # median g²/v̂ at which a preconditioner is stale
OUT_OF_LINE = 10.0      # update/weight over the median of the 2-D tensors
EPS_SHARE = 0.5


def optimizer_table(data: Any, shapes: dict[str, int], origin: str = "checkpoint",
                    events: dict[str, StaleEvent] | None = None) -> pd.DataFrame:
    """``optimizer.csv`` from :class:`~gradforensics.store.probes.OptimData` (*shapes*: tensor -> ndim),
    with each tensor's stale-row event of the live per-row tails (*events*)."""
    import pandas as pd

    rows = []
    for i, name in enumerate(data.tensors):
        row: dict[str, Any] = {"tensor": name, "head": None, "origin": origin}
        ev = (events or {}).get(name)
        if ev is not None:
            row.update(stale_record=ev.record, stale_rows=int(ev.rows.size), stale_base=ev.base, loss_z=ev.loss_z,
                       stale_indices=" ".join(str(int(i)) for i in ev.rows))
        for f in data.fields:
            row[f] = float(data.summary[i, data.fields.index(f)])
        row["matrix"] = shapes.get(name, 2) >= 2
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        table = pd.DataFrame(columns=[c for c in COLUMNS if c != "relative_update"])
    mats = table[table["matrix"].astype(bool)]["update_ratio"].astype(float) if not table.empty else pd.Series([])
    med = float(np.nanmedian(mats)) if mats.notna().any() else math.nan
    table["relative_update"] = table["update_ratio"].astype(float) / med if med > 0 else math.nan
    table = table.reindex(columns=list(COLUMNS))
    table["head"] = table["head"].astype("Int64")
    return table


def compute(ctx: Context) -> AnalysisResult:
    data = read_optim(ctx.store) if ctx.store is not None else None
    live = read_live(ctx)
    if data is None and live is None:
        return AnalysisResult(table=optimizer_table(OptimData([], [], np.zeros((0, 0)), np.zeros((0, 0)), {}), {}))
    if data is not None:
        ndim = data.attrs.get("ndim") or {}
        return AnalysisResult(table=optimizer_table(data, {str(k): int(v) for k, v in ndim.items()},
                                                    events=live[1] if live is not None else None))
    assert live is not None
    summary, events, shapes = live
    return AnalysisResult(table=optimizer_table(summary, shapes, "live", events))


def read_live(ctx: Context) -> tuple[OptimData, dict[str, StaleEvent], dict[str, int]] | None:
    """The live group: its last live per-tensor summary, each 2-D tensor's stale-row event, the tensors' ndim."""
    store = ctx.store
    key = f"{LIVE}/summary"
    if store is None or not store.has(key):
        return None
    attrs = dict(store.arrays[key].attrs)
    tensors, fields = [str(t) for t in attrs["tensors"]], [str(f) for f in attrs["fields"]]
    summ = np.asarray(store.read(key), dtype=np.float64)
    live = np.asarray(~np.isnan(summ).all(axis=(1, 2)) if summ.size else np.zeros(summ.shape[0], dtype=bool),
                      dtype=bool)
    last = np.flatnonzero(live)
    row = np.full((len(tensors), len(fields)), np.nan)
    if last.size:       # the run's end: the median of its last live records (one batch's g²/v̂ is heavy-tailed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            row = np.nanmedian(summ[last[-LAST:]], axis=0)
        if "step" in fields:
            row[:, fields.index("step")] = summ[last[-1], :, fields.index("step")]
    loss = np.asarray(ctx.batches.get("loss", np.full(summ.shape[0], np.nan)), dtype=np.float64)
    z = (loss_spike_z(loss, _source_groups(ctx)) if loss.shape[0] == summ.shape[0]
         else np.full(summ.shape[0], np.nan))
    masks = {t: store.read(f"{LIVE}/{t}/stale") for t in tensors if store.has(f"{LIVE}/{t}/stale")}
    measured = {t: _measured(store.arrays[f"{LIVE}/{t}/stale"].attrs, live, masks) for t in masks}
    floor = base_rate(list(masks.values()), [measured[t] for t in masks])
    events: dict[str, StaleEvent] = {}
    shapes = {t: 2 if t in masks else 1 for t in tensors}
    for t, m in masks.items():
        ev = stale_event(m, measured[t], z, floor)
        if ev is not None:
            events[t] = ev
    data = OptimData(tensors, fields, row, np.zeros((len(tensors), 0)), {"hyper": attrs.get("hyper", {})})
    return data, events, shapes


def _measured(attrs: Any, live: np.ndarray, masks: dict[str, np.ndarray]) -> np.ndarray:
    """The records a stale mask was taken at: every record from the state's first step (attr ``every_record``:
    the first live summary or the first stale row of any tensor, whichever comes first), else the live grid."""
    if not attrs.get("every_record"):
        return live
    firsts = [int(np.flatnonzero(live)[0])] if live.any() else []
    firsts += [int(np.flatnonzero(m.any(axis=1))[0]) for m in masks.values() if m.any()]
    out = np.zeros(live.shape[0], dtype=bool)
    if firsts:
        out[min(firsts):] = True
    return out


def _source_groups(ctx: Context) -> list[np.ndarray] | None:
    """Record indices per source (mixed batches together), or None for one series."""
    if len(ctx.sources) < 2 or "mixture" not in ctx.batches:
        return None
    src = ctx.source_of_record()
    return [np.flatnonzero(src == s) for s in np.unique(src)]


def severity_log(value: float, at: float, context: float = 4.0) -> float:
    """0.5 at *value* = *at*, 0.9 from 100 *at* (log scale); 0.35 from *at* / *context* up to *at*; else 0."""
    if not math.isfinite(value) or value <= 0:
        return 0.0
    if value >= at:
        return float(min(0.9, 0.5 + 0.2 * math.log10(value / at)))
    return 0.35 if value >= at / context else 0.0


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    t = result.table
    last = max(ctx.meta.n_records - 1, 0)
    out = []
    for _, row in t.iterrows():
        for problem in (_stale, _eps, _out_of_line, _stale_rows):
            f = problem(row, last)
            if f is not None:
                out.append(f)
    return out


def _stale_rows(row: Any, last: int) -> Flag | None:
    rec = row.get("stale_record")
    if rec is None or not isinstance(rec, (int, float, np.integer, np.floating)) or not math.isfinite(float(rec)):
        return None
    r = int(rec)
    idx = [int(i) for i in str(row["stale_indices"]).split()]
    n, base, z = len(idx), float(row["stale_base"]), float(row["loss_z"])
    ev = StaleEvent(record=r, rows=np.asarray(idx), n_rows=0, base=base, excess=n / base, loss_z=z, live_records=0)
    sev = severity(ev)
    shown = ", ".join(str(i) for i in idx[:5]) + (", ..." if n > 5 else "")
    rows_text = (f"{row['tensor']}: {n} row{'s' if n != 1 else ''} ({shown}) get a gradient Adam's second moment has "
                 f"not seen at record {r} (sum of g^2 over 1000x the row's v_hat: rows first seen now or back after a "
                 f"long absence; the run's base rate is {base:.3g} such rows per record)")
    if ev.spike:
        text = (f"{rows_text}, and the loss spikes there ({z:.3g} noise units above its level): cause optimizer "
                "state. Adam's next updates on those rows are about lr per element whatever their gradient, several "
                "times their usual step; warm up new rows (a per-row LR ramp, or seed their v), lower beta2, clip "
                "updates per tensor, or bring the new data in gradually.")
    else:
        text = (f"{rows_text}; the loss stays at its level there (z {z:.2g}): context, their first updates are "
                "large but the run did not jump.")
    return Flag(kind=NAME, tensor=row["tensor"], head=None, sources=(), severity=sev, records=(r, r),
                evidence={"problem": "stale rows", "record": r, "stale_rows": n, "rows": idx[:16],
                          "base_rate": base, "excess": n / base, "loss_z": z, "cause": "optimizer state"
                          if ev.spike else ""}, summary=text)


def _evidence(row: Any, **extra: Any) -> dict[str, Any]:
    keys = ("ratio_q50", "ratio_q99", "eps_share", "update_ratio", "relative_update", "m_norm", "sqrt_v_norm",
            "step")
    return {**{k: float(row[k]) for k in keys}, **extra}


def _stale(row: Any, last: int) -> Flag | None:
    q50 = float(row["ratio_q50"])
    sev = severity_log(q50, STALE)
    if sev <= 0:
        return None
    text = (f"{row['tensor']}: Adam's preconditioner is stale - on the replayed batches the median g^2/v_hat is "
            f"{q50:.3g} (99th percentile {float(row['ratio_q99']):.3g}; about 1 at a steady state), so its next "
            f"updates are up to {math.sqrt(q50):.2g}x Adam's usual step; {float(row['eps_share']):.0%} of its "
            "elements have sqrt(v_hat) < eps. Its gradients were small for a while and are back: expect a loss "
            "spike; clip updates per tensor, raise eps, or lower beta2.")
    return Flag(kind=NAME, tensor=row["tensor"], head=None, sources=(), severity=sev, records=(0, last),
                evidence=_evidence(row, problem="stale preconditioner"), summary=text)


def _eps(row: Any, last: int) -> Flag | None:
    share = float(row["eps_share"])
    if not share >= EPS_SHARE:
        return None
    text = (f"{row['tensor']}: {share:.0%} of its elements have sqrt(v_hat) < eps (eps-dominated): Adam acts as SGD "
            "with step lr/eps there; harmless while its gradients stay small.")
    return Flag(kind=NAME, tensor=row["tensor"], head=None, sources=(), severity=0.3 + 0.1 * share,
                records=(0, last), evidence=_evidence(row, problem="eps-dominated"), summary=text)


def _out_of_line(row: Any, last: int) -> Flag | None:
    rel = float(row["relative_update"])
    if not bool(row["matrix"]):
        return None
    sev = severity_log(rel, OUT_OF_LINE, 2.5)
    if sev <= 0:
        return None
    text = (f"{row['tensor']}: the next update is {float(row['update_ratio']):.3g} of the weight's RMS, "
            f"{rel:.3g}x the median over the model's matrices; lower this tensor's LR or check its gradients.")
    return Flag(kind=NAME, tensor=row["tensor"], head=None, sources=(), severity=sev, records=(0, last),
                evidence=_evidence(row, problem="update/weight out of line"), summary=text)


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Median and 99th percentile of g²/v̂ per tensor (log), the stale line at 10."""
    t = result.table
    y = np.arange(len(t))
    ax.barh(y, t["ratio_q99"].to_numpy(dtype=float), color="tab:blue", alpha=0.4, label="99th pct")
    ax.barh(y, t["ratio_q50"].to_numpy(dtype=float), color="tab:blue", label="median")
    ax.axvline(STALE, color="k", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(y, list(t["tensor"]))
    ax.set_xlabel("g^2 / v_hat on the replayed batches")
    ax.set_title(f"optimizer state: {flag.tensor}")
    ax.legend(loc="lower right")


#: References
#: ----------
#: .. [Molybog2023] I. Molybog et al., "A Theory on Adam Instability in Large-Scale Machine Learning", 2023.
#: .. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training
#:    instabilities", 2023 (epsilon, update RMS).
@dataclass(frozen=True)
class OptimizerAdvice(Advice):
    """The remedy of the problem the flags show first (the flag's ``evidence["problem"]``)."""

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        items = list(self.remedies)
        order = {"stale preconditioner": 0, "eps-dominated": 1, "update/weight out of line": 2, "stale rows": 3}
        first = next((order.get(str(f.evidence.get("problem"))) for f in flags), None)
        if first is None or first >= len(items):
            return items
        return [items[first], *items[:first], *items[first + 1:]]


ADVICE = OptimizerAdvice(
    title="Optimizer state out of line",
    cause="optimizer",
    phrase="has an optimizer state out of line (stale preconditioner or rows, eps-dominated, or outlying update)",
    evidence_keys={"ratio_q50": "median g^2/v_hat", "eps_share": "eps-dominated share",
                   "relative_update": "update/weight vs median"},
    remedies=(
        "A stale preconditioner (g^2/v_hat >> 1): clip the update per tensor (or Adam's update RMS), lower "
        "beta2 so v follows the gradients faster, or skip the returning batches; restart before the spike.",
        "eps-dominated tensors: lower eps if their gradients matter, or freeze them.",
        "An update/weight ratio far above the model's others: give that tensor its own lower LR.",
        "Stale rows at a loss spike (new tokens or data arriving with v_hat ~0): warm the new rows up (a per-row "
        "LR ramp, or seed their v from the other rows), lower beta2, clip updates per tensor, or mix the new data "
        "in gradually."),
    references=("Molybog et al. 2023, A Theory on Adam Instability in Large-Scale Machine Learning",
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities"),
)

ANALYSIS = Analysis(name=NAME, needs=(), compute=compute, flags=flags, plot=plot, kinds={NAME: ADVICE},
                    long_history=True)
