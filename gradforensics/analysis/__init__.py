"""The forensic analyses.  One module per analysis, one line per analysis here.

To add an analysis: write ``gradforensics/analysis/<name>.py`` exposing
``ANALYSIS = Analysis(name=..., needs=..., compute=..., flags=..., plot=...)``
(see :mod:`gradforensics.analysis.engine.model`) and add its module to ``_MODULES``.
"""

from __future__ import annotations

import importlib

from gradforensics.analysis.engine.model import Analysis, AnalysisResult, Context, Findings, Flag, GramResult

# Order = order of sections in the report.
_MODULES: tuple[str, ...] = (
    "drift",
    "oscillation",
    "conflict",
    "noise",
    "nonfinite",
    "saturation",
    "spectral",
    "precision",
    "loss_spectrum",
    "fractal",
    "coherence",
)


def _load() -> dict[str, Analysis]:
    out: dict[str, Analysis] = {}
    for mod in _MODULES:
        a = importlib.import_module(f"gradforensics.analysis.kinds.{mod}").ANALYSIS
        out[a.name] = a
    return out


REGISTRY: dict[str, Analysis] = _load()

__all__ = ["REGISTRY", "Analysis", "AnalysisResult", "Context", "Findings", "Flag", "GramResult"]
