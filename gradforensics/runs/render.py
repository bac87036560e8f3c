"""The what-if report: ``report.html``, ``report.md``, ``whatif.json``, ``tables/``, ``figures/loss.png``.

Sections: the verdict (per arm, which of the baseline's findings it fixes - severity
below 0.5 or no flag - and what it brings; which findings every arm keeps); the arms
(optimizer, options, mixture, whether the checkpoint's
optimizer state was loaded, last losses); the loss curves overlaid; every
finding at or above the action threshold (0.5) in any arm with its severity per
arm and a verdict - kept by every arm (the data's, not the optimizer's),
resolved by some arms (named), or new in some; each arm's top findings; and
the arm-to-arm cosines per layer (:mod:`gradforensics.runs.cosines`).

Names from the stores are data: escaped for HTML and Markdown
(:mod:`gradforensics._text`), CSV cells neutralised, paths built with
:func:`~gradforensics.reporting.paths.under`.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics._text import md_code, md_text, visible
from gradforensics.analysis.contract.registry import advice_of, flag_key
from gradforensics.reporting.comparison import ACT
from gradforensics.reporting.figures import new_figure, to_png
from gradforensics.reporting.html import CSS, dotted
from gradforensics.reporting.paths import under
from gradforensics.reporting.tables import csv_safe

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.contract.advice import FlagKey
    from gradforensics.analysis.contract.model import Findings, Flag
    from gradforensics.runs.result import WhatIf

__all__ = [
    "finding_matrix",
    "key_of",
    "loss_figure",
    "not_judged_line",
    "render_html",
    "render_markdown",
    "verdict",
    "verdict_lines",
    "write",
]

TOP = 5


# ------------------------------------------------------------------ tables
def key_of(f: Flag) -> FlagKey:
    """How a finding is matched across arms: :func:`~gradforensics.analysis.contract.registry.flag_key`.

    The same rule as ``compare`` (and so as each arm's ``compare/<arm>/`` report): kind,
    tensor, head, and the sources only where the kind's finding is about them
    (``Advice.keyed_by_sources``: a conflict *is* its pair; an oscillation's or a
    drift's sources shift from arm to arm with the trajectory).
    """
    return flag_key(f)


def _by_key(findings: Findings) -> dict[FlagKey, Flag]:
    out: dict[FlagKey, Flag] = {}
    for f in findings.flags:
        key = key_of(f)
        if key not in out or f.severity > out[key].severity:
            out[key] = f
    return out


def _found(s: float | None) -> bool:
    """A severity that is a finding (>= 0.5); ``None`` / NaN: the arm has no such flag."""
    return s is not None and not math.isnan(s) and s >= ACT


def verdict(sev: Mapping[str, float | None], base: str) -> str:
    """One sentence: which arms keep / resolve a finding (severity >= 0.5 is a finding; None: no flag)."""
    keep = [a for a, s in sev.items() if _found(s)]
    free = [a for a, s in sev.items() if not _found(s)]
    if not free:
        return "every arm keeps it: the data's (or the checkpoint's), not the optimizer's"
    if _found(sev[base]):
        return f"resolved by {', '.join(free)}; kept by {', '.join(keep)}"
    return f"new in {', '.join(keep)} (not in the baseline {base})"


def finding_matrix(res: WhatIf) -> pd.DataFrame:
    """A row per finding (:func:`key_of`) at or above 0.5 in any arm: ``kind, tensor, head, sources``,
    a severity column per arm (NaN where the arm has no such flag: shown ``-``, not 0), ``verdict``;
    kept by every arm first, then resolved, then new."""
    import pandas as pd

    arms = [r.arm.name for r in res.runs]
    keyed = {a: _by_key(res.findings[a]) for a in arms}
    keys = {k for a in arms for k, f in keyed[a].items() if f.severity >= ACT}
    rows = []
    for k in keys:
        sev = {a: round(float(keyed[a][k].severity), 4) if k in keyed[a] else math.nan for a in arms}
        srcs = sorted({s for a in arms if k in keyed[a] and keyed[a][k].severity >= ACT for s in keyed[a][k].sources})
        rows.append([k[0], k[1], k[2], ",".join(srcs), *sev.values(), verdict(sev, res.baseline)])
    t = pd.DataFrame(rows, columns=["kind", "tensor", "head", "sources", *arms, "verdict"])
    t[arms] = t[arms].astype("float64")
    t["head"] = t["head"].astype("Int64")
    if len(t):
        group = t["verdict"].str.split().str[0].map({"every": 0, "resolved": 1, "new": 2})
        t = t.assign(_g=group, _m=-t[arms].max(axis=1)).sort_values(["_g", "_m", "kind", "tensor"])
        t = t.drop(columns=["_g", "_m"]).reset_index(drop=True)
    return t


def loss_table(res: WhatIf) -> pd.DataFrame:
    import pandas as pd

    rows = [[r.arm.name, t, r.schedule[t][0], r.lrs[t], r.losses[t]] for r in res.runs for t in range(r.steps_done)]
    return pd.DataFrame(rows, columns=["arm", "step", "source", "lr", "loss"])


def _last(losses: list[float]) -> float:
    tail = np.asarray(losses[-max(1, len(losses) // 4):], dtype=np.float64)
    tail = tail[np.isfinite(tail)]
    return float(tail.mean()) if tail.size else math.nan


def arm_rows(res: WhatIf) -> list[dict[str, Any]]:
    """One dict per arm; ``n_findings`` counts its findings at or above 0.5 as the report groups them,
    ``n_flags`` the flags they gather."""
    from gradforensics.reporting.summary import group

    out = []
    for r in res.runs:
        out.append({"arm": r.arm.name, "optimizer": r.arm.optimizer, "options": dict(r.arm.options),
                    "mixture": None if r.arm.mixture is None else dict(r.arm.mixture), "store": str(r.store),
                    "steps": r.steps_done, "optimizer_state": r.state_note,
                    "first_loss": r.losses[0] if r.losses else None, "last_quarter_loss": _last(r.losses),
                    "n_findings": len(group(hits := [f for f in res.findings[r.arm.name].flags if f.severity >= ACT])),
                    "n_flags": len(hits)})
    return out


# ------------------------------------------------------------------ figure
def loss_figure(res: WhatIf) -> bytes:
    """Loss per step, one line per arm, on one Axes."""
    fig = new_figure(8.0, 3.2)
    ax = fig.add_subplot()
    for r in res.runs:
        ax.plot(np.arange(r.steps_done), r.losses, marker=".", ms=3, lw=1.2, label=r.arm.name)
    ax.set_xlabel("step after the checkpoint")
    ax.set_ylabel("loss")
    ax.set_title("loss per step, every arm on the same batches")
    ax.legend(fontsize=8)
    return to_png(fig)


# ------------------------------------------------------------------ text
def _num(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _opts(a: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in a["options"].items())
    if a["mixture"] is not None:
        text += "; mixture " + ", ".join(f"{s}:{w:g}" for s, w in a["mixture"].items())
    return text


def _cos_rows(res: WhatIf) -> pd.DataFrame:
    c = res.cosines
    return c[(c["arm_a"] == res.baseline) | (c["arm_b"] == res.baseline)]


def _finding_of(kind: str, sources: str) -> str:
    """The finding a row of the matrix belongs to: its kind, with its sources where the kind's finding is
    about them (a conflict is its pair; an oscillation's poles shift from arm to arm)."""
    advice = advice_of(kind)
    keyed = advice is not None and advice.keyed_by_sources
    return f"{kind} ({sources.replace(',', ', ')})" if keyed and sources else kind


def _told(finding: pd.DataFrame, where: pd.DataFrame, before: str, after: str) -> str:
    """One finding as words: ``conflict (en, zh) on 8 tensors (1.00 → -)``: where it is (the rows *where*),
    and its highest severity in the arm *before* and in *after* over all its rows."""
    head = _head(where["head"].iloc[0])
    at = (f"{where['tensor'].iloc[0]}" + (f" head {head}" if head else "")) if len(where) == 1 \
        else f"{len(where)} tensors"
    return f"{finding['finding'].iloc[0]} on {at} ({_sev(finding[before].max())} → {_sev(finding[after].max())})"


def verdict_lines(res: WhatIf, m: pd.DataFrame) -> list[str]:
    """What the report opens with: per arm, which of the baseline's findings it fixes (no flag of it at or
    above 0.5 left, anywhere), keeps, and brings; then the findings every arm keeps.

    A finding here is a kind (with its sources for a conflict), wherever it sits: an arm that moves a
    conflict from one layer to another keeps it.
    """
    arms = [r.arm.name for r in res.runs]
    base = res.baseline
    unjudged = not_judged_line(res)
    if not len(m):
        if unjudged:                # an analysis could not have fired: no "nothing to fix"
            return [f"No arm has a finding at or above {ACT}, but that is not an all-clear: {unjudged}"]
        return [f"No arm has a finding at or above {ACT}: nothing to fix."]
    m = m.assign(finding=[_finding_of(k, s) for k, s in zip(m["kind"], m["sources"], strict=True)])
    found = m[arms].ge(ACT)                      # NaN (no flag) is not a finding
    has = {a: set(m.loc[found[a], "finding"]) for a in arms}
    order = list(dict.fromkeys(m["finding"]))

    def told(names: list[str], side: str, a: str) -> str:
        return "; ".join(_told(m[m["finding"] == n], m[(m["finding"] == n) & found[side]], base, a) for n in names)

    lines = []
    for a in arms:
        if a == base:
            continue
        fixed = [n for n in order if n in has[base] and n not in has[a]]
        kept = [n for n in order if n in has[base] and n in has[a]]
        new = [n for n in order if n not in has[base] and n in has[a]]
        text = f"{a} fixes {told(fixed, base, a)}." if fixed else f"{a} fixes none of the baseline {base}'s findings."
        if kept:
            text += f" Keeps {told(kept, a, a)}."
        if new:
            text += f" New: {told(new, a, a)}."
        lines.append(text)
    every = [n for n in order if all(n in has[a] for a in arms)]
    lines.append(f"Every arm keeps {', '.join(every)}: the data's (or the checkpoint's), not the optimizer's."
                 if every else "No finding is kept by every arm.")
    if unjudged:
        lines.append(unjudged[:1].upper() + unjudged[1:])
    return lines


def not_judged_line(res: WhatIf) -> str:
    """What the arms' analyses could not judge (``Findings.not_judged``), each kind once with the arms it
    concerns: ``not judged: conflict in every arm (too few records per source: ...; needs ≥ 4 ...).`` ("" if
    every arm's analyses could judge their run)."""
    arms = [r.arm.name for r in res.runs]
    by: dict[str, tuple[str, list[str]]] = {}
    for a in arms:
        for n in res.findings[a].not_judged:
            by.setdefault(n.kind, (n.sentence(), []))[1].append(a)
    if not by:
        return ""
    parts = [f"{text} in {'every arm' if len(who) == len(arms) else ', '.join(who)}" for text, who in by.values()]
    return "not judged: " + "; ".join(parts) + "."


def _headline(res: WhatIf, m: pd.DataFrame) -> str:
    if not len(m):
        return f"No arm has a finding at or above {ACT}."
    every = int((m["verdict"].str.startswith("every")).sum())
    resolved = int((m["verdict"].str.startswith("resolved")).sum())
    new = int((m["verdict"].str.startswith("new")).sum())
    return (f"{len(m)} flag(s) at or above {ACT} in some arm: {every} kept by every arm, {resolved} resolved "
            f"by some arm, {new} new in some arm (baseline: {res.baseline}).")


def render_markdown(res: WhatIf, m: pd.DataFrame) -> str:
    arms = arm_rows(res)
    names = [a["arm"] for a in arms]
    out = ["# gradforensics what-if", "", "## Verdict", "", *[f"- {md_text(line)}" for line in verdict_lines(res, m)],
           "", md_text(_headline(res, m)), "", "## Arms", "",
           "| arm | optimizer | options | optimizer state | steps | first loss | last-quarter loss | findings |",
           "|" + "---|" * 8]
    for a in arms:
        out.append(f"| {md_text(a['arm'])} | {a['optimizer']} | {md_text(_opts(a))} | {md_text(a['optimizer_state'])} "
                   f"| {a['steps']} | {_num(a['first_loss'])} | {_num(a['last_quarter_loss'])} | {_counts(a)} |")
    out += ["", "## Loss", "", "![loss per step](figures/loss.png)", "", "## Flags across arms", "",
            "| kind | tensor | head | sources | " + " | ".join(md_text(n) for n in names) + " | verdict |",
            "|" + "---|" * (5 + len(names))]
    for _, row in m.iterrows():
        sev = " | ".join(_sev(row[n]) for n in names)
        out.append(f"| {md_text(row['kind'])} | {md_code(row['tensor'], table=True)} | {_head(row['head'])} | "
                   f"{md_text(row['sources'])} | {sev} | {md_text(row['verdict'])} |")
    out += ["", "## Top findings per arm", ""]
    for n in names:
        top = [f for f in res.findings[n].flags if f.severity >= ACT][:TOP]
        out += [f"### {md_text(n)}", ""] + [f"- {f.severity:.2f} {md_text(f.kind)} on {md_code(f.tensor)}: "
                                             f"{md_text(f.summary)}" for f in top]
        out += ["- no finding at or above 0.5" if not top else "", ""]
    out += ["## Arm-to-arm cosines per layer (with the baseline)", "",
            "| arms | tensor | gradient (same batch) | update (same step) | net update |", "|---|---|---|---|---|"]
    for r in _cos_rows(res).itertuples(index=False):
        out.append(f"| {md_text(r.arm_a)} vs {md_text(r.arm_b)} | {md_code(r.tensor, table=True)} | "
                   f"{_num(r.grad_cos)} | {_num(r.update_cos)} | {_num(r.net_update_cos)} |")
    out += ["", "`tables/cosines.csv` has every pair; `compare/<arm>/report.md` the full comparison with the baseline."]
    return "\n".join(out) + "\n"


def _counts(a: dict[str, Any]) -> str:
    return f"{a['n_findings']} ({a['n_flags']} flag{'s' if a['n_flags'] != 1 else ''})"


def _sev(v: Any) -> str:
    """A severity cell: ``-`` where the arm has no such flag (not ``0.00``: no flag is not a flag of 0)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.2f}"


def _head(v: Any) -> str:
    return "" if v is None or str(v) in ("<NA>", "nan") else str(int(v))


def _cell(v: Any) -> str:
    return escape(visible(_num(v) if not isinstance(v, str) else v))


def _finding_rows(m: pd.DataFrame, names: list[str]) -> list[str]:
    """The rows of the flags-across-arms table: kind, tensor, head, sources, severity per arm, verdict."""
    fin = []
    for _, row in m.iterrows():
        sev = "".join(f'<td class="num {"bad" if _found(row[n]) else "ok"}">{_sev(row[n])}</td>' for n in names)
        head = _head(row["head"])
        fin.append(f"<tr><td>{_cell(row['kind'])}</td><td><code>{dotted(visible(str(row['tensor'])))}</code></td>"
                   f"<td>{head}</td>"
                   f"<td>{_cell(row['sources'])}</td>{sev}<td>{_cell(row['verdict'])}</td></tr>")
    return fin


def _top_findings(res: WhatIf, n: str) -> str:
    """Arm *n*'s top findings at or above :data:`ACT`, with a link to its comparison report when there is one."""
    top = [f for f in res.findings[n].flags if f.severity >= ACT][:TOP]
    items = "".join(f"<li>{f.severity:.2f} {escape(f.kind)} on <code>{_cell(f.tensor)}</code>: "
                    f"{_cell(f.summary)}</li>" for f in top) or "<li>no finding at or above 0.5</li>"
    link = (f' — <a href="compare/{escape(n)}/report.html">compared with {escape(res.baseline)}</a>'
            if n in res.comparisons and (res.out_dir / "compare" / n / "report.html").exists() else "")
    return f"<h3>{_cell(n)}{link}</h3><ul>{items}</ul>"


def render_html(res: WhatIf, m: pd.DataFrame, png: bytes) -> str:
    arms = arm_rows(res)
    names = [a["arm"] for a in arms]
    arm_tr = "".join(f"<tr><td><b>{_cell(a['arm'])}</b></td><td>{_cell(a['optimizer'])}</td><td>{_cell(_opts(a))}</td>"
                     f"<td>{_cell(a['optimizer_state'])}</td><td class=num>{a['steps']}</td>"
                     f"<td class=num>{_cell(a['first_loss'])}</td><td class=num>{_cell(a['last_quarter_loss'])}</td>"
                     f"<td class=num>{_counts(a)}</td></tr>" for a in arms)
    fin = _finding_rows(m, names)
    tops = [_top_findings(res, n) for n in names]
    cos = "".join(f"<tr><td>{_cell(r.arm_a)} vs {_cell(r.arm_b)}</td><td><code>{dotted(visible(r.tensor))}</code></td>"
                  f"<td class=num>{_cell(r.grad_cos)}</td><td class=num>{_cell(r.update_cos)}</td>"
                  f"<td class=num>{_cell(r.net_update_cos)}</td></tr>" for r in _cos_rows(res).itertuples(index=False))
    arm_th = "".join(f"<th>{_cell(n)}</th>" for n in names)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>gradforensics what-if</title>
<style>{CSS}
td.bad{{background:#fbe0cf}}td.ok{{background:#e6f4ea}}</style></head>
<body><main>
<h1>gradforensics what-if</h1>
<h2 id="verdict">Verdict</h2>
<ul id="whatif-verdict">{"".join(f"<li>{_cell(line)}</li>" for line in verdict_lines(res, m))}</ul>
<p class="headline">{escape(_headline(res, m))}</p>
<h2 id="arms">Arms</h2>
<div class="scrollx"><table id="arms-table"><thead><tr><th>arm</th><th>optimizer</th><th>options</th><th>optimizer state</th><th>steps</th>
<th>first loss</th><th>last-quarter loss</th><th>findings</th></tr></thead><tbody>{arm_tr}</tbody></table></div>
<h2 id="loss">Loss</h2>
<figure><img alt="loss per step" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"></figure>
<h2 id="findings">Flags across arms</h2>
<p><i>Severity per arm of every flag (kind, tensor, head) at or above {ACT} in some arm; green: below {ACT} in
that arm; -: that arm has no such flag.</i></p>
<div class="scrollx"><table id="findings-table"><thead><tr><th>kind</th><th>tensor</th><th>head</th><th>sources</th>{arm_th}<th>verdict</th>
</tr></thead><tbody>{"".join(fin) or '<tr><td colspan=9>no finding at or above 0.5 in any arm</td></tr>'}</tbody></table></div>
<h2 id="per-arm">Top findings per arm</h2>
{"".join(tops)}
<h2 id="cosines">Arm-to-arm cosines per layer</h2>
<p><i>gradient: mean cosine of the two arms' gradients on the same batch; update: of their weight updates at the
same step; net update: of the whole displacement over the steps. tables/cosines.csv has every pair.</i></p>
<div class="scrollx"><table id="cosine-table"><thead><tr><th>arms</th><th>tensor</th><th>gradient (same batch)</th><th>update (same step)</th>
<th>net update</th></tr></thead><tbody>{cos}</tbody></table></div>
</main></body></html>
"""


# ------------------------------------------------------------------ write
def _json(res: WhatIf, m: pd.DataFrame) -> dict[str, Any]:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v.item() if isinstance(v, np.generic) else v

    rows = [{k: clean(v) if str(v) != "<NA>" else None for k, v in r.items()} for r in m.to_dict("records")]
    return {"schema": 1, "baseline": res.baseline, "rule": {"act": ACT}, "verdict": verdict_lines(res, m),
            "arms": [{k: clean(v) for k, v in a.items()} for a in arm_rows(res)],
            "losses": {r.arm.name: [clean(x) for x in r.losses] for r in res.runs},
            "findings": rows,
            "cosines": [{k: clean(v) for k, v in r.items()} for r in res.cosines.to_dict("records")]}


def write(res: WhatIf, out_dir: Path) -> dict[str, Path]:
    """Write the report into *out_dir*; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for d in ("tables", "figures"):
        under(out_dir, d).mkdir(exist_ok=True)
    m = finding_matrix(res)
    png = loss_figure(res)
    paths = {"loss_png": under(out_dir, "figures", "loss.png"), "json": under(out_dir, "whatif.json"),
             "findings_csv": under(out_dir, "tables", "findings.csv"),
             "cosines_csv": under(out_dir, "tables", "cosines.csv"), "losses_csv": under(out_dir, "tables", "losses.csv"),
             "markdown": under(out_dir, "report.md"), "html": under(out_dir, "report.html")}
    paths["loss_png"].write_bytes(png)
    paths["json"].write_text(json.dumps(_json(res, m), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    csv_safe(m).to_csv(paths["findings_csv"], index=False, na_rep="")
    csv_safe(res.cosines).to_csv(paths["cosines_csv"], index=False, na_rep="")
    csv_safe(loss_table(res)).to_csv(paths["losses_csv"], index=False, na_rep="")
    paths["markdown"].write_text(render_markdown(res, m), encoding="utf-8")
    paths["html"].write_text(render_html(res, m, png), encoding="utf-8")
    return paths
