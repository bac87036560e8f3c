"""The analysis contract: what an analysis is, what it reads, and the registry that lists them.

Everything an analysis module and the code downstream of it (report, compare,
what-if) agree on, and nothing else - no pass, no maths:

* :mod:`~gradforensics.analysis.contract.model` - :class:`Analysis` (a registry entry:
  name, needs, options class, flag kinds with their advice, hooks),
  :class:`Context` (what ``compute`` and ``flags`` read), :class:`Flag`,
  :class:`AnalysisResult`, :class:`Findings`;
* :mod:`~gradforensics.analysis.contract.options` - :class:`Options`, the base of an
  analysis's options (with constraints declared as data), and :class:`NoOptions`;
* :mod:`~gradforensics.analysis.contract.advice` - :class:`Advice` (what a kind of flag
  means and what to try next), the causes the verdict ranks, :data:`FlagKey`;
* :mod:`~gradforensics.analysis.contract.grams` - :class:`GramResult`, :class:`SlabReduction`
  and the long-history regime's :class:`LongHistory` (the Gram data an analysis reads);
* :mod:`~gradforensics.analysis.contract.series` - :class:`SeriesGroup` (per-step series);
* :mod:`~gradforensics.analysis.contract.checks` - the option constraints
  (:class:`Interval`, :class:`StrOptions`) and their one message shape;
* :mod:`~gradforensics.analysis.contract.registry` - :data:`REGISTRY`, :func:`register`,
  :func:`flag_key` and the advice of the registered kinds.

The contract imports nothing else of :mod:`gradforensics.analysis` (checked by
``tests/test_architecture.py``): the pass (:mod:`gradforensics.analysis.engine`) and
the toolkit (:mod:`gradforensics.analysis.toolkit`) build on it.
"""

__all__: list[str] = []
