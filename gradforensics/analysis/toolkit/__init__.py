"""The analyses' toolkit: maths the kinds share, over Gram matrices, units and series.

Pure functions over the contract's types (:mod:`gradforensics.analysis.contract`),
never the pass: a kind imports what it needs from here, never from another kind.

* :mod:`~gradforensics.analysis.toolkit.kspace` - the K-space algebra the direction analyses
  share (blocks, windows, per-source means and their Gram matrices);
* :mod:`~gradforensics.analysis.toolkit.units` - the direction analyses' units (one per
  tensor and head) and their packed per-unit series;
* :mod:`~gradforensics.analysis.toolkit.flagging` - from statistics to flags: significance,
  severity ramps, trend tests, one story per tensor;
* :mod:`~gradforensics.analysis.toolkit.stats` - shared tests (trends, bimodality);
* :mod:`~gradforensics.analysis.toolkit.stacked` - least squares over a stack of small problems;
* :mod:`~gradforensics.analysis.toolkit.series` - per-step series from a store's ``batches/*``;
* :mod:`~gradforensics.analysis.toolkit.batches` - how the run drew its data (full batch);
* :mod:`~gradforensics.analysis.toolkit.signal` - 1-D signal maths of the loss-curve analyses.

Training logs are read by :mod:`gradforensics.logs` (input reading, not analysis).
"""

__all__: list[str] = []
