"""The pass: plan the graph, read the store once, run every selected analysis, persist.

* :mod:`~gradforensics.analysis.engine.run` - :func:`~gradforensics.analysis.engine.run.analyze`:
  select, read once, compute, flag, persist;
  :func:`~gradforensics.analysis.engine.run.analyze_series`: the analyses with a ``series`` hook
  on per-step series (``gradforensics loss``);
* :mod:`~gradforensics.analysis.engine.options` - :class:`~gradforensics.analysis.engine.options.EngineOptions`
  and the selection of the analyses;
* :mod:`~gradforensics.analysis.engine.plan` - the plan of one pass (which collections compute
  what), :mod:`~gradforensics.analysis.engine.schedule` - its one ``dask.compute``;
* :mod:`~gradforensics.analysis.engine.gram` - the Gram pass: ``K = X Xᵀ`` per tensor and
  head in one streaming read of the store, plus the analyses' slab reductions
  (its chunk / combine / aggregate steps: :mod:`~gradforensics.analysis.engine.gramkernel`);
* :mod:`~gradforensics.analysis.engine.longhistory` - the same read above N₀ records:
  banded Gram and window-source sums instead of N×N;
* :mod:`~gradforensics.analysis.engine.results` - findings and Gram matrices saved in the
  store and read back, strictly parsed (raw layout: :mod:`gradforensics.store.results`).

The types it runs on are the contract's (:mod:`gradforensics.analysis.contract`); the
analyses live in :mod:`gradforensics.analysis.kinds` and the maths they share in
:mod:`gradforensics.analysis.toolkit`.
"""

__all__: list[str] = []
