"""The report's opening section, "What moved first": the timeline of ``flags.json`` in words and figures.

Built from the ``timeline`` object of :meth:`Findings.flags_json` (so the report says what the
file says), with the timeline analysis's own figure (its ``plot``: the departed series' robust
z-scores around each spike) for up to :data:`MAX_SPIKES` spikes, or over the whole run when the
loss did not spike but series departed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradforensics.analysis.contract.model import Flag
from gradforensics.analysis.contract.timeline import NAME, timeline_document
from gradforensics.reporting import figures

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings
    from gradforensics.reporting.summary import FlagGroup

__all__ = ["MAX_SIGNALS", "MAX_SPIKES", "Moment", "Timeline", "build"]

#: Spikes shown (each with its figure); the rest are in flags.json.
MAX_SPIKES = 3
#: Signals listed per spike (or for a run without a spike).
MAX_SIGNALS = 12


@dataclass
class Moment:
    """One spike (or, ``record`` None, the run without one): what it is and what moved before it."""

    title: str
    items: list[tuple[str, str | None]]     # (sentence, anchor of its finding or None)
    png: bytes | None = None
    alt: str = ""
    stem: str = ""
    more: int = 0


@dataclass
class Timeline:
    intro: str
    test: str
    moments: list[Moment] = field(default_factory=list)


def _step(e: dict[str, Any]) -> str:
    return f"record {e['record']}" + (f" (step {e['step']})" if e.get("step") is not None else "")


def _item(e: dict[str, Any], anchors: dict[int, tuple[str, int]], lead: bool) -> tuple[str, str | None]:
    text = f"{e['label']}: from {_step(e)}"
    if lead and e.get("lead_steps") is not None:
        text += f", {e['lead_steps']} step(s) before the spike" if e["lead_steps"] > 0 else ", at the spike"
    if e.get("alarm_record") is not None and e["alarm_record"] != e["record"]:
        text += f" (sure at record {e['alarm_record']})"
    f = e.get("finding")
    if f is not None and f in anchors:
        anchor, number = anchors[f]
        return text + f"; finding {number}", anchor
    return text, None


def _figure(findings: Findings, a: int, b: int, stem: str, alt: str) -> tuple[bytes | None, str]:
    from gradforensics.analysis import REGISTRY

    an, res = REGISTRY.get(NAME), findings.results.get(NAME)
    if an is None or res is None:
        return None, alt
    fig = figures.new_figure(*figures.EVIDENCE_SIZE)
    try:
        an.plot(res, Flag(NAME, "loss", None, (), 0.0, (a, b), {}, ""), fig.add_subplot())
        png = figures.to_png(fig)
    except Exception as exc:  # a plot bug must not sink the report
        return None, f"{alt} (not drawn: {type(exc).__name__}: {exc})"
    finally:
        figures.discard(fig)
    return png, alt


def build(findings: Findings, groups: list[FlagGroup]) -> Timeline | None:
    """The section, or None when the timeline analysis did not run."""
    res = findings.results.get(NAME)
    if res is None:
        return None
    doc = timeline_document(res, findings.flags, int(findings.n_records))
    index = {id(f): i for i, f in enumerate(findings.flags)}
    anchors = {index[id(f)]: (g.anchor, g.index + 1) for g in groups for f in g.flags if id(f) in index}
    t = doc["test"]
    test = (f"Departure: one-sided CUSUM of robust z-scores against each series' trailing median / MAD over "
            f"{_int(t.get('window'))} records (allowance {t.get('allowance')}, alarm at {t.get('threshold')}, or for a share one "
            f"z-score above {t.get('limit')}; after {_int(t.get('burn_in'))} values; an attention series also against "
            "its first values, frozen). Loss spike: above the mean + "
            f"{t.get('spike_k')} σ of the last {_int(t.get('spike_window'))} records. See docs/timeline.md.")
    spikes, departures = doc["spikes"], doc["departures"]
    n_last = max(findings.n_records - 1, 0)
    if spikes:
        intro = (f"The loss spiked {len(spikes)} time(s); before each spike, the series that left their own "
                 "earlier level, first one first, and how many steps each led the spike by.")
    elif departures:
        intro = (f"The loss did not spike; {len(departures)} series left their own earlier level, first one "
                 "first.")
    else:
        return Timeline("The loss did not spike and no recorded series left its own earlier level.", test)
    out = Timeline(intro, test)
    for i, s in enumerate(spikes[:MAX_SPIKES]):
        loss = f", loss {s['loss']:.4g}" if s.get("loss") is not None else ""
        title = f"Loss spike at {_step(s)}{loss}"
        sigs = s["signals"]
        items = [_item(e, anchors, True) for e in sigs[:MAX_SIGNALS]] or \
            [("no recorded series departed before it (the spike came first)", None)]
        png, alt = _figure(findings, s["record"], s["record"], f"timeline-{i + 1:02d}",
                           f"Robust z-scores of the series that departed before the loss spike at record "
                           f"{s['record']} (dashed line), each marked at its onset.")
        out.moments.append(Moment(title, items, png, alt, f"timeline-{i + 1:02d}", max(0, len(sigs) - MAX_SIGNALS)))
    if not spikes:
        items = [_item(e, anchors, False) for e in departures[:MAX_SIGNALS]]
        png, alt = _figure(findings, 0, n_last, "timeline-01",
                           "Robust z-scores of the series that departed from their own earlier level, over the "
                           "run, each marked at its onset.")
        out.moments.append(Moment("Departures over the run", items, png, alt, "timeline-01",
                                  max(0, len(departures) - MAX_SIGNALS)))
    return out


def _int(v: Any) -> str:
    return str(int(v)) if isinstance(v, (int, float)) else "?"
