"""The analysis engine: what every analysis builds on, and the one pass that runs them.

* :mod:`~gradforensics.analysis.engine.model` - the types: :class:`Analysis` (a
  registry entry), :class:`Context` (what an analysis reads), :class:`AnalysisResult`,
  :class:`Flag`, :class:`Findings`, :class:`Options` (per-analysis options);
* :mod:`~gradforensics.analysis.engine.gram` - the Gram pass: ``K = X Xᵀ`` per tensor and
  head in one streaming read of the store, plus the analyses' slab reductions;
* :mod:`~gradforensics.analysis.engine.kspace` - statistics of the records as functions of
  ``K`` (cosines, windows, per-source means, principal directions);
* :mod:`~gradforensics.analysis.engine.run` - :func:`analyze`: select, read once, compute,
  flag, persist;
* :mod:`~gradforensics.analysis.engine.stored` - strict parsing of results read back from
  a store.

The analyses themselves live in :mod:`gradforensics.analysis.kinds`, one module each.
"""

from gradforensics.analysis.engine.model import (
    Analysis,
    AnalysisResult,
    Context,
    Findings,
    Flag,
    GramResult,
    Options,
)
from gradforensics.analysis.engine.run import EngineOptions, analyze, select_analyses

__all__ = ["Analysis", "AnalysisResult", "Context", "EngineOptions", "Findings", "Flag", "GramResult", "Options",
           "analyze", "select_analyses"]
