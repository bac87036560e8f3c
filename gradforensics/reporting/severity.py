"""Severity thresholds: the ``--fail-on`` option and the bands the report colours by.

A flag's ``severity`` is in [0, 1] and comparable across kinds (design
contract): a healthy run yields no flag above 0.5.  The named levels are

=========  =====  ==========================================================
name       value  meaning
=========  =====  ==========================================================
``low``    0.25   worth a look; expected now and then on healthy runs
``medium`` 0.50   act: a healthy run does not get here
``high``   0.75   strong, consistent evidence; fix before training further
=========  =====  ==========================================================

``--fail-on SEVERITY`` takes one of these names or a number in [0, 1]; the
command exits 1 when any flag's severity is at or above it: one rule
(:func:`reaches`), one exit code (:func:`exit_code`) for every verb that takes the
flag (``analyze``, ``report``, ``loss``, ``compare``) and for ``whatif``'s count of
findings.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from gradforensics.errors import SpecError
from gradforensics.reporting.bands import SEVERITY_NAMES

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings

__all__ = [
    "EXIT_FLAGGED",
    "TOLERANCE",
    "F",
    "HasSeverity",
    "Reaching",
    "add_fail_on_argument",
    "counts_phrase",
    "exit_code",
    "fail_on_line",
    "parse_severity",
    "reaches",
    "reaching",
]



#: Exit code of ``analyze`` / ``report`` / ``loss`` / ``compare`` when a flag reaches ``--fail-on``.
EXIT_FLAGGED = 1
#: Severities are floats computed in different ways: a flag this close below a threshold reaches it.
TOLERANCE = 1e-12

F = TypeVar("F", bound="HasSeverity")


class HasSeverity(Protocol):
    """A flag, or anything else with a ``severity`` (a flag's, or None for none)."""

    @property
    def severity(self) -> float: ...


@runtime_checkable
class Reaching(Protocol):
    """A result that says itself which of its rows reach a threshold (:class:`~gradforensics.reporting.comparison.Comparison`)."""

    def reaching(self, threshold: float) -> Sequence[object]: ...


def parse_severity(text: str | float) -> float:
    """``"high"`` / ``"0.6"`` / ``0.6`` -> a threshold in [0, 1].

    Raises
    ------
    SpecError
        Neither a known name nor a number in [0, 1].
    """
    if isinstance(text, str):
        key = text.strip().lower()
        if key in SEVERITY_NAMES:
            return SEVERITY_NAMES[key]
        try:
            value = float(key)
        except ValueError:
            value = math.nan
    else:
        value = float(text)
    if not 0.0 <= value <= 1.0:
        names = ", ".join(f"{k}={v}" for k, v in SEVERITY_NAMES.items())
        raise SpecError(f"severity must be a number in [0, 1] or one of {names}; got {text!r}.")
    return value


def _argparse_severity(text: str) -> float:
    try:
        return parse_severity(text)
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_fail_on_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--fail-on SEVERITY`` to a command's parser (``analyze``, ``report``)."""
    parser.add_argument(
        "--fail-on", type=_argparse_severity, default=None, metavar="SEVERITY",
        help="exit 1 when a flag's severity reaches SEVERITY: a number in [0, 1] or "
             + ", ".join(f"{k} (={v})" for k, v in SEVERITY_NAMES.items()),
    )


def reaches(severity: float | None, threshold: float) -> bool:
    """The ``--fail-on`` rule: *severity* is at or above *threshold* (a flag AT the threshold reaches it)."""
    return severity is not None and float(severity) >= threshold - TOLERANCE


def reaching(flags: Iterable[F], threshold: float) -> list[F]:
    """The flags whose severity is at or above *threshold* (:func:`reaches`)."""
    return [f for f in flags if reaches(f.severity, threshold)]


def exit_code(result: Findings | Reaching, fail_on: float | None, verb: str | None = None) -> int:
    """0, or :data:`EXIT_FLAGGED` when *fail_on* is set and a flag of *result* reaches it.

    *result* is a verb's :class:`~gradforensics.analysis.contract.model.Findings`, or a
    result that picks its own rows (:class:`Reaching`: ``compare`` counts the ``new``
    and ``worse`` rows after the fix).  With *verb*, exiting 1 says why in one line
    on stderr (:func:`fail_on_line`).
    """
    if fail_on is None:
        return 0
    hits = result.reaching(fail_on) if isinstance(result, Reaching) else reaching(result.flags, fail_on)
    if hits and verb is not None:
        import sys

        from gradforensics._text import terminal

        print(terminal(fail_on_line(hits, fail_on, verb, rows=isinstance(result, Reaching))), file=sys.stderr)
    return EXIT_FLAGGED if hits else 0


def fail_on_line(hits: Sequence[object], fail_on: float, verb: str, rows: bool = False) -> str:
    """``gradforensics analyze: 2 findings (3 flags) at or above --fail-on 0.5 (highest 0.91 conflict on w); exit 1``.

    *hits* are flags (grouped into findings as the report groups them), or with *rows*
    the rows of a comparison (each one finding, ``new`` or ``worse``).
    """
    def sev(h: object) -> float:
        value = getattr(h, "severity_after", None) if rows else getattr(h, "severity", None)
        return float(value or 0.0)

    top = max(hits, key=sev)
    if rows:
        what = f"{len(hits)} new or worse finding{'s' if len(hits) != 1 else ''}"
    else:
        from gradforensics.reporting.summary import group

        n_groups = len(group(hits))  # type: ignore[arg-type]
        what = (f"{n_groups} finding{'s' if n_groups != 1 else ''} "
                f"({len(hits)} flag{'s' if len(hits) != 1 else ''})")
    where = getattr(top, "tensor", "")
    return (f"gradforensics {verb}: {what} at or above --fail-on {fail_on:g} "
            f"(highest {sev(top):.2f} {getattr(top, 'kind', '?')}{' on ' + where if where else ''}); "
            f"exit {EXIT_FLAGGED}")


def counts_phrase(flags: Sequence[HasSeverity], act: float = 0.5) -> str:
    """``"6 findings, 2 at or above 0.5 (26 flags)"``: findings as the report groups them, flags counted too."""
    from gradforensics.reporting.summary import group

    groups = group(flags)  # type: ignore[arg-type]
    n_act = sum(reaches(g.severity, act) for g in groups)
    return (f"{len(groups)} finding{'s' if len(groups) != 1 else ''}, {n_act} at or above {act:g} "
            f"({len(flags)} flag{'s' if len(flags) != 1 else ''})")


