"""Test helpers shipped with gradforensics: planted-truth stores and analysis contracts.

* :mod:`gradforensics.testing.planted` - ``write_store`` and the factories
  (``healthy_store``, ``noise_store``, ``nonfinite_store``, ...) that build stores
  with known truth.
* :mod:`gradforensics.testing.contracts` - ``AnalysisContract``, the pytest suite
  every analysis's tests opt into (imports pytest; import it from tests only).
"""

from __future__ import annotations

from gradforensics.testing.planted import (
    PlantedStore,
    healthy_store,
    noise_store,
    nonfinite_store,
    write_store,
)

__all__ = ["PlantedStore", "healthy_store", "noise_store", "nonfinite_store", "write_store"]
