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

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings

__all__ = [
    "EXIT_FLAGGED",
    "SEVERITY_NAMES",
    "TOLERANCE",
    "F",
    "HasSeverity",
    "Reaching",
    "add_fail_on_argument",
    "band",
    "exit_code",
    "parse_severity",
    "reaches",
    "reaching",
]


SEVERITY_NAMES: dict[str, float] = {"low": 0.25, "medium": 0.5, "high": 0.75}

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


def exit_code(result: Findings | Reaching, fail_on: float | None) -> int:
    """0, or :data:`EXIT_FLAGGED` when *fail_on* is set and a flag of *result* reaches it.

    *result* is a verb's :class:`~gradforensics.analysis.contract.model.Findings`, or a
    result that picks its own rows (:class:`Reaching`: ``compare`` counts the ``new``
    and ``worse`` rows after the fix).
    """
    if fail_on is None:
        return 0
    hits = result.reaching(fail_on) if isinstance(result, Reaching) else reaching(result.flags, fail_on)
    return EXIT_FLAGGED if hits else 0


def band(severity: float) -> str:
    """``"high"``, ``"medium"``, ``"low"`` or ``"info"`` (below 0.25)."""
    for name in ("high", "medium", "low"):
        if severity >= SEVERITY_NAMES[name]:
            return name
    return "info"
