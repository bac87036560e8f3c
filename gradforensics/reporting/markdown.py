"""``report.md``: the same report in Markdown, to paste into a ticket.

Figures are PNG files in ``figures/`` beside it, linked relatively.  Tables
are capped (the CSVs in ``tables/`` hold everything).  Every string that may
come from a store goes through :func:`gradforensics._text.md_text` (prose,
table cells) or :func:`~gradforensics._text.md_code` (a name as code): a name
renders as itself, never as a link, HTML, a new table cell or a new line.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gradforensics._text import md_code, md_text
from gradforensics.reporting.bands import band
from gradforensics.reporting.document import Picture

if TYPE_CHECKING:
    from gradforensics.reporting.document import Document, Section

__all__ = ["MAX_FLAG_ROWS", "MAX_LAYER_ROWS", "render"]


MAX_LAYER_ROWS = 200
MAX_FLAG_ROWS = 20


def _num(v: Any) -> str:
    """A table cell from a number (or an empty cell); strings are escaped as text."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return str(v)
    return md_text(v)


def _table(columns: list[str], rows: list[list[str]]) -> str:
    """A GFM table; *rows* hold cells already written as Markdown (:func:`_num`, ``md_text``, ``md_code``)."""
    lines = ["| " + " | ".join(md_text(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _img(pic: Picture, figdir: str) -> str:
    out = f"![{md_text(pic.alt)}]({figdir}/{pic.stem}.png)"
    return f"> **Note:** {md_text(pic.note)}\n\n{out}" if pic.note else out


def _sev(s: float) -> str:
    return f"**{s:.2f}** ({band(s)})"


def _recs(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}–{r[1]}"


def _section(doc: Document, s: Section, figdir: str) -> str:
    g = s.finding
    out = [f"### {g.index + 1}. {md_text(g.title)} — severity {_sev(g.severity)}", "", md_text(s.sentence), ""]
    if s.picture is not None:
        out += [_img(s.picture, figdir), ""]
    if s.records_map is not None:
        out += [_img(s.records_map, figdir), "", f"*{md_text(s.records_map_caption)}*", ""]
    elif s.records_map_note:
        out += [f"*{md_text(s.records_map_note)}*", ""]
    rows = [[md_code(f.tensor, table=True), _num(doc.head_text(f.tensor, f.head)), f"{f.severity:.2f}", _recs(f.records),
             md_text(", ".join(f.sources)), md_text(f.summary)] for f in g.flags[:MAX_FLAG_ROWS]]
    out += [_table(["tensor", "head", "severity", "records", "sources", "what the analysis says"], rows), ""]
    if len(g.flags) > MAX_FLAG_ROWS:
        out += [f"… and {len(g.flags) - MAX_FLAG_ROWS} more flags in `flags.json`.", ""]
    out += ["**What to try next**", ""] + [f"- {md_text(a)}" for a in s.advice] + [""]
    if s.references:
        out += ["References: " + "; ".join(md_text(r) for r in s.references) + ".", ""]
    return "\n".join(out)


def _unit_words(doc: Document) -> str:
    """What a ``head`` cell counts in this report: ``head``, or ``head or expert`` when it has experts units."""
    return "head or expert" if doc.experts else "head"


def _layer_rows(doc: Document) -> list[list[str]]:
    analyses = doc.layer_columns[3:-2]
    rows = []
    for r in doc.layer_rows[:MAX_LAYER_ROWS]:
        vals = [("" if r[a] is None else "—" if r[a] == 0 else f"{r[a]:.2f}") for a in [*analyses, "max"]]
        rows.append([_num(r["layer"]), md_code(r["tensor"], table=True), _num(doc.head_text(r["tensor"], r["head"])), *vals, md_text(r["flags"])])
    return rows


def _timeline(doc: Document, figdir: str) -> list[str]:
    """The opening section, "What moved first" (:mod:`gradforensics.reporting.timeline`)."""
    t = doc.timeline
    if t is None:
        return []
    out = ["## What moved first", "", md_text(t.intro), ""]
    for m in t.moments:
        out += [f"### {md_text(m.title)}", ""]
        out += [f"{i + 1}. {md_text(text)}" + (f" ([see it](#{a}))" if a else "") for i, (text, a) in enumerate(m.items)]
        out += [""] + ([f"… and {m.more} more in `flags.json`.", ""] if m.more else [])
        if m.png is not None:
            out += [_img(Picture(m.stem, m.png, m.alt), figdir), ""]
    return [*out, f"*{md_text(t.test)}*", ""]


def render(doc: Document, figdir: str = "figures") -> str:
    """The whole ``report.md`` as a string; figures are expected in *figdir* beside it."""
    out = [f"# {md_text(doc.title)}", "", md_text(doc.verdict), ""]
    if doc.regime:
        out += [f"*{md_text(doc.regime)}*", ""]
    if doc.problems:
        out += [f"> Report problem: {md_text(p)}\n>" for p in doc.problems] + [""]
    out += _timeline(doc, figdir)
    out += ["## At a glance", "", _img(doc.overview, figdir), "", "## Findings", "", md_text(doc.headline), ""]
    out += [f"{i + 1}. {_sev(g.severity)} {md_text(g.kind)} — {md_text(text)}" for i, (g, text) in enumerate(doc.sentences)]
    if doc.n_more:
        out += ["", f"… and {doc.n_more} more finding(s) below."]
    out += [""]
    out += [_section(doc, s, figdir) for s in doc.sections] or ["No findings.", ""]
    out += ["## Layer by layer", "",
            f"Highest flag severity per tensor (and {_unit_words(doc)}) and analysis; — analysed, no flag; "
            "empty: not analysed.", ""]
    out += [_table(doc.layer_columns, _layer_rows(doc)), ""]
    if len(doc.layer_rows) > MAX_LAYER_ROWS:
        out += [f"First {MAX_LAYER_ROWS} of {len(doc.layer_rows)} rows; see report.html or `tables/`.", ""]
    out += ["## Analysis tables", ""] + [f"- {md_code(f'tables/{n}.csv')} ({len(t)} rows)"
                                         for n, t in doc.analysis_tables.items()]
    out += ["", "## The run", "", _table(["", ""], [[f"**{md_text(k)}**", md_text(v)] for k, v in doc.header])]
    return "\n".join(out) + "\n"
