"""The forensic analyses.  One module per analysis, one line per analysis here.

A built-in analysis is one module in :mod:`gradforensics.analysis.kinds` ending in
``ANALYSIS = Analysis(...)`` (name, needs, compute, flags, plot, the flag kinds it
emits with their advice, its options class: see
:class:`~gradforensics.analysis.contract.model.Analysis`) and its line below.  An
analysis defined elsewhere (a plugin, a test) is added with :func:`register`
(:func:`unregister`, or ``with registered(analysis): ...``); the engine, the
``flags.json`` schema and the report read everything from :data:`REGISTRY`.
The package is in three parts: the contract (:mod:`gradforensics.analysis.contract`:
types and registry), the pass (:mod:`gradforensics.analysis.engine`) and the
toolkit the kinds share (:mod:`gradforensics.analysis.toolkit`); an analysis
never imports another.
"""

from __future__ import annotations

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Findings, Flag
from gradforensics.analysis.contract.registry import REGISTRY, register, registered, unregister
from gradforensics.analysis.kinds import (
    attention,
    coherence,
    conflict,
    curvature,
    drift,
    experts,
    fractal,
    logits,
    loss_spectrum,
    noise,
    nonfinite,
    optimizer,
    oscillation,
    precision,
    rankconsistency,
    saturation,
    spectral,
    timeline,
)

# One line per built-in analysis; the order is the order of the report's sections.
register(drift.ANALYSIS)
register(oscillation.ANALYSIS)
register(conflict.ANALYSIS)
register(noise.ANALYSIS)
register(nonfinite.ANALYSIS)
register(saturation.ANALYSIS)
register(spectral.ANALYSIS)
register(precision.ANALYSIS)
register(loss_spectrum.ANALYSIS)
register(fractal.ANALYSIS)
register(coherence.ANALYSIS)
register(rankconsistency.ANALYSIS)
register(curvature.ANALYSIS)
register(optimizer.ANALYSIS)
register(attention.ANALYSIS)
register(logits.ANALYSIS)
register(experts.ANALYSIS)
register(timeline.ANALYSIS)

__all__ = ["REGISTRY", "Advice", "Analysis", "AnalysisResult", "Context", "Findings", "Flag", "GramResult",
           "register", "registered", "unregister"]
