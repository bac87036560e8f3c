"""What a what-if returns: :class:`WhatIf` (its runs, findings, comparisons and cosines).

Its own module so that the renderer (:mod:`gradforensics.runs.render`) and the
what-if itself (:mod:`gradforensics.runs.whatif`) both read it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.contract.model import Findings
    from gradforensics.reporting.comparison import Comparison
    from gradforensics.runs.train import ArmRun

__all__ = ["WhatIf"]


@dataclass
class WhatIf:
    """What :func:`whatif` did: one run per arm, their findings, the comparisons with the baseline, the cosines."""

    out_dir: Path
    baseline: str
    runs: list[ArmRun]
    findings: dict[str, Findings]
    comparisons: dict[str, Comparison]
    cosines: pd.DataFrame
    paths: dict[str, Path] = field(default_factory=dict)

    def run(self, arm: str) -> ArmRun:
        return next(r for r in self.runs if r.arm.name == arm)

    def severity(self, arm: str, kind: str, tensor: str | None = None, sources: Sequence[str] | None = None) -> float:
        """The highest severity of *arm*'s flags of *kind* (on *tensor*, implicating all of *sources*); 0 if none."""
        flags = [f for f in self.findings[arm].flags if f.kind == kind and (tensor is None or f.tensor == tensor)
                 and set(sources or ()) <= set(f.sources)]
        return max((float(f.severity) for f in flags), default=0.0)

