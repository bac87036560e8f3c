"""The outputs of ``gradforensics compare``: ``report.html``, ``report.md``, ``compare.json``, ``tables/compare.csv``.

Each changed row (``new``, ``worse``, ``resolved``) gets a side-by-side figure:
the analysis's own ``plot`` drawn on the *before* findings and on the *after*
findings, one Axes each (``figures/compare-NN-<kind>.png``).  On the side where
the key has no flag, the other side's flag locates the tensor, so the same
evidence is drawn for the run that does not show it.

Names from either store are data: escaped for Markdown
(:mod:`gradforensics._text`), HTML and CSV; every path is built with
:func:`~gradforensics.reporting.paths.under`.
"""

from __future__ import annotations

import base64
import json
import os
import textwrap
import warnings
from dataclasses import replace
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from gradforensics._text import md_code, md_text, terminal, visible
from gradforensics.errors import PlotBugWarning
from gradforensics.reporting.comparison import ACT, WORSE, Comparison, Row
from gradforensics.reporting.figures import analysis_name, new_figure, to_png
from gradforensics.reporting.html import CSS, dotted
from gradforensics.reporting.paths import under
from gradforensics.reporting.tables import csv_safe

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from gradforensics.analysis.contract.model import Findings, Flag

__all__ = ["MAX_FIGURES", "MAX_ROWS", "RULE", "render_html", "render_markdown", "side_by_side", "write"]

#: Side-by-side figures drawn at most (most important changes first); the table lists every row.
MAX_FIGURES = 24
#: Rows shown in report.md / report.html (compare.csv and compare.json hold all).
MAX_ROWS = 500

RULE = (f"A flag at or above {ACT} is a finding (the report's action threshold). "
        f"resolved: a finding before, none after; new: none before, a finding after; "
        f"worse: a finding after whose severity rose by {WORSE} or more; persisting: a finding both times. "
        f"No flag on one side counts as severity 0 there; keys below {ACT} in both runs are left out.")


# ------------------------------------------------------------------ figures
def _note(ax: Axes, text: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(text, 60)), ha="center", va="center", fontsize=8,
            color="#444444", transform=ax.transAxes)


def _draw(ax: Axes, findings: Findings, flag: Flag, own: bool) -> None:
    """The analysis's plot of *flag* on *findings*, or a note saying why there is none."""
    from gradforensics.analysis import REGISTRY

    name = analysis_name(flag, findings)
    an, res = REGISTRY.get(name), findings.results.get(name)
    if an is None or res is None:
        _note(ax, f"No figure: no {name!r} analysis result here.")
        return
    try:
        an.plot(res, flag, ax)
    except Exception as exc:  # a plot bug must not sink the comparison
        ax.clear()
        if own:
            warnings.warn(terminal(f"compare: {flag.kind} on {flag.tensor}: {name} plot() raised "
                                   f"{type(exc).__name__}: {exc}"), PlotBugWarning, stacklevel=3)
        _note(ax, f"No figure: {name} plot() raised {type(exc).__name__}"
                  + ("." if own else " (this run holds no evidence series for it)."))
        return
    if not (ax.has_data() or ax.images or ax.texts):
        _note(ax, f"No figure: {name} plot() drew nothing for this run.")


def side_by_side(row: Row, before: Findings, after: Findings, labels: tuple[str, str]) -> Figure:
    """The evidence of *row* in the run before (left) and after (right), one Axes each."""
    fig = new_figure(12.0, 4.0)
    axes = fig.subplots(1, 2)
    for ax, findings, own, label in ((axes[0], before, row.before, labels[0]), (axes[1], after, row.after, labels[1])):
        shown = own or row.flag
        if set(shown.sources) == set(row.sources):     # both panels name the sources in the row's order
            shown = replace(shown, sources=tuple(row.sources))
        _draw(ax, findings, shown, own is not None)
        if own is not None:
            lines = [f"{visible(label)}: severity {own.severity:.2f}"]
            lines += [textwrap.fill(t, 80) for t in ax.get_title().split("\n") if t]
        else:   # the plot's own title speaks of the other run's flag: say what these cells are instead
            lines = [f"{visible(label)}: no {row.kind} flag here",
                     textwrap.fill(visible(f"the same cells as the other run's flag: {row.where}"), 80)]
        ax.set_title("\n".join(lines), fontsize=8)
    head = "" if row.head is None else f", {row.unit_word} {row.head}"
    fig.suptitle(visible(f"{row.status}: {row.kind} on {row.tensor}{head}"), fontsize=10)
    return fig


def _png(fig: Figure, row: Row) -> bytes:
    """PNG bytes of *fig*; a name matplotlib cannot typeset yields a note figure, not a crash."""
    try:
        return to_png(fig)
    except Exception as exc:
        warnings.warn(terminal(f"compare: figure of {row.kind} on {row.tensor} not drawn ({type(exc).__name__})"),
                      PlotBugWarning, stacklevel=2)
        fig = new_figure(8.0, 1.0)
        _note(fig.add_subplot(), f"The figure could not be drawn ({type(exc).__name__}).")
        return to_png(fig)


# ------------------------------------------------------------------ text
def _sev(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _where(row: Row) -> str:
    return row.where


def _head(row: Row) -> str:
    """The ``head`` cell: the head's index, ``expert j`` on a mixture-of-experts unit, empty for a whole tensor."""
    return "" if row.head is None else f"expert {row.head}" if row.unit_word == "expert" else str(row.head)


def _headline(c: Comparison) -> str:
    n = c.counts()
    text = ", ".join(f"{v} {k}" for k, v in n.items())
    if n["new"] or n["worse"]:
        return f"{text}: the after run has findings the before run did not have, or has them worse."
    if n["persisting"]:
        return f"{text}: nothing new or worse, but findings remain."
    return f"{text}: the after run has no finding at or above {ACT}."


def _notes(c: Comparison) -> list[str]:
    out = []
    if c.n_below:
        out.append(f"{c.n_below} flag key(s) below {ACT} in both runs are not compared.")
    for name, side in sorted(c.one_sided.items()):
        out.append(f"The {name} analysis ran only on the {side} run; its flags are not compared.")
    if c.before.mode != c.after.mode:
        out.append(f"The runs were captured in different modes ({c.before.mode} before, {c.after.mode} after).")
    return out


def _side(f: Findings, label: str) -> str:
    return f"{label} — {f.mode}, {f.n_records} records, sources: {', '.join(f.sources) or 'none'}"


def render_markdown(c: Comparison, pictures: dict[int, str]) -> str:
    """``report.md``; *pictures* maps a row index to its figure's file name in ``figures/``."""
    out = ["# gradforensics compare", "", f"- before: {md_text(_side(c.before, c.labels[0]))}",
           f"- after: {md_text(_side(c.after, c.labels[1]))}", "", md_text(_headline(c)), "",
           f"_{md_text(RULE)}_", ""]
    out += [f"> {md_text(n)}" for n in _notes(c)] + ([""] if _notes(c) else [])
    out += ["## Findings compared", "", "| status | kind | tensor | head | sources | before | after |",
            "|" + "---|" * 7]
    for r in c.rows[:MAX_ROWS]:
        out.append(f"| **{r.status}** | {md_text(r.kind)} | {md_code(r.tensor, table=True)} | "
                   f"{_head(r)} | {md_text(', '.join(r.sources))} | "
                   f"{_sev(r.severity_before)} | {_sev(r.severity_after)} |")
    if not c.rows:
        out.append("| | | no finding at or above 0.5 in either run | | | | |")
    if len(c.rows) > MAX_ROWS:
        out += ["", f"First {MAX_ROWS} of {len(c.rows)} rows; `tables/compare.csv` has all."]
    out += ["", "## What changed", ""]
    for i, r in enumerate(c.rows):
        if i in pictures:
            out += [f"### {md_text(r.status)}: {md_text(r.kind)} on {md_code(_where(r))}", "",
                    f"![{md_text(r.status)} {md_text(r.kind)}](figures/{pictures[i]})", ""]
            for label, flag in (("before", r.before), ("after", r.after)):
                if flag is not None:
                    out += [f"- {label}: {md_text(flag.summary)}"]
            out.append("")
    if not pictures:
        out += ["No finding changed status.", ""]
    return "\n".join(out) + "\n"


def render_html(c: Comparison, pngs: dict[int, bytes]) -> str:
    """``report.html``: self-contained, figures embedded as base64 PNG."""
    rows = "".join(
        f'<tr class="{r.status}"><td><b>{r.status}</b></td><td>{escape(r.kind)}</td>'
        f"<td><code>{dotted(visible(r.tensor))}</code></td><td>{_head(r)}</td>"
        f"<td>{escape(visible(', '.join(r.sources)))}</td><td class=num>{_sev(r.severity_before)}</td>"
        f"<td class=num>{_sev(r.severity_after)}</td></tr>" for r in c.rows[:MAX_ROWS])
    figs = []
    for i, png in pngs.items():
        r = c.rows[i]
        says = "".join(f"<li>{label}: {escape(visible(f.summary))}</li>"
                       for label, f in (("before", r.before), ("after", r.after)) if f is not None)
        figs.append(f"<section><h3>{r.status}: {escape(r.kind)} on <code>{dotted(visible(_where(r)))}</code></h3>"
                    f'<figure><img alt="{escape(r.status)} {escape(r.kind)}" '
                    f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"></figure>'
                    f"<ul>{says}</ul></section>")
    notes = "".join(f'<div class="info">{escape(visible(n))}</div>' for n in _notes(c))    # information, not alarm
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>gradforensics compare</title>
<style>{CSS}
tr.new td,tr.worse td{{background:#fbe0cf}}tr.resolved td{{background:#e6f4ea}}</style></head>
<body><main>
<h1>gradforensics compare</h1>
<ul><li>before: {escape(visible(_side(c.before, c.labels[0])))}</li>
<li>after: {escape(visible(_side(c.after, c.labels[1])))}</li></ul>
<p class="headline">{escape(_headline(c))}</p>
<p><i>{escape(RULE)}</i></p>
{notes}
<h2 id="compared">Findings compared</h2>
<div class="scrollx"><table id="compare-table"><thead><tr><th>status</th><th>kind</th><th>tensor</th><th>head</th><th>sources</th>
<th>before</th><th>after</th></tr></thead><tbody>{rows}</tbody></table></div>
<h2 id="changed">What changed</h2>
{"".join(figs) or "<p>No finding changed status.</p>"}
</main></body></html>
"""


# ------------------------------------------------------------------ write
def write(c: Comparison, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every output of *c* into *out_dir* (created if needed); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    under(out, "tables").mkdir(exist_ok=True)
    figdir = under(out, "figures")
    figdir.mkdir(exist_ok=True)
    for old in figdir.glob("compare-*.png"):          # stale figures of an earlier comparison
        old.unlink(missing_ok=True)
    paths = {"json": under(out, "compare.json"), "csv": under(out, "tables", "compare.csv")}
    paths["json"].write_text(json.dumps(c.to_json(), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    csv_safe(c.table()).to_csv(paths["csv"], index=False, na_rep="")     # columns in the contract's order
    changed = [i for i, r in enumerate(c.rows) if r.changed][:MAX_FIGURES]
    pngs, names = {}, {}
    for n, i in enumerate(changed, 1):
        r = c.rows[i]
        pngs[i] = _png(side_by_side(r, c.before, c.after, ("before", "after")), r)
        names[i] = f"compare-{n:02d}-{r.kind}.png"
        p = under(out, "figures", names[i])
        p.write_bytes(pngs[i])
        paths[f"figures/{names[i][:-4]}"] = p
    paths["markdown"] = under(out, "report.md")
    paths["markdown"].write_text(render_markdown(c, names), encoding="utf-8")
    paths["html"] = under(out, "report.html")
    paths["html"].write_text(render_html(c, pngs), encoding="utf-8")
    c.paths = paths
    return paths
