"""The analysis engine: what every analysis builds on, and the one pass that runs them.

* :mod:`~gradforensics.analysis.engine.model` - the types: :class:`Analysis` (a
  registry entry: name, :class:`Need` values, :class:`Options` class, flag kinds with
  their :class:`Advice`, hooks), :class:`Context` (what an analysis reads),
  :class:`AnalysisResult`, :class:`Flag`, :class:`Findings`;
* :mod:`~gradforensics.analysis.engine.registry` - :data:`REGISTRY`, :func:`register`,
  :func:`unregister`, and the flag kinds and advice of the registered analyses;
* :mod:`~gradforensics.analysis.engine.gram` - the Gram pass: ``K = X Xᵀ`` per tensor and
  head in one streaming read of the store, plus the analyses' slab reductions;
* :mod:`~gradforensics.analysis.engine.kspace` - statistics of the records as functions of
  ``K`` (cosines, windows, per-source means, principal directions);
* :mod:`~gradforensics.analysis.engine.units` - the direction analyses' units (one per
  tensor and head) and their packed per-unit series;
* :mod:`~gradforensics.analysis.engine.flagging` - from statistics to flags: significance,
  severity ramps, trend tests, one story per tensor;
* :mod:`~gradforensics.analysis.engine.run` - :func:`analyze`: select, read once, compute,
  flag, persist; :func:`analyze_series`: the analyses with a ``series`` hook on per-step
  series (``gradforensics loss``);
* :mod:`~gradforensics.analysis.engine.results` - findings and Gram matrices saved in the
  store and read back, strictly parsed (raw layout: :mod:`gradforensics.store.results`).

The analyses themselves live in :mod:`gradforensics.analysis.kinds`, one module each.
"""

from gradforensics.analysis.engine.model import (
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
from gradforensics.analysis.engine.registry import REGISTRY, register, registered, unregister
from gradforensics.analysis.engine.run import EngineOptions, analyze, analyze_series, select_analyses

__all__ = ["REGISTRY", "Advice", "Analysis", "AnalysisResult", "Context", "EngineOptions", "Findings", "Flag",
           "GramResult", "Need", "NoOptions", "Options", "analyze", "analyze_series", "register", "registered",
           "select_analyses", "unregister"]
