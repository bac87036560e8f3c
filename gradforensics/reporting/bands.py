"""The severity bands the report colours by: ``high`` (>= 0.75), ``medium`` (>= 0.5), ``low`` (>= 0.25), ``info``.

Its own module so that the summary (which groups flags by band) and the severity
rules (:mod:`gradforensics.reporting.severity`, which counts findings as the summary
groups them) both read it without importing each other.
"""

from __future__ import annotations

__all__ = ["SEVERITY_NAMES", "band"]

SEVERITY_NAMES: dict[str, float] = {"low": 0.25, "medium": 0.5, "high": 0.75}


def band(severity: float) -> str:
    """``"high"``, ``"medium"``, ``"low"`` or ``"info"`` (below 0.25)."""
    for name in ("high", "medium", "low"):
        if severity >= SEVERITY_NAMES[name]:
            return name
    return "info"
