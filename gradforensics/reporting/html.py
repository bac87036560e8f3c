"""``report.html``: one self-contained file (figures as base64 PNG, inline CSS and JS).

Nothing is fetched: no external script, stylesheet, font or image, so the file
reads the same offline, attached to a ticket or opened from a cluster's
scratch.  The only script sorts a table when its header is clicked.
"""

from __future__ import annotations

import base64
import math
import re
from html import escape
from typing import TYPE_CHECKING, Any

from gradforensics.reporting.bands import band
from gradforensics.reporting.document import Picture

if TYPE_CHECKING:
    from gradforensics.reporting.document import Document, Section

__all__ = ["CSS", "JS", "MAX_FLAG_ROWS", "MAX_TABLE_ROWS", "SELF_CHECK", "dotted", "render"]


#: Rows of a per-analysis table shown inline (the CSV has all of them).
MAX_TABLE_ROWS = 300
MAX_FLAG_ROWS = 40

CSS = """
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;margin:0;background:#f6f7f9;
overflow-wrap:break-word}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px;background:#fff}
h1{font-size:1.5em;margin:.2em 0 .6em;overflow-wrap:anywhere}
h2{margin-top:1.8em;border-bottom:2px solid #e3e5e8;padding-bottom:.2em}
h3{margin:1.4em 0 .4em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}
th,td{border:1px solid #dfe1e5;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f2f5}table.sortable th{cursor:pointer;user-select:none}
table.sortable th:after{content:" \\2195";color:#999;font-size:.8em}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.hdr th{width:9em;background:#f7f8fa}.hdr td{overflow-wrap:anywhere}
.sev{display:inline-block;min-width:3.6em;text-align:center;border-radius:4px;padding:0 .35em;font-weight:600;
font-variant-numeric:tabular-nums}
.sev.high{background:#b2182b;color:#fff}.sev.medium{background:#ef8a62;color:#000}
.sev.low{background:#fddbc7;color:#000}.sev.info{background:#e8eaed;color:#333}
td.high{background:#f4c7c3}td.medium{background:#fbe0cf}td.low{background:#fdf1e8}
ol.summary li{margin:.35em 0}.headline{font-size:1.08em;font-weight:500}
.verdict{font-size:1.12em;line-height:1.55;background:#f4f6fb;border-left:5px solid #1d4e89;padding:.6em 1em;margin:.4em 0 1em}
figure{margin:.6em 0;overflow-x:auto}figure img{max-width:100%;height:auto;border:1px solid #eee;display:block}
figcaption,.caption{font-size:13px;color:#555}
.regime{color:#444;font-style:italic;margin:-.4em 0 1em}
.note{background:#fdecea;border-left:4px solid #b2182b;padding:.4em .8em;margin:.5em 0}
.advice{background:#eef6ee;border-left:4px solid #2e7d32;padding:.3em 1em;margin:.6em 0}
.advice h4{margin:.4em 0}.refs{font-size:13px;color:#444}
section.finding{border-top:1px solid #e3e5e8;margin-top:1.4em}
.tablewrap{max-height:640px;overflow:auto;border:1px solid #e3e5e8}
.scrollx{overflow-x:auto;max-width:100%}.scrollx table{margin:0}
.tablewrap table{margin:0}.tablewrap th{position:sticky;top:0}
td code,td.name{overflow-wrap:normal;word-break:normal}td.says{min-width:16em}
#layer-table{font-size:12px}#layer-table td,#layer-table th{padding:2px 4px}
#layer-table th:nth-child(n+4):not(:last-child){writing-mode:vertical-rl;transform:rotate(180deg);
white-space:nowrap;vertical-align:bottom;text-align:left}
#layer-table td:last-child{min-width:8em}
div.info{background:#f4f6fb;border-left:4px solid #8a99b3;padding:.4em .8em;margin:.5em 0}
details{margin:.4em 0}summary{cursor:pointer}code{font-size:.95em}
.scrollhint{display:none;font-size:12px;color:#777;margin:.2em 0}
@media (max-width:720px){
main{padding:12px 12px 40px}h1{font-size:1.25em}.verdict{font-size:1.02em;padding:.5em .7em}
figure img{max-width:none;width:auto}.scrollhint{display:block}
ol.summary{padding-left:1.4em}
table.flags,table.flags tbody,table.flags tr,table.flags td{display:block}table.flags thead{display:none}
table.flags tr{border:1px solid #dfe1e5;margin:.5em 0;padding:.3em .4em}
table.flags td{border:0;padding:1px 2px;min-width:0}table.flags td:empty{display:none}
table.flags td:not(.says):before{content:attr(data-label) ": ";color:#666}
}
"""

#: Runs first: records script errors and, once loaded, how many figures decoded, as attributes of
#: <body> (``data-js-errors``, ``data-figures="decoded/total"``), so a headless browser's DOM dump
#: shows whether the page rendered.
SELF_CHECK = """
window.gfErrors=[];window.addEventListener('error',function(e){window.gfErrors.push(String(e.message));});
window.addEventListener('load',function(){var im=document.images,ok=0;
  for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;}
  document.body.setAttribute('data-figures',ok+'/'+im.length);
  document.body.setAttribute('data-js-errors',String(window.gfErrors.length));});
"""

JS = """
function gfSort(th){
  var table=th.closest('table'),tbody=table.tBodies[0],col=th.cellIndex;
  var asc=th.getAttribute('data-dir')!=='asc';
  Array.prototype.forEach.call(th.parentNode.children,function(h){h.removeAttribute('data-dir');});
  th.setAttribute('data-dir',asc?'asc':'desc');
  var rows=Array.prototype.slice.call(tbody.rows);
  function key(r){var c=r.cells[col],v=c.getAttribute('data-v');if(v===null)v=c.textContent;
    var n=parseFloat(v);return (v!==''&&!isNaN(n))?[0,n]:[v===''?2:1,v];}
  rows.sort(function(a,b){var x=key(a),y=key(b);
    if(x[0]!==y[0])return x[0]-y[0];var d=x[1]<y[1]?-1:x[1]>y[1]?1:0;return asc?d:-d;});
  rows.forEach(function(r){tbody.appendChild(r);});
}
document.addEventListener('click',function(e){var th=e.target.closest('table.sortable th');if(th)gfSort(th);});
"""


#: A dot between name parts (``layers.0.mlp``), not a decimal point (``-0.96``).
_NAME_DOT = re.compile(r"(?<=\D)\.|\.(?=\D)")


def dotted(name: str) -> str:
    """*name* escaped, with a line-break opportunity (``<wbr>``) after each dot.

    A narrow screen then breaks ``model.layers.0.self_attn.q_proj.weight`` between its
    parts, never inside one (the CSS forbids breaks within a word in name cells); a
    decimal point (``-0.96``) gets none.
    """
    return _NAME_DOT.sub(".<wbr>", escape(name))


def _sev(s: float) -> str:
    return f'<span class="sev {band(s)}" title="severity {s:.3f}">{s:.2f}</span>'


def _img(pic: Picture) -> str:
    data = base64.b64encode(pic.png).decode("ascii")
    note = f'<div class="note">{escape(pic.note)}</div>' if pic.note else ""
    return (f'{note}<figure><img id="fig-{escape(pic.stem)}" alt="{escape(pic.alt)}" '
            f'src="data:image/png;base64,{data}"></figure>'
            '<p class="scrollhint">The figure is drawn at full size: scroll it sideways.</p>')


#: a ``head`` cell on a mixture-of-experts unit (:meth:`~gradforensics.reporting.document.Document.head_text`)
_EXPERT = re.compile(r"expert \d+")


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return '<td data-v=""></td>'
    if isinstance(v, bool):
        return f"<td>{v}</td>"
    if isinstance(v, (int, float)):
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return f'<td class="num" data-v="{v!r}">{escape(text)}</td>'
    if isinstance(v, str) and _EXPERT.fullmatch(v):         # "expert 3": sorted by its index, like a head's
        return f'<td class="num" data-v="{v.split()[1]}">{escape(v)}</td>'
    return f"<td>{escape(str(v))}</td>"


def _table(columns: list[str], rows: list[list[Any]], cls: str = "sortable", tid: str = "",
           names: tuple[str, ...] = ("tensor",), says: str = "") -> str:
    """A table; cells of the *names* columns break only after dots, the *says* column keeps a readable width."""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)

    def cell(c: str, v: Any) -> str:
        label = f' data-label="{escape(c)}"'
        if c in names and isinstance(v, str):
            return f'<td{label} data-v="{escape(v)}"><code>{dotted(v)}</code></td>'
        if c == says and isinstance(v, str):
            return f'<td{label} class="says">{dotted(v)}</td>'
        return "<td" + label + _cell(v)[3:]

    body = "".join("<tr>" + "".join(cell(c, v) for c, v in zip(columns, r)) + "</tr>" for r in rows)
    idattr = f' id="{tid}"' if tid else ""
    return f'<table class="{cls}"{idattr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _layer_table(doc: Document) -> str:
    cols = doc.layer_columns
    analyses = cols[3:-2]
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    trs = []
    for r in doc.layer_rows:
        cells = [_cell(r["layer"]), f"<td><code>{dotted(r['tensor'])}</code></td>", _cell(doc.head_text(r["tensor"], r["head"]))]
        for a in [*analyses, "max"]:
            v = r[a]
            if v is None:
                cells.append('<td data-v=""></td>')
            else:
                cls = band(v) if v >= 0.25 else ""
                cells.append(f'<td class="num {cls}" data-v="{v:.4f}">{"—" if v == 0 else f"{v:.2f}"}</td>')
        cells.append(f"<td>{escape(r['flags'])}</td>")
        trs.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="tablewrap"><table class="sortable" id="layer-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(trs)}</tbody></table></div>')


def _recs(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}–{r[1]}"


def _section(doc: Document, s: Section) -> str:
    g = s.finding
    parts = [f'<section class="finding" id="{g.anchor}">',
             f"<h3>{g.index + 1}. {escape(g.title)} {_sev(g.severity)}</h3>",
             f"<p>{escape(s.sentence)}</p>"]
    if s.picture is not None:
        parts.append(_img(s.picture))
    if s.records_map is not None:
        parts.append(f'<div id="records-map">{_img(s.records_map)}'
                     f"<p class=\"caption\">{escape(s.records_map_caption)}</p></div>")
    elif s.records_map_note:
        parts.append(f'<p class="caption" id="records-map-note">{escape(s.records_map_note)}</p>')
    rows = [[f.tensor, doc.head_text(f.tensor, f.head), f"{f.severity:.2f}", _recs(f.records), ", ".join(f.sources),
             f.summary] for f in g.flags[:MAX_FLAG_ROWS]]
    more = len(g.flags) - MAX_FLAG_ROWS
    parts.append(f"<details{' open' if len(g.flags) <= 8 else ''}><summary>{len(g.flags)} flag(s)</summary>"
                 + '<div class="scrollx">'
                 + _table(["tensor", "head", "severity", "records", "sources", "what the analysis says"], rows,
                          cls="sortable flags", says="what the analysis says") + "</div>"
                 + (f"<p>… and {more} more in flags.json.</p>" if more > 0 else "") + "</details>")
    items = "".join(f"<li>{escape(a)}</li>" for a in s.advice)
    refs = "; ".join(escape(r) for r in s.references)
    parts.append(f'<div class="advice"><h4>What to try next</h4><ul>{items}</ul>'
                 + (f'<p class="refs">References: {refs}.</p>' if refs else "") + "</div>")
    parts.append("</section>")
    return "\n".join(parts)


def _analysis_table(doc: Document, name: str, t: Any) -> str:
    shown = t.head(MAX_TABLE_ROWS)
    rows = shown.astype(object).where(shown.notna(), None).values.tolist()
    if doc.experts and "head" in shown.columns and "tensor" in shown.columns:     # "expert j" on experts units
        ti, hi = list(shown.columns).index("tensor"), list(shown.columns).index("head")
        for r in rows:
            r[hi] = doc.head_text(str(r[ti]), r[hi])
    note = f"<p>First {MAX_TABLE_ROWS} rows; the CSV has all.</p>" if len(t) > MAX_TABLE_ROWS else ""
    return (f"<details><summary><code>tables/{escape(name)}.csv</code> — {len(t)} rows</summary>"
            f'<div class="tablewrap">{_table(list(map(str, t.columns)), rows)}</div>{note}</details>')


def _timeline(doc: Document) -> str:
    """The opening section, "What moved first" (:mod:`gradforensics.reporting.timeline`)."""
    t = doc.timeline
    if t is None:
        return ""
    parts = ['<h2 id="what-moved-first">What moved first</h2>', f"<p>{escape(t.intro)}</p>"]
    for m in t.moments:
        items = "".join(f'<li>{escape(text)}' + (f' (<a href="#{a}">see it</a>)' if a else "") + "</li>"
                        for text, a in m.items)
        parts.append(f'<div class="timeline"><h3>{escape(m.title)}</h3><ol>{items}</ol>'
                     + (f"<p>… and {m.more} more in flags.json.</p>" if m.more else ""))
        if m.png is not None:
            parts.append(_img(Picture(m.stem, m.png, m.alt)) + f'<p class="caption">{escape(m.alt)}</p>')
        parts.append("</div>")
    parts.append(f'<p class="caption">{escape(t.test)}</p>')
    return "\n".join(parts) + "\n"


def render(doc: Document) -> str:
    """The whole ``report.html`` as a string."""
    hdr = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in doc.header)
    summ = "".join(f'<li>{_sev(g.severity)} <a href="#{g.anchor}">{escape(g.kind)}</a> — {escape(text)}</li>'
                   for g, text in doc.sentences)
    more = (f"<p>… and {doc.n_more} more finding(s), below in order of severity.</p>" if doc.n_more else "")
    problems = "".join(f'<div class="note">Report problem: {escape(p)}</div>' for p in doc.problems)
    sections = "\n".join(_section(doc, s) for s in doc.sections) or "<p>No findings.</p>"
    details = "\n".join(_analysis_table(doc, n, t) for n, t in doc.analysis_tables.items())
    regime = f'<p class="regime" id="regime">{escape(doc.regime)}</p>\n' if doc.regime else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(doc.title)}</title>
<script>{SELF_CHECK}</script>
<style>{CSS}</style></head>
<body><main>
<h1>{escape(doc.title)}</h1>
<p class="verdict" id="verdict">{escape(doc.verdict)}</p>
{regime}{problems}
{_timeline(doc)}<h2 id="at-a-glance">At a glance</h2>
{_img(doc.overview)}<p class="caption">{escape(doc.overview.alt)}</p>
<h2 id="summary">Findings</h2>
<p class="headline">{escape(doc.headline)}</p>
<ol class="summary" id="summary-list">{summ}</ol>
{more}
<div id="findings">
{sections}
</div>
<h2 id="layers">Layer by layer</h2>
<p>Highest flag severity per tensor (and {"head or expert" if doc.experts else "head"}) and analysis; “—” analysed, no flag; empty: not analysed.
Click a column header to sort.</p>
{_layer_table(doc)}
<h2 id="tables">Analysis tables</h2>
{details}
<h2 id="run">The run</h2>
<div class="scrollx"><table class="hdr" id="header">{hdr}</table></div>
<script>{JS}</script>
</main></body></html>
"""
