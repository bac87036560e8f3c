"""Test helpers shipped with gradforensics: planted-truth stores and analysis contracts.

* :mod:`gradforensics.testing.planted` - ``write_store`` and the factories
  (``healthy_store``, ``noise_store``, ``nonfinite_store``, ...) that build stores
  with known truth.
* :mod:`gradforensics.testing.contracts` - ``AnalysisContract``, the pytest suite
  every analysis's tests opt into, and the checks run over the whole registry
  (``parametrize_with_checks``; imports pytest; import it from tests only).
* :mod:`gradforensics.testing.counting` - ``CountingScheduler``, a dask scheduler
  that counts the computes a pass makes (``dask.config.set(scheduler=counter)``).
"""

from __future__ import annotations

from gradforensics.testing.counting import CountingScheduler
from gradforensics.testing.planted import (
    PlantedStore,
    healthy_store,
    noise_store,
    nonfinite_store,
    write_store,
)

__all__ = ["CountingScheduler", "PlantedStore", "healthy_store", "noise_store", "nonfinite_store", "write_store"]
