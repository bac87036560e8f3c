"""What the report says, built once from :class:`Findings`; HTML and Markdown render it.

Figures are drawn once here (PNG bytes): the HTML embeds them as base64, the
Markdown links them as files in ``figures/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradforensics._format import fmt_bytes
from gradforensics.reporting import advice, figures, names, recordsmap, summary, tables
from gradforensics.reporting import timeline as timeline_section
from gradforensics.reporting.bands import band

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings
    from gradforensics.store.reader import Store

__all__ = [
    "MAX_FIGURES",
    "Document",
    "Picture",
    "Section",
    "analyses_item",
    "build",
    "header_items",
    "is_long_history",
    "regime_sentence",
    "severity_label",
]


#: Findings that get an evidence figure (the most severe ones).
MAX_FIGURES = 24


@dataclass
class Picture:
    stem: str                 # file name without .png, e.g. "finding-01-conflict"
    png: bytes
    alt: str
    note: str | None = None   # why the analysis's figure is missing, if it is


@dataclass
class Section:
    finding: summary.FlagGroup
    sentence: str
    picture: Picture | None
    advice: list[str]
    references: list[str]
    records_map: Picture | None = None      # the records map, in the top direction finding's section
    records_map_caption: str = ""
    records_map_note: str | None = None     # why the map is not drawn, when it is not


@dataclass
class Document:
    title: str
    header: list[tuple[str, str]]
    headline: str
    verdict: str
    sentences: list[tuple[summary.FlagGroup, str]]
    n_more: int
    overview: Picture
    sections: list[Section]
    layer_columns: list[str]
    layer_rows: list[dict[str, Any]]
    analysis_tables: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    regime: str | None = None     # the analysis regime in one sentence, under the verdict (long histories)
    #: "what moved first" (the timeline), first in the report; None when the timeline analysis did not run
    timeline: timeline_section.Timeline | None = None
    #: the mixture-of-experts units (store attribute ``experts``, or a flag's ``evidence["expert"]``): their
    #: ``head`` cells read ``expert j``
    experts: frozenset[str] = frozenset()

    def head_text(self, tensor: str, head: Any) -> int | str | None:
        """A ``head`` cell as shown: ``expert j`` on an experts unit, else the head's index (None: whole tensor)."""
        return names.head_text(tensor, head, self.experts)

    @property
    def pictures(self) -> list[Picture]:
        out = [self.overview]
        if self.timeline is not None:
            out += [Picture(m.stem, m.png, m.alt) for m in self.timeline.moments if m.png is not None]
        for s in self.sections:
            out += [p for p in (s.picture, s.records_map) if p is not None]
        return out


def _fmt_model(model: Any) -> str:
    """``{"class": "X", "n_params": 96576, "config": {...}}`` -> ``class=X, n_params=96,576, config: ...``."""
    if not isinstance(model, dict):
        return str(model)
    parts = []
    for k, v in model.items():
        if isinstance(v, dict):
            parts.append(f"{k}: ({_fmt_model(v)})")
        elif isinstance(v, int) and not isinstance(v, bool):
            parts.append(f"{k}={v:,}")
        else:
            parts.append(f"{k}={v}")
    return ", ".join(parts)


def _shares(findings: Findings, store: Store | None) -> dict[str, float] | None:
    src = findings.header.get("sources")
    if isinstance(src, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in src.values()):
        return {str(k): float(v) for k, v in src.items()}
    if store is not None and store.n_records and store.has("batches/mixture"):
        mix = store.read("batches/mixture")
        return {s: float(mix[:, i].mean()) for i, s in enumerate(store.sources)}
    return None


def _versions(findings: Findings) -> dict[str, str]:
    v = findings.header.get("versions")
    if isinstance(v, dict) and v:
        return {str(k): str(x) for k, x in v.items()}
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("gradforensics", "numpy", "dask", "zarr", "h5py", "matplotlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


_SHOWN = {"store", "model", "mode", "records", "n_records", "sources", "versions", "regime", "baseline", "analyses",
          "finished"}


def is_long_history(findings: Findings) -> bool:
    """Whether the findings come from a pass in the long-history regime (header ``regime.name``)."""
    from gradforensics.analysis.contract.model import regime_of

    r = regime_of(findings.header.get("regime"))
    return r is not None and r["name"] == "long-history"


def regime_sentence(findings: Findings) -> str | None:
    """The analysis regime in one sentence (from the header's ``regime``), or None when the header has none.

    ``exact``: every record pair was compared.  ``long-history``: above ``N₀`` records
    the pass kept window means and a band of lags, so per-record maps are omitted.
    """
    from gradforensics.analysis.contract.model import regime_of

    r = regime_of(findings.header.get("regime"))
    if r is None:
        return None
    n, n0 = findings.n_records, r["n0"]
    if r["name"] == "long-history":
        return (f"{n:,} records above N₀ = {n0:,}: long-history regime, windows of {r['window']:,} records"
                f" ({r['windows']:,} windows), band {r['band']:,} lags; per-record maps omitted.")
    return f"{n:,} records, at most N₀ = {n0:,}: exact regime, every pair of records compared."


def _extra(key: str, value: Any) -> tuple[str, str]:
    """A header field the report has no special place for, readably."""
    if key == "bytes" and isinstance(value, (int, float)):
        return "Gradient bytes", fmt_bytes(float(value))
    if key == "seconds" and isinstance(value, (int, float)):
        return "Analysis time", f"{value:.1f} s"
    return key.replace("_", " ").capitalize(), _fmt_model(value)


def header_items(findings: Findings, store: Store | None) -> list[tuple[str, str]]:
    """(label, text) pairs for the report's header, known fields first."""
    from gradforensics.analysis.contract.model import baseline_of

    h = findings.header
    items = [("Store", findings.store)]
    model = h.get("model") or (store.meta.model if store is not None else None)
    if model:
        items.append(("Model", _fmt_model(model)))
    items.append(("Mode", findings.mode + (" (history over optimizer steps)" if findings.mode == "training"
                                           else " (batches replayed through one checkpoint)")))
    items.append(("Records", f"{findings.n_records:,}"))
    shares = _shares(findings, store)
    if shares:
        items.append(("Sources", ", ".join(f"{k} {v:.0%}" for k, v in shares.items())))
    else:
        items.append(("Sources", ", ".join(findings.sources) or "—"))
    items.append(("Analyses", analyses_item(findings)))
    regime = regime_sentence(findings)
    if regime:
        items.append(("Regime", regime))
    base = baseline_of(h.get("baseline"))
    if base is not None:
        items.append(("Baseline", f"judged against {base['store']} ({base['n_records']:,} records): "
                                  f"{base['context']} finding(s) it shows as strongly are context, below 0.5"))
    for k, v in h.items():
        if k not in _SHOWN and v not in (None, "", {}, []):
            items.append(_extra(k, v))
    items.append(("Versions", ", ".join(f"{k} {v}" for k, v in _versions(findings).items())))
    return items


def analyses_item(findings: Findings) -> str:
    """The analyses the findings hold, grouped by when they ran when the header says, latest first (a partial
    pass, ``only=``, merges into the results committed before): ``drift (2026-05-02 10:00 UTC); conflict,
    noise, ... (2026-05-01 09:12 UTC)``."""
    when = findings.header.get("analyses")
    if not findings.results:
        return "none"
    if not isinstance(when, dict) or not when:
        return ", ".join(findings.results)
    by: dict[str, list[str]] = {}
    for n in findings.results:
        w = when.get(n)
        at = str(w).replace("T", " ").replace("+00:00", " UTC") if isinstance(w, str) else "time not recorded"
        by.setdefault(at, []).append(n)
    return "; ".join(f"{', '.join(names)} ({at})" for at, names in sorted(by.items(), reverse=True))


def _picture(fig: Any, stem: str, alt: str, note: str | None = None) -> Picture:
    png = figures.to_png(fig)
    figures.discard(fig)
    return Picture(stem, png, alt, note)


def build(findings: Findings, store: Store | None = None, ordered: dict[str, Any] | None = None) -> Document:
    """Everything the renderers need, figures included.

    Figures are drawn with matplotlib's mathtext off: a name from a store that
    holds ``$`` is drawn as written, never parsed (a malformed ``$...$`` would
    otherwise fail the whole report).  *ordered*: the results' tables in
    :func:`~gradforensics.reporting.tables.contract_order`, by analysis name, when made already.
    """
    import matplotlib as mpl

    with mpl.rc_context({"text.parse_math": False}):
        return _build(findings, store, ordered or {})


def _build(findings: Findings, store: Store | None, ordered: dict[str, Any]) -> Document:
    groups = summary.group(findings.flags)
    shown, n_more = summary.sentences(findings, groups)
    experts = _experts_units(findings, store)
    data = figures.overview_data(findings, experts)
    heads = data.heads
    split = f", each block split into {data.word} 0–{heads - 1}" if heads > 1 else ""
    ov = _picture(figures.overview(findings, data), "overview",
                  f"Map of the highest flag severity per layer (columns{split}) and analysis (rows); "
                  "the number in a block is its highest severity at or above 0.5; grey: not analysed, "
                  "nothing to read or not judged (the row name says which).")
    problems: list[str] = []
    sections = []
    said: dict[int, str] = {}
    canvas = figures.new_figure(*figures.EVIDENCE_SIZE)     # one figure for every finding: its renderer is reused
    for g in groups:
        pic = None
        if g.index < MAX_FIGURES:
            fig, note = figures.evidence(findings, g, canvas)
            stem = f"finding-{g.index + 1:02d}-{g.kind}"
            pic = _picture(fig, stem, f"Evidence for finding {g.index + 1}: {g.kind} on {g.top.tensor}.", note)
            if note:
                problems.append(f"finding {g.index + 1} ({g.kind}, {g.top.tensor}): {note}")
        tips = advice.advice_for(g.kind, g.flags, findings.mode, len(findings.sources))
        said[g.index] = g.sentence(findings.n_records)          # once: for its section and the summary
        sections.append(Section(g, said[g.index], pic, tips, advice.references_for(g.kind)))
    _add_records_map(findings, store, sections)
    cols, rows = tables.layer_table(findings)
    return Document(
        title=f"gradforensics report — {findings.store}",
        header=header_items(findings, store),
        headline=summary.headline(findings),
        verdict=summary.verdict(findings, groups),
        sentences=[(g, said[g.index] if g.index in said else g.sentence(findings.n_records)) for g in shown],
        n_more=n_more,
        overview=ov,
        sections=sections,
        layer_columns=cols,
        layer_rows=rows,
        analysis_tables={n: ordered[n] if n in ordered else tables.contract_order(r.table)
                         for n, r in findings.results.items()},
        problems=problems,
        regime=regime_sentence(findings) if is_long_history(findings) else None,
        timeline=timeline_section.build(findings, groups),
        experts=experts,
    )


def _experts_units(findings: Findings, store: Store | None) -> frozenset[str]:
    """The report's mixture-of-experts units: the store's (``grads/<unit>`` with attribute ``experts``, when the
    store opens) and every tensor a flag names an expert of."""
    out = set(names.experts_units(findings.flags))
    st = _open_for_map(findings, store)
    if st is not None:
        out |= {t for t, info in st.grads.items() if info.attrs.get("experts")}
    return frozenset(out)


def _open_for_map(findings: Findings, store: Store | None) -> Store | None:
    """*store*, else the findings' own store when it is a local path that opens (only its saved K is read)."""
    import os

    if store is not None:
        return store
    from gradforensics.errors import GradforensicsError
    from gradforensics.store.reader import Store as _Store

    if not findings.store or not os.path.exists(findings.store):
        return None
    try:
        return _Store(findings.store, check_chunks=False)
    except (GradforensicsError, OSError, ValueError):
        return None


def _add_records_map(findings: Findings, store: Store | None, sections: list[Section]) -> None:
    """Put the records map (or the line saying why there is none) into the top direction finding's section."""
    flag = recordsmap.pick(findings)
    if flag is None:
        return
    section = next((s for s in sections if flag in s.finding.flags), None)
    if section is None:
        return
    try:
        fig, why, m = recordsmap.build(findings, _open_for_map(findings, store))
    except Exception as exc:  # the map is an extra: it must never sink the report
        fig, why, m = None, f"the records map could not be drawn ({type(exc).__name__}: {exc})", None
    if fig is None or m is None:
        section.records_map_note = f"No records map: {why}." if why else None
        return
    stem = f"records-map-{section.finding.index + 1:02d}-{section.finding.kind}"
    where = m.where()
    section.records_map = _picture(fig, stem, f"Records map of {where}, coloured by source and by step.")
    section.records_map_caption = recordsmap.caption(m)


def severity_label(s: float) -> str:
    return f"{s:.2f} ({band(s)})"
