"""Two runs' findings, flag by flag: what a fix resolved, what it left, what it broke.

``compare_findings(before, after)`` pairs the flags of two
:class:`~gradforensics.analysis.contract.model.Findings` of one model by finding,
:func:`~gradforensics.analysis.contract.registry.flag_key` - ``(kind, tensor, head,
sources)``, the sources only for a kind whose finding is about them (conflict: the
pair), ``()`` otherwise; ``whatif`` pairs its arms by the same key - and gives each
pair a status (design, "Comparing runs"):

==============  ==========================================================
``resolved``    a finding before (severity >= 0.5), none after (< 0.5 or no flag)
``new``         none before, a finding after
``worse``       a finding after, and after - before >= 0.2
``persisting``  a finding before and after, not 0.2 worse
==============  ==========================================================

0.5 is the report's action threshold (``medium``: a healthy run does not get
there); a key with no flag on one side counts as severity 0 there.  Keys below
0.5 on both sides are no finding either time and are left out (counted in
:attr:`Comparison.n_below`); so are the flags of an analysis that ran on only one
side (nothing to compare with: :attr:`Comparison.one_sided`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from gradforensics.analysis.contract.registry import flag_key
from gradforensics.reporting.bands import SEVERITY_NAMES
from gradforensics.reporting.figures import analysis_name
from gradforensics.reporting.severity import reaches

if TYPE_CHECKING:
    from pathlib import Path

    import pandas as pd

    from gradforensics.analysis.contract.advice import FlagKey
    from gradforensics.analysis.contract.model import Findings, Flag

__all__ = ["ACT", "COLUMNS", "STATUSES", "WORSE", "Comparison", "Row", "compare_findings", "status_of"]

Status = Literal["new", "worse", "persisting", "resolved"]
#: Statuses in the order the report lists them: what needs attention first.
STATUSES: tuple[Status, ...] = ("new", "worse", "persisting", "resolved")
#: A flag at or above this severity is a finding (the report's ``medium`` band).
ACT = SEVERITY_NAMES["medium"]
#: A finding whose severity rose by at least this much is ``worse``.
WORSE = 0.2
#: Columns of ``tables/compare.csv`` (design contract).
COLUMNS = ("kind", "tensor", "head", "sources", "severity_before", "severity_after", "status")
_EPS = 1e-9


def status_of(before: float | None, after: float | None) -> Status | None:
    """The status of a key flagged at *before* / *after* (None: no flag there), or None if below 0.5 both times."""
    b, a = before or 0.0, after or 0.0
    was, now = b >= ACT - _EPS, a >= ACT - _EPS
    if was and not now:
        return "resolved"
    if now and not was:
        return "new"
    if now and a - b >= WORSE - _EPS:
        return "worse"
    return "persisting" if now else None


@dataclass(frozen=True)
class Row:
    """One finding (:func:`~gradforensics.analysis.contract.registry.flag_key`) compared; the flags are the most
    severe of that key on each side, and ``sources`` are the shown flag's (the key's for a conflict)."""

    kind: str
    tensor: str
    head: int | None
    sources: tuple[str, ...]
    before: Flag | None
    after: Flag | None
    status: Status

    @property
    def severity_before(self) -> float | None:
        return None if self.before is None else round(float(self.before.severity), 4)

    @property
    def severity_after(self) -> float | None:
        return None if self.after is None else round(float(self.after.severity), 4)

    @property
    def changed(self) -> bool:
        return self.status != "persisting"

    @property
    def flag(self) -> Flag:
        """The flag that locates this row (after if there is one, else before)."""
        flag = self.after or self.before
        assert flag is not None
        return flag

    @property
    def unit_word(self) -> str:
        """What ``head`` counts: ``expert`` when either side's flag names an expert (``evidence["expert"]``)."""
        return "expert" if any("expert" in (f.evidence or {}) for f in (self.before, self.after) if f is not None) \
            else "head"

    @property
    def where(self) -> str:
        """``tensor``, ``tensor head 3`` or ``tensor expert 3``."""
        return self.tensor + ("" if self.head is None else f" {self.unit_word} {self.head}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "tensor": self.tensor, "head": self.head, "sources": list(self.sources),
                "severity_before": self.severity_before, "severity_after": self.severity_after,
                "status": self.status,
                "summary_before": None if self.before is None else self.before.summary,
                "summary_after": None if self.after is None else self.after.summary}


@dataclass
class Comparison:
    """What :func:`compare_findings` found; ``paths`` is filled in when it is written."""

    before: Findings
    after: Findings
    rows: list[Row]
    n_below: int = 0
    one_sided: dict[str, str] = field(default_factory=dict)   # analysis -> "before" / "after"
    labels: tuple[str, str] = ("before", "after")             # the store paths as given
    paths: dict[str, Path] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def reaching(self, threshold: float) -> list[Row]:
        """``new`` / ``worse`` rows whose severity after reaches *threshold* (``--fail-on``: :func:`reaches`)."""
        return [r for r in self.rows if r.status in ("new", "worse") and reaches(r.severity_after or 0.0, threshold)]

    def to_json(self) -> dict[str, Any]:
        """The ``compare.json`` document."""
        def side(f: Findings, label: str) -> dict[str, Any]:
            return {"store": label, "n_records": int(f.n_records), "mode": f.mode, "sources": list(f.sources),
                    "analyses": sorted(f.results)}

        return {"schema": 1, "before": side(self.before, self.labels[0]), "after": side(self.after, self.labels[1]),
                "rule": {"act": ACT, "worse": WORSE}, "counts": self.counts(), "n_below": self.n_below,
                "one_sided": dict(sorted(self.one_sided.items())), "rows": [r.to_dict() for r in self.rows]}

    def table(self) -> pd.DataFrame:
        """``tables/compare.csv`` as a frame (:data:`COLUMNS`; sources joined by ``,``; empty: no flag)."""
        import pandas as pd

        t = pd.DataFrame([[r.kind, r.tensor, r.head, ",".join(r.sources), r.severity_before, r.severity_after,
                           r.status] for r in self.rows], columns=list(COLUMNS))
        t["head"] = t["head"].astype("Int64")
        for c in ("severity_before", "severity_after"):
            t[c] = t[c].astype("Float64")
        return t


def _by_key(flags: Iterable[Flag], findings: Findings, keep: set[str]) -> dict[FlagKey, Flag]:
    """The most severe flag of each finding (:func:`flag_key`), for flags of the analyses in *keep*."""
    out: dict[FlagKey, Flag] = {}
    for f in flags:
        if analysis_name(f, findings) not in keep:
            continue
        key = flag_key(f)
        if key not in out or f.severity > out[key].severity:
            out[key] = f
    return out


def _order(row: Row) -> tuple[Any, ...]:
    worst = max(row.severity_before or 0.0, row.severity_after or 0.0)
    return (STATUSES.index(row.status), -worst, row.kind, row.tensor, -1 if row.head is None else row.head,
            row.sources)


def compare_findings(before: Findings, after: Findings, labels: tuple[str, str] = ("before", "after")) -> Comparison:
    """Pair the flags of *before* and *after* by finding (:func:`flag_key`) and give each a status.

    Parameters
    ----------
    before, after
        Findings of two runs of one model (the caller checks it is one model).
    labels
        How the two runs are named in the outputs (the store paths as given).

    Returns
    -------
    Comparison
        Rows sorted new, worse, persisting, resolved, then by the higher severity.
    """
    ran_b, ran_a = set(before.results), set(after.results)
    both = ran_b & ran_a
    one_sided = {n: "before" for n in ran_b - ran_a} | {n: "after" for n in ran_a - ran_b}
    b, a = _by_key(before.flags, before, both), _by_key(after.flags, after, both)
    rows, n_below = [], 0
    for key in set(b) | set(a):
        fb, fa = b.get(key), a.get(key)
        status = status_of(None if fb is None else fb.severity, None if fa is None else fa.severity)
        if status is None:
            n_below += 1
            continue
        row = Row(key[0], key[1], key[2], key[3], fb, fa, status)
        rows.append(replace(row, sources=tuple(row.flag.sources)))  # keyed as a set (or not), shown as flagged
    return Comparison(before, after, sorted(rows, key=_order), n_below, one_sided, labels)
