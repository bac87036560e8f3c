"""The pass: plan the graph, read the store once, run every selected analysis, persist.

* :mod:`~gradforensics.analysis.engine.run` - :func:`analyze`: select, read once, compute,
  flag, persist; :func:`analyze_series`: the analyses with a ``series`` hook on per-step
  series (``gradforensics loss``);
* :mod:`~gradforensics.analysis.engine.gram` - the Gram pass: ``K = X Xᵀ`` per tensor and
  head in one streaming read of the store, plus the analyses' slab reductions;
* :mod:`~gradforensics.analysis.engine.longhistory` - the same read above N₀ records:
  banded Gram and window-source sums instead of N×N;
* :mod:`~gradforensics.analysis.engine.results` - findings and Gram matrices saved in the
  store and read back, strictly parsed (raw layout: :mod:`gradforensics.store.results`).

The types it runs on are the contract's (:mod:`gradforensics.analysis.contract`,
re-exported here); the analyses live in :mod:`gradforensics.analysis.kinds` and the
maths they share in :mod:`gradforensics.analysis.toolkit`.
"""

from gradforensics.analysis.contract.model import (
    Advice,
    Analysis,
    AnalysisResult,
    Context,
    Findings,
    Flag,
    GramResult,
    Need,
    NoOptions,
    Options,
)
from gradforensics.analysis.contract.registry import REGISTRY, register, registered, unregister
from gradforensics.analysis.engine.run import EngineOptions, analyze, analyze_series, select_analyses

__all__ = ["REGISTRY", "Advice", "Analysis", "AnalysisResult", "Context", "EngineOptions", "Findings", "Flag",
           "GramResult", "Need", "NoOptions", "Options", "analyze", "analyze_series", "register", "registered",
           "select_analyses", "unregister"]
