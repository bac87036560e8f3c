"""Arms of a what-if (``gf.whatif``): replay the problem checkpoint under other optimizers, learning rates or data mixtures.

``gf.whatif(checkpoint, data, arms, steps, out)`` trains K steps from the
checkpoint once per arm on identical batches, records every step of every arm
(``mode="training"``), analyses each store and writes one report across the
arms (see ``docs/whatif.md``):

* :mod:`~gradforensics.arms.spec` - ``NAME=OPTIMIZER[:key=value,...]``,
  ``--mixture NAME=SOURCE:WEIGHT,...`` and the shared step schedule;
* :mod:`~gradforensics.arms.optim` - the optimizers (a tested :class:`Lion`;
  AdamW, SGD, Adafactor from torch) and the checkpoint's optimizer state;
* :mod:`~gradforensics.arms.train` - one arm's training loop;
* :mod:`~gradforensics.arms.cosines` - arm-to-arm gradient/update cosines per layer;
* :mod:`~gradforensics.arms.render` - the report.

The package is ``arms`` rather than ``whatif`` so that ``gf.whatif`` stays the
function: importing a subpackage ``gradforensics.whatif`` would bind that name on
``gradforensics`` to the package.  torch is imported only when an arm runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["whatif"]


def __getattr__(name: str) -> Any:
    if name == "whatif":
        from gradforensics.arms.run import whatif

        return whatif
    raise AttributeError(f"module 'gradforensics.arms' has no attribute {name!r}")
