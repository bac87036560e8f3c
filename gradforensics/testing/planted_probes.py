"""Planted ``curvature/`` and ``optim/`` groups on a healthy store (the contract suite's stores for issue 23).

The real runs that raise these findings train a model (``tests/test_curvature_capture.py``);
these factories plant the stored numbers directly, with the truth they plant, so the
contract checks run in milliseconds:

* :func:`planted_curvature_store`: whole-model ``lambda_max`` at ``ratio`` x GD's threshold
  ``2/lr``, the top eigenvector's mass in ``layers.1.mlp.up.weight``;
* :func:`planted_optimizer_store`: ``layers.0.attn.q.weight``'s median ``g²/v̂`` at 300
  (a stale preconditioner), the others near 0.5.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from gradforensics.store.probes import CurvatureData, OptimData, write_probes
from gradforensics.testing.planted import TENSORS, PlantedStore, healthy_store

__all__ = ["STALE_TENSOR", "TOP_BLOCK", "planted_curvature_store", "planted_optimizer_store"]

TOP_BLOCK = "layers.1.mlp.up.weight"
STALE_TENSOR = "layers.0.attn.q.weight"
_FIELDS = ["update_rms", "weight_rms", "update_ratio", "eps_share", "m_norm", "sqrt_v_norm", "step",
           "ratio_q50", "ratio_q90", "ratio_q99", "ratio_max", "numel"]


def planted_curvature_store(path: str | os.PathLike[str], seed: int = 0, *, ratio: float = 1.6,
                            lr: float = 0.1) -> PlantedStore:
    """A healthy store with a curvature group whose whole-model stability ratio is *ratio* (GD at *lr*)."""
    store = healthy_store(path, seed, n_records=12)
    rng = np.random.default_rng(seed)
    names = list(TENSORS)
    lam = ratio * 2.0 / lr
    mass = {n: (0.7 if n == TOP_BLOCK else 0.1) for n in names}
    rows: list[dict[str, Any]] = [{"block": "model", "tensors": names, "source": "", "operator": "hessian",
                                   "mass": mass}]
    eig = [[lam, 0.9 * lam]]
    for n in names:
        rows.append({"block": n, "tensors": [n], "source": "", "operator": "hessian"})
        eig.append([lam * (0.8 if n == TOP_BLOCK else rng.uniform(0.1, 0.3)), 0.05 * lam])
    r = len(rows)
    data = CurvatureData(rows, np.array(eig), np.full((r, 2), 1e-4 * lam), np.full(r, 12, dtype=np.int64),
                         np.ones(r, dtype=np.uint8), {"hyper": {"optimizer": "sgd", "lr": lr, "momentum": 0.0},
                                                      "lrs": {row["block"]: lr for row in rows}, "blocks": "tensor"})
    write_probes(path, data, None)
    return PlantedStore(store.path, {"ratio": ratio, "top_block": TOP_BLOCK})


def planted_optimizer_store(path: str | os.PathLike[str], seed: int = 0, *, stale: float = 300.0) -> PlantedStore:
    """A healthy store with an Adam state summary in which :data:`STALE_TENSOR` has median g²/v̂ = *stale*."""
    store = healthy_store(path, seed, n_records=12)
    rng = np.random.default_rng(seed)
    rows = []
    for n in TENSORS:
        q50 = stale if n == STALE_TENSOR else rng.uniform(0.3, 0.6)
        upd, w = 1e-3 * rng.uniform(0.8, 1.2), 0.05 * rng.uniform(0.8, 1.2)
        rows.append([upd, w, upd / w, 0.02, 1.0, 2.0, 1000.0, q50, 4 * q50, 10 * q50, 30 * q50, 512.0])
    edges = list(np.linspace(-12.0, 12.0, 9))
    data = OptimData(list(TENSORS), list(_FIELDS), np.array(rows), np.ones((len(TENSORS), 8), dtype=np.int64),
                     {"edges": edges, "hyper": {"optimizer": "adam", "lr": 1e-3}, "mapping": "parameters",
                      "ndim": {n: 2 for n in TENSORS}})
    write_probes(path, None, data)
    return PlantedStore(store.path, {"stale": STALE_TENSOR})
