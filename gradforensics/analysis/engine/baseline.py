"""``analyze(..., baseline=STORE)``: each finding judged against an earlier healthy window or run of one model.

Design, "Judged against the run itself": a statistic a healthy run of the same model shows just as
strongly is the model's baseline, not this run's trouble.  :func:`findings_of` gets the baseline's
findings (its saved ``analysis/`` results when they are current, else a pass with the same analyses
and options); :func:`judge` then pairs each flag of the target with the baseline's same finding
(:func:`~gradforensics.analysis.contract.registry.flag_key`: kind, tensor, head, and the sources of a
kind keyed by them) and:

* a finding the baseline shows **as strongly** (its severity there is within :data:`STRONGER` of
  this run's) is context: its severity is capped at :data:`CONTEXT` (below the report's 0.5) and its
  summary says "as in the baseline <name>: severity x";
* a finding **absent** from the baseline, or **clearly stronger** here (by :data:`STRONGER` or more,
  ``compare``'s "worse"), keeps its severity;
* either way its evidence gains ``baseline_severity`` (0 when the baseline has no such flag; None
  when the analysis that emits it did not run on the baseline: nothing to judge it by, kept as is)
  and ``baseline_evidence`` (the baseline flag's evidence, when it has one).

A ``nonfinite`` finding is never demoted: one non-finite update corrupts the weights, however often
the baseline had one (design, flags.json).  The baseline used is recorded in the findings header,
and so in ``flags.json``
(:func:`~gradforensics.analysis.contract.model.baseline_of`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gradforensics.analysis.contract.model import Findings, Flag
from gradforensics.analysis.contract.registry import emitter_of, flag_key
from gradforensics.errors import ModelMismatchError, SpecError

if TYPE_CHECKING:
    from gradforensics.analysis.contract.advice import FlagKey
    from gradforensics.store.reader import Store

__all__ = ["CONTEXT", "EXEMPT", "STRONGER", "check_tensors", "findings_of", "judge", "name_of"]

#: A finding the baseline shows as strongly is capped here: context, below the report's 0.5.
CONTEXT = 0.45
#: A finding at least this much more severe than in the baseline is "clearly stronger" (``compare``'s worse).
STRONGER = 0.2
#: Kinds a baseline never demotes (a physical fact of this run, whatever the baseline shows).
EXEMPT = frozenset({"nonfinite"})


def name_of(store: Store) -> str:
    """How a summary names the baseline: the last part of its path."""
    return os.path.basename(store.path.rstrip("/")) or store.path


def check_tensors(target: Store, baseline: Store) -> None:
    """Refuse a baseline that shares no gradient tensor with the target (another model).

    Raises
    ------
    ModelMismatchError
        No tensor name in common (or the same store given twice: :class:`SpecError`).
    """
    if os.path.abspath(target.path) == os.path.abspath(baseline.path):
        raise SpecError(f"the baseline {baseline.path} is the store being analysed; give an earlier healthy "
                        "window or run of the same model.")
    if not set(target.tensors) & set(baseline.tensors):
        first = sorted(target.tensors)[0] if target.tensors else "none"
        raise ModelMismatchError(f"the baseline {baseline.path} holds another model: no gradient tensor in common "
                                 f"with {target.path} (its first is {first!r}); a baseline is an earlier healthy "
                                 "window or run of the same model.")


def _current(saved: Findings, baseline: Store, ran: set[str]) -> bool:
    """Whether *saved* (the baseline's stored findings) can stand for a pass now."""
    from gradforensics._version import __version__

    versions = saved.header.get("versions")
    version = versions.get("gradforensics") if isinstance(versions, dict) else None
    return version == __version__ and saved.n_records == baseline.n_records and ran <= set(saved.results)


def findings_of(baseline: Store, ran: set[str], pass_: Any, options: Mapping[str, Any] | None) -> tuple[Findings, bool]:
    """The baseline's findings: its saved ones when current and no analysis options were given, else
    ``pass_(baseline)`` (the same analyses and options as the target's); and whether they were reused."""
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.store.results import has_result

    per_analysis = {k for k in (options or {}) if k != "engine"}
    if not per_analysis and has_result(baseline, "findings"):
        try:
            saved = read_findings(baseline)
        except Exception:           # damaged or older results: a fresh pass decides
            saved = None
        if saved is not None and _current(saved, baseline, ran):
            return saved, True
    return pass_(baseline), False


def judge(findings: Findings, baseline: Findings, name: str, *, store: str, reused: bool) -> Findings:
    """*findings* with each flag judged against *baseline* (module docstring); the header records it."""
    strongest: dict[FlagKey, Flag] = {}
    for f in baseline.flags:
        k = flag_key(f)
        if k not in strongest or f.severity > strongest[k].severity:
            strongest[k] = f
    out, n_context = [], 0
    for f in findings.flags:
        emitter = emitter_of(f.kind)
        if emitter is None or emitter.name not in baseline.results:
            out.append(replace(f, evidence={**f.evidence, "baseline_severity": None}))
            continue
        base = strongest.get(flag_key(f))
        b = 0.0 if base is None else float(base.severity)
        evidence: dict[str, Any] = {**f.evidence, "baseline_severity": round(b, 4)}
        if base is not None:
            evidence["baseline_evidence"] = dict(base.evidence)
        if base is None or f.kind in EXEMPT or f.severity - b >= STRONGER:
            summary = f.summary if base is None else f"{f.summary} (the baseline {name}: severity {b:.2f})"
            out.append(replace(f, evidence=evidence, summary=summary))
            continue
        n_context += f.severity >= 0.5
        out.append(replace(f, severity=min(float(f.severity), CONTEXT), evidence=evidence,
                           summary=f"{f.summary.rstrip('.')}; as in the baseline {name}: severity {b:.2f} "
                                   "(context: the healthy run shows it too)."))
    header = {**findings.header, "baseline": {"store": store, "n_records": int(baseline.n_records),
                                              "reused": reused, "context": n_context}}
    return replace(findings, flags=out, header=header)

