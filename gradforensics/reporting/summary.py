"""The summary in sentences: flags grouped into findings, most severe first.

Flags of one kind, with the same implicated sources and in the same severity
band, form one :class:`FlagGroup`; its sentence names the merged location
(``model.layers.5–6 q_proj/k_proj, heads 2 and 5``), what is wrong, the
evidence range, the records and the sources.  Each analysis's own one-line
``summary`` stays on its flag and is shown in the finding's section.

Which evidence a sentence quotes, and how each key reads, is the kind's declaration
(``Advice.evidence_keys`` with its labels) and nothing else; only a kind no registered
analysis emits (findings from a newer gradforensics, a plugin not loaded) falls back to
the first numeric keys of its flags.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradforensics.analysis.contract.advice import CAUSES
from gradforensics.analysis.contract.registry import advice_of
from gradforensics.reporting import advice, names
from gradforensics.reporting.bands import band

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings, Flag

__all__ = [
    "MAX_SENTENCES",
    "Cause",
    "FlagGroup",
    "evidence_phrase",
    "fmt_value",
    "group",
    "group_cause",
    "headline",
    "join_kinds",
    "not_judged_sentence",
    "rank_causes",
    "records_phrase",
    "sentences",
    "verdict",
]


#: Findings written out as sentences; the rest are counted.
MAX_SENTENCES = 12


@dataclass
class FlagGroup:
    """Flags of one kind, same sources, same severity band: one sentence, one section."""

    kind: str
    sources: tuple[str, ...]
    flags: list[Flag]
    index: int = 0

    @property
    def severity(self) -> float:
        return max(f.severity for f in self.flags)

    @property
    def band(self) -> str:
        return band(self.severity)

    @property
    def top(self) -> Flag:
        return max(self.flags, key=lambda f: f.severity)

    @property
    def tensors(self) -> list[str]:
        return list(dict.fromkeys(f.tensor for f in self.flags))

    @property
    def records(self) -> tuple[int, int]:
        return min(f.records[0] for f in self.flags), max(f.records[1] for f in self.flags)

    @property
    def anchor(self) -> str:
        return f"finding-{self.index + 1}"

    @property
    def title(self) -> str:
        return advice.info(self.kind).title

    def location(self) -> str:
        return names.location(((f.tensor, f.head) for f in self.flags), experts=names.experts_units(self.flags))

    def evidence(self, max_keys: int = 2) -> str:
        return evidence_phrase(self.kind, self.flags, max_keys)

    def sentence(self, n_records: int | None = None) -> str:
        """``<where>: <what> (<evidence>); <records>[, sources].``"""
        what = advice.phrase(self.kind, self.sources)
        ev = self.evidence()
        text = f"{self.location()}: {what}"
        if ev:
            text += f" ({ev})"
        text += f", {records_phrase(self.records, n_records)}"
        if self.sources and "{sources}" not in advice.info(self.kind).phrase:
            text += f"; sources involved: {names.join_and(list(self.sources))}"
        n = len(self.flags)
        if n > 1:
            text += f" [{n} flags]"
        return text + "."


def group(flags: Sequence[Flag]) -> list[FlagGroup]:
    """Flags -> findings, most severe first (ties: kind, then location)."""
    buckets: dict[tuple[str, tuple[str, ...], str, str], list[Flag]] = {}
    for f in flags:       # flags of one kind that name different causes (q/k growth: attention) are two findings
        key = (f.kind, tuple(f.sources), band(f.severity), advice.info(f.kind).cause_of(f))
        buckets.setdefault(key, []).append(f)
    out = [FlagGroup(kind, srcs, sorted(fl, key=lambda f: -f.severity)) for (kind, srcs, _, _), fl in buckets.items()]
    out.sort(key=lambda g: (-g.severity, g.kind, g.tensors[0]))
    for i, g in enumerate(out):
        g.index = i
    return out


def records_phrase(records: tuple[int, int], n_records: int | None = None) -> str:
    a, b = records
    if n_records and a == 0 and b >= n_records - 1 and n_records > 1:
        return f"in all {n_records} records"
    if a == b:
        return f"at record {a}"
    return f"in records {a}–{b}"


def _numbers(flags: Sequence[Flag], key: str) -> list[float] | None:
    vals: list[float] = []
    for f in flags:
        v: Any = f.evidence.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            return None
        vals.append(float(v))
    return vals


def fmt_value(key: str, v: float) -> str:
    """A number as a sentence quotes it: cosines to 2 decimals, others to 3 significant digits."""
    if key == "p_value":
        return "p < 0.001" if v < 0.001 else f"p = {v:.2g}"
    if float(v).is_integer() and abs(v) < 1e6:
        text = f"{int(v)}"
    elif key == "cosine" or 0.01 <= abs(v) < 10:
        text = f"{v:.2f}"
    elif 1000 <= abs(v) < 1e6:
        text = f"{v:,.0f}"
    else:
        text = f"{v:.3g}"
    return text.replace("-", "−")


def evidence_phrase(kind: str, flags: Sequence[Flag], max_keys: int = 2) -> str:
    """``cos −0.71 to −0.55, p < 0.001``: the kind's key evidence, as a range over the flags.

    The keys are the kind's declared ``Advice.evidence_keys`` that every flag carries as a
    finite number, in their order, read with their labels; a kind no registered analysis
    emits quotes the first such keys of its first flag.
    """
    declared = advice_of(kind)
    if declared is not None:
        keys = [k for k in declared.evidence_keys if _numbers(flags, k) is not None]
    else:
        first = flags[0].evidence if flags else {}
        keys = [k for k in first if _numbers(flags, k) is not None]
    parts = []
    for k in keys[:max_keys]:
        vals = _numbers(flags, k) or []
        label = declared.label(k) if declared is not None else k.replace("_", " ")
        if k == "p_value":
            worst = max(vals)
            parts.append("p < 0.001" if worst < 0.001 else f"p ≤ {worst:.2g}")
            continue
        lo, hi = fmt_value(k, min(vals)), fmt_value(k, max(vals))
        parts.append(f"{label} {lo}" if lo == hi else f"{label} {lo} to {hi}")
    return ", ".join(parts)


def headline(findings: Findings) -> str:
    """One sentence: how many flags act-level, where, and the worst."""
    act = [f for f in findings.flags if f.severity >= 0.5]
    if not findings.flags:
        told = (f"No finding in {findings.n_records} records: nothing recorded here looks sick "
                f"to the {len(findings.results)} analyses that ran")
        n = len(findings.not_judged)
        return told + (f"; {n} kind(s) could not be judged (see the verdict)." if n else ".")
    if not act:
        return (f"No flag reaches 0.5 (the level a healthy run stays under) in {findings.n_records} records; "
                f"{len(findings.flags)} minor flag(s) are listed below as a watch list.")
    worst = findings.flags[0]
    kinds = sorted({f.kind for f in act})
    tensors = {f.tensor for f in act}
    return (f"{len(act)} flag(s) at or above 0.5 on {len(tensors)} tensor(s) ({', '.join(kinds)}); the most severe "
            f"is {worst.kind} on {names.location([(worst.tensor, worst.head)], names.experts_units([worst]))} "
            f"(severity {worst.severity:.2f}).")


def verdict(findings: Findings, groups: list[FlagGroup] | None = None) -> str:
    """The report's opening paragraph: what is wrong, where, which sources, what to try first.

    Built from the most severe finding group and, when they are of other kinds, up to
    two more groups at or above 0.5; a run with none says so and counts the watch list.
    """
    groups = group(findings.flags) if groups is None else groups
    act = [g for g in groups if g.severity >= 0.5]
    unjudged = not_judged_sentence(findings)
    if not act:
        watch = (f" {len(findings.flags)} minor flag(s) below 0.5 are a watch list: "
                 f"{join_kinds(groups)}." if groups else "")
        if unjudged:            # an analysis could not have fired: no all-clear
            return (f"Not an all-clear: no flag reaches 0.5 in {findings.n_records} records, but {unjudged}"
                    f"{watch}")
        return (f"Nothing here needs action: no flag reaches 0.5 (the level a healthy run stays under) in "
                f"{findings.n_records} records.{watch}")
    ranked = rank_causes(act)
    top = ranked[0].lead
    text = f"What is wrong: {_finding_clause(top, findings.n_records)}"
    text += " " + _causes_sentence(ranked)
    leads = [c.lead for c in ranked[1:]] + [g for g in act if g is not top]
    others = [g for g in leads if g.kind != top.kind]
    others = list({g.kind: g for g in reversed(others)}.values())[::-1][:2]
    if others:
        text += " Also: " + "; ".join(_finding_clause(g, findings.n_records).rstrip(".") for g in others) + "."
    tips = advice.advice_for(top.kind, top.flags, findings.mode, len(findings.sources))
    first = next((t for t in tips if not t.startswith("Caveat")), tips[0] if tips else "")
    first = first.removeprefix("Otherwise: ")          # the tip it follows did not apply to these flags
    first = first[:1].upper() + first[1:]
    if first:
        text += f" Try first: {first}"
        text += "" if first.endswith(".") else "."
    rest = len(act) - 1 - len(others)
    if rest > 0:
        text += f" {rest} more finding(s) at or above 0.5 are listed below."
    if unjudged:
        text += " " + unjudged[:1].upper() + unjudged[1:]
    return text


def not_judged_sentence(findings: Findings) -> str:
    """``2 kind(s) of finding could not be judged on this store: conflict (too few records per source: zh 2,
    en 2; needs ≥ 4 records per source), drift (...).`` ("" when every analysis could judge it)."""
    items = findings.not_judged
    if not items:
        return ""
    return (f"{len(items)} kind(s) of finding could not be judged on this store: "
            + ", ".join(n.sentence() for n in items) + ".")


@dataclass
class Cause:
    """One cause the findings point at: its key, the groups that agree on it, and its score."""

    key: str
    groups: list[FlagGroup]

    @property
    def label(self) -> str:
        if self.key.startswith("kind:"):
            return advice.info(self.key[5:]).title.lower()
        return CAUSES.get(self.key, self.key.replace("_", " "))

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(g.kind for g in self.groups))

    @property
    def score(self) -> float:
        """The most severe agreeing finding, plus 0.05 for every other kind that agrees (at most 1.2)."""
        return min(max(g.severity for g in self.groups) + 0.05 * (len(self.kinds) - 1), 1.2)

    @property
    def corroborated(self) -> bool:
        """A named cause (one of :data:`CAUSES`) that findings of two or more kinds agree on: a diagnosis."""
        return self.key in CAUSES and len(self.kinds) >= 2

    @property
    def lead(self) -> FlagGroup:
        """The most severe group of a kind that declares this cause itself (else the most severe group)."""
        own = [g for g in self.groups if advice.info(g.kind).cause == self.key]
        return max(own or self.groups, key=lambda g: g.severity)


#: A gradient-norm / loss line within this many steps of 2 that co-occurs with a period-2 oscillation is it.
PERIOD2_TOLERANCE = 0.35


def group_cause(g: FlagGroup, groups: Sequence[FlagGroup]) -> str:
    """The cause group *g* points at: its flags' (or kind's) declared cause, except that a periodic series at
    2 steps while an oscillation of period 2 is found is that oscillation (learning rate vs curvature, unless
    the oscillation's own evidence names the data order: then the series keeps its own cause)."""
    if g.kind == "loss_spectrum" and _near_two(g, "period_steps") and any(
            o.kind == "oscillation" and _near_two(o, "period_records")
            and advice.info(o.kind).cause_of(o.top) == "learning_rate" for o in groups):
        return "learning_rate"              # not when the oscillation's own evidence says it is the data order
    info = advice.info(g.kind)
    return info.cause_of(g.top) or f"kind:{g.kind}"


def _near_two(g: FlagGroup, key: str) -> bool:
    vals = [v for v in (f.evidence.get(key) for f in g.flags) if isinstance(v, (int, float))]
    return any(math.isfinite(float(v)) and abs(float(v) - 2.0) <= PERIOD2_TOLERANCE for v in vals)


def rank_causes(groups: Sequence[FlagGroup]) -> list[Cause]:
    """Causes of *groups* (findings at or above 0.5), most likely first.

    A named cause that findings of two or more kinds agree on (collapsed heads, logit growth and q/k
    spectra all saying "attention") comes before causes only one kind points at, and before symptoms
    that name no cause (a heavy-tailed spectrum, saturated units), however severe; within each tier,
    the agreeing findings' severity (:attr:`Cause.score`).
    """
    by: dict[str, list[FlagGroup]] = {}
    for g in groups:
        by.setdefault(group_cause(g, groups), []).append(g)
    causes = [Cause(k, v) for k, v in by.items()]
    causes.sort(key=lambda c: (not c.corroborated, -c.score, c.key))
    return causes


def _causes_sentence(causes: Sequence[Cause]) -> str:
    def one(c: Cause) -> str:
        ev = ", ".join(f"{k} {max(g.severity for g in c.groups if g.kind == k):.2f}" for k in c.kinds)
        return f"{c.label} ({ev})"

    text = f"Most likely cause: {one(causes[0])}"
    if len(causes) > 1:
        text += "; then " + "; ".join(one(c) for c in causes[1:3])
    return text + "."


def _finding_clause(g: FlagGroup, n_records: int | None) -> str:
    """``<title> in <where>: <what>[; sources a and b] (<evidence>; severity s).``"""
    what = advice.phrase(g.kind, g.sources)
    ev = g.evidence()
    text = f"{g.title.lower()} in {g.location()}: {what}"
    if g.sources and "{sources}" not in advice.info(g.kind).phrase:
        text += f"; sources {names.join_and(list(g.sources))}"
    return text + f" ({ev + '; ' if ev else ''}severity {g.severity:.2f})."


def join_kinds(groups: Sequence[FlagGroup]) -> str:
    kinds = list(dict.fromkeys(g.kind for g in groups))
    return names.join_and(kinds)


def sentences(findings: Findings, groups: list[FlagGroup] | None = None) -> tuple[list[FlagGroup], int]:
    """The findings to write as sentences (at most :data:`MAX_SENTENCES`), and how many were left out."""
    groups = group(findings.flags) if groups is None else groups
    return groups[:MAX_SENTENCES], max(0, len(groups) - MAX_SENTENCES)
