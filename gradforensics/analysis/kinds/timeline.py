"""What moved first: every per-record series' first departure from its own level, and the loss spikes.

For every per-record series the store holds (:mod:`gradforensics.analysis.toolkit.signals`: the
loss and each source's loss, the gradient norm of each tensor and head from the Gram matrices'
diagonals, per attention head the max logit and the mean entropy, log Z of the output logits,
the dead share and the excess kurtosis of each recorded module's activations, the optimizer's
update/weight ratio, largest g²/v̂ and stale-row share, the routers' largest expert share, and the
run's own logged loss scale and gradient norm: ``batches/*`` of an import with ``--logs``, or
``analyze --logs DIR`` joined by step, ``Context.run_log``, which wins where both hold one), the
online departure test of :mod:`gradforensics.analysis.toolkit.departure` (a one-sided CUSUM on
robust z-scores against a trailing median / MAD, with a Shewhart limit beside it for shares and,
for attention series, the same test against their frozen opening level beside it) gives the
first record where the series left its own earlier level (its onset, and the record of the
alarm); the loss spikes are the records above ``mean + k σ`` of the trailing window (OLMo-core's
rule, ``k = 6``, the window 128 records or a quarter of a shorter run); a record a loss scaler
skipped (``skipped``, from the same logs) is left out of the spike rule's trailing window, and
still tested itself.

Before each spike, the series whose onset falls after the previous spike and at or before this
one, with an alarm no later than half a window after it, are the signals that moved first,
ordered by onset; each one's lead is the spike's step minus its onset's step.  The table holds a
row per spike and per departed series; ``flags.json`` carries them as ``timeline``
(:mod:`gradforensics.analysis.contract.timeline`) and the report opens with them.  The timeline
raises no flag: it orders what the other analyses (and the loss) show.

False alarms: the defaults (:class:`~gradforensics.analysis.toolkit.departure.DepartureTest`)
were set on the twin zoo's healthy runs, where they give no departure; the margins and the
measured false-alarm rate are in ``docs/timeline.md``.  Above the exact regime's ``N₀`` records
the Gram matrices are not formed and the gradient norms are left out (every other series stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.contract.timeline import COLUMNS, NAME, SPIKE, TEST_FIELDS
from gradforensics.analysis.toolkit.departure import DepartureTest, SpikeTest, departures, spikes, transform
from gradforensics.analysis.toolkit.signals import Signal, collect

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context

__all__ = ["ANALYSIS", "TimelineOptions", "compute", "grad_norms", "plot", "timeline_rows"]


@dataclass(frozen=True)
class TimelineOptions(Options):
    """Options of the timeline (the departure test and the spike rule; see the module docstring).

    Parameters
    ----------
    window
        Trailing window in records (0: 128, or a quarter of a shorter run, at least 16).
    burn_in
        Finite values a series needs before it is tested.
    allowance, threshold
        The CUSUM's allowance (robust standard deviations a shift must exceed) and alarm level.
    limit
        The Shewhart limit: a single robust z-score above it is a departure of a share (dead units, stale
        rows, expert load).
    spike_k
        A loss spike is above the trailing mean + ``spike_k`` standard deviations.
    """

    window: int = 0
    burn_in: int = 8
    allowance: float = 2.0
    threshold: float = 20.0
    limit: float = 9.0
    spike_k: float = 6.0
    analysis_name = NAME
    constraints: ClassVar[Constraints] = {
        "window": Interval(int, 0, None), "burn_in": Interval(int, 2, None),
        "allowance": Interval(float, 0, None), "threshold": Interval(float, 0, None, "neither"),
        "limit": Interval(float, 0, None, "neither"), "spike_k": Interval(float, 0, None, "neither")}

    def tests(self) -> tuple[DepartureTest, SpikeTest]:
        w = self.window or None
        return (DepartureTest(window=w, burn_in=self.burn_in, allowance=self.allowance, threshold=self.threshold,
                              limit=self.limit),
                SpikeTest(k=self.spike_k, window=w, burn_in=self.burn_in))


def grad_norms(ctx: Context) -> dict[tuple[str, int | None], np.ndarray]:
    """Per (tensor, head): the gradient norm of each record, ``sqrt(K_ii)`` of the pass's Gram matrix (NaN on a
    record with a non-finite gradient); empty in the long-history regime (no Gram matrices)."""
    out = {}
    for key in ctx.grams:
        g = ctx.grams[key]
        d = np.sqrt(np.maximum(np.diag(np.asarray(g.gram, np.float64)), 0.0))
        out[key] = np.where(np.asarray(g.nonfinite) == 0, d, np.nan)
    return out


def _spike_series(signals: list[Signal]) -> list[Signal]:
    """Each source's loss when the records are tagged with one source each, else the loss."""
    per_source = [s for s in signals if s.signal == "loss" and s.source]
    return per_source or [s for s in signals if s.signal == "loss" and not s.source]


def timeline_rows(signals: list[Signal], steps: np.ndarray, opt: TimelineOptions,
                  skipped: np.ndarray | None = None) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The table rows (a row per spike and per departed series) and the departed series' z-scores (D, N).

    *skipped*: records a loss scaler skipped, left out of the spike rule's trailing window."""
    n = int(steps.size)
    dtest, stest = opt.tests()
    window = dtest.window_for(n)
    rows: list[dict[str, Any]] = []
    spike_at: list[tuple[int, str | None]] = []
    for s in _spike_series(signals):
        for r in spikes(s.values, stest, skipped):
            spike_at.append((int(r), s.source))
            rows.append({"tensor": "", "head": None, "signal": SPIKE, "label": "loss spike" + (
                f" [{s.source}]" if s.source else ""), "source": s.source, "record": int(r), "step": int(steps[r]),
                "alarm_record": int(r), "peak": np.nan, "z_max": np.nan, "spike_record": int(r),
                "spike_step": int(steps[r]), "lead_steps": 0, "value": float(s.values[r])})
    spike_records = sorted({r for r, _ in spike_at})
    if not signals:
        return rows, np.zeros((0, n))
    x = np.stack([transform(s.values, s.how) for s in signals])
    dep = departures(x, np.array([s.direction for s in signals]), dtest, np.array([s.floor for s in signals]),
                     np.array([s.shewhart for s in signals]), np.array([s.opening for s in signals]))
    keep = np.flatnonzero(dep.alarm >= 0)
    zs = []
    for i in keep:
        s, onset, alarm = signals[i], int(dep.onset[i]), int(dep.alarm[i])
        prev = -1
        spike = None
        for r in spike_records:
            if prev < onset <= r and alarm <= r + window // 2:
                spike = r
                break
            prev = r
        z = dep.z[i]
        rows.append({"tensor": s.tensor, "head": s.head, "signal": s.signal, "label": s.label, "source": s.source,
                     "record": onset, "step": int(steps[onset]), "alarm_record": alarm, "peak": float(dep.peak[i]),
                     "z_max": float(np.nanmax(z)) if np.isfinite(z).any() else np.nan,
                     "spike_record": spike, "spike_step": None if spike is None else int(steps[spike]),
                     "lead_steps": None if spike is None else int(steps[spike] - steps[onset]),
                     "value": float(s.values[alarm])})
        zs.append(z)
    return rows, (np.stack(zs) if zs else np.zeros((0, n)))


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, TimelineOptions)
    n = ctx.n_records
    steps = np.asarray(ctx.batches.get("step", np.arange(n)), np.int64)
    if steps.shape != (n,):
        steps = np.arange(n, dtype=np.int64)
    batches = {**ctx.batches, **ctx.run_log}            # the run's logs given to analyze win over the store's
    signals = collect(ctx.store, batches, ctx.sources, grad_norms(ctx), n)
    skipped = np.asarray(batches["skipped"], bool).reshape(-1) if "skipped" in batches else None
    skipped = skipped if skipped is not None and skipped.shape == (n,) else None
    rows, z = timeline_rows(signals, steps, opt, skipped) if n >= 2 else ([], np.zeros((0, n)))
    dtest, stest = opt.tests()
    test = {"window": dtest.window_for(n), "burn_in": dtest.burn_in, "allowance": dtest.allowance,
            "threshold": dtest.threshold, "limit": dtest.limit, "z_clip": dtest.z_clip, "spike_k": stest.k,
            "spike_window": stest.window_for(n)}
    table = pd.DataFrame(rows, columns=COLUMNS)
    for col in ("head", "spike_record", "spike_step", "lead_steps"):
        table[col] = table[col].astype("Int64")
    departed = [r for r in rows if r["signal"] != SPIKE]
    series: dict[str, np.ndarray] = {"test": np.array([test[k] for k in TEST_FIELDS], np.float64), "steps": steps.astype(np.float64),
                                     "z": z.astype(np.float32) if z.size else np.zeros((0, n), np.float32),
                                     "onset": np.array([r["record"] for r in departed], np.float64),
                                     "spikes": np.array(sorted({r["record"] for r in rows if r["signal"] == SPIKE}),
                                                        np.float64)}
    return AnalysisResult(table=table, series=series)


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """None: the timeline orders what the other analyses flag."""
    return []


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """The departed series' robust z-scores around record ``flag.records[0]`` (a spike; the whole run when the
    flag's range is the whole run), clipped to [-5, 30], each from its own trailing median and MAD, its onset
    marked; the spike as a vertical line."""
    table = result.table
    z = np.asarray(result.series.get("z", np.zeros((0, 0))), np.float64)
    spikes_ = np.asarray(result.series.get("spikes", np.zeros(0)), np.float64)
    departed = table[table["signal"] != SPIKE].reset_index(drop=True) if len(table) else table
    n = z.shape[1] if z.ndim == 2 else 0
    a, b = int(flag.records[0]), int(flag.records[1])
    window = int(np.asarray(result.series.get("test", np.zeros(1)))[0]) or 16
    lo, hi = (max(0, a - window), min(n, a + window // 2 + 1)) if a == b else (0, n)
    x = np.arange(lo, hi)
    order = np.argsort(departed["record"].to_numpy(np.float64)) if len(departed) else np.zeros(0, int)
    shown = 0
    for i in order[:8]:
        row = departed.iloc[int(i)]
        if a == b and not (lo <= int(row["record"]) <= a):
            continue
        y = np.clip(z[int(i), lo:hi], -5, 30)
        line, = ax.plot(x, y, lw=1.2, label=f"{row['label']} (onset {int(row['record'])})")
        r = int(row["record"])
        if lo <= r < hi:
            ax.plot([r], [np.clip(z[int(i), r], -5, 30) if np.isfinite(z[int(i), r]) else 0.0], "o",
                    color=line.get_color(), ms=5)
        shown += 1
    labelled = False
    for s in spikes_:
        if lo <= s < hi:
            own = a == b and int(s) == a
            ax.axvline(float(s), color="black" if own or a != b else "grey", ls="--", lw=1.0 if own else 0.7,
                       label=None if labelled and not own else (f"loss spike (record {int(s)})" if own
                                                                  else "loss spike"))
            labelled = labelled or not own
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("record")
    ax.set_ylabel("robust z (trouble up), clipped to [-5, 30]")
    ax.set_title("what moved first" + (f": before the spike at record {a}" if a == b else ""))
    if shown or len(spikes_):
        ax.legend(fontsize=7, loc="upper left")


ANALYSIS = Analysis(name=NAME, needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    options=TimelineOptions, long_history=True)
