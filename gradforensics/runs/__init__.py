"""Comparing runs: ``gf.compare`` (before and after a fix) and ``gf.whatif`` (arms from one checkpoint).

``gf.compare(before, after, out)`` (:mod:`~gradforensics.runs.compare`) pairs two stores'
findings.  ``gf.whatif(checkpoint, data, arms, steps, out)`` (:mod:`~gradforensics.runs.whatif`) trains K steps from the
checkpoint once per arm on identical batches, records every step of every arm
(``mode="training"``), analyses each store and writes one report across the
arms (see ``docs/whatif.md``):

* :mod:`~gradforensics.runs.whatif` - the what-if itself (:func:`~gradforensics.runs.whatif.whatif`);
* :mod:`~gradforensics.runs.arms` - ``NAME=OPTIMIZER[:key=value,...]``,
  ``--mixture NAME=SOURCE:WEIGHT,...`` and the shared step schedule;
* :mod:`~gradforensics.runs.optim` - the optimizers (a tested :class:`Lion`;
  AdamW, SGD, Adafactor from torch) and the checkpoint's optimizer state;
* :mod:`~gradforensics.runs.train` - one arm's training loop;
* :mod:`~gradforensics.runs.cosines` - arm-to-arm gradient/update cosines per layer;
* :mod:`~gradforensics.runs.render` - the report.

The package is ``runs``: what compares runs - ``gf.compare`` (:mod:`~gradforensics.runs.compare`)
and ``gf.whatif`` (:mod:`~gradforensics.runs.whatif`) - lives here, and both pair findings by one
rule (:func:`gradforensics.analysis.contract.registry.flag_key`).  Call the functions as
``gf.compare`` / ``gf.whatif``.  torch is imported only when an arm runs.
"""

__all__: list[str] = []
