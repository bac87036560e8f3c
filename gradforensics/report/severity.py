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
command exits 1 when any flag's severity is at or above it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from gradforensics.analysis.engine.model import Findings, Flag

SEVERITY_NAMES: dict[str, float] = {"low": 0.25, "medium": 0.5, "high": 0.75}

#: Exit code of ``analyze`` / ``report`` when a flag reaches ``--fail-on``.
EXIT_FLAGGED = 1


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


def reaching(flags: Iterable[Flag], threshold: float) -> list[Flag]:
    """The flags whose severity is at or above *threshold*."""
    return [f for f in flags if f.severity >= threshold - 1e-12]


def exit_code(findings: Findings, fail_on: float | None) -> int:
    """0, or :data:`EXIT_FLAGGED` when *fail_on* is set and a flag reaches it."""
    if fail_on is None:
        return 0
    return EXIT_FLAGGED if reaching(findings.flags, fail_on) else 0


def band(severity: float) -> str:
    """``"high"``, ``"medium"``, ``"low"`` or ``"info"`` (below 0.25)."""
    for name in ("high", "medium", "low"):
        if severity >= SEVERITY_NAMES[name]:
            return name
    return "info"
