"""Arm-to-arm cosines per layer: is the trouble in the data (every arm sees it) or in the optimizer?

For two arms ``a``, ``b`` and each recorded tensor, from the per-step vectors
:func:`~gradforensics.runs.train.run_arm` keeps (exact for a tensor of at most
``k`` elements, else count-sketches with one seed, error ≈ √((1+cos²)/k)):

* ``grad_cos``: mean of ``cos(g_a, g_b)`` over the batches both arms took - the
  same batch ``(source, j)``, at each arm's own weights.  Near 1: the arms'
  weights still see the data alike, the gradient is the data's; it starts at
  exactly 1 at the first shared batch when both arms start there.
* ``update_cos``: mean over steps ``t`` of ``cos(Δθ_a(t), Δθ_b(t))``: do the
  optimizers move the layer the same way, step by step?
* ``net_update_cos``: ``cos(Σ_t Δθ_a, Σ_t Δθ_b)``: the same for the whole
  displacement over the K steps.

High ``grad_cos`` with low ``update_cos`` says the arms differ in what the
optimizer does with the same gradient; a low ``grad_cos`` says the arms'
weights have gone apart enough that the data pulls them differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.runs.train import ArmRun

__all__ = ["COLUMNS", "cosine", "pair_table"]

COLUMNS = ("arm_a", "arm_b", "tensor", "grad_cos", "first_grad_cos", "update_cos", "net_update_cos",
           "n_batches", "n_steps")


def cosine(x: np.ndarray, y: np.ndarray) -> float:
    """``<x, y> / (|x| |y|)`` in float64; NaN when either is zero or not finite."""
    x64, y64 = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    nx, ny = float(np.linalg.norm(x64)), float(np.linalg.norm(y64))
    if not (np.isfinite(nx) and np.isfinite(ny)) or nx == 0 or ny == 0:
        return float("nan")
    return float(np.clip(x64 @ y64 / (nx * ny), -1.0, 1.0))


def _mean(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else float("nan")


def _pair_rows(a: ArmRun, b: ArmRun) -> list[list[object]]:
    where_b = {key: t for t, key in enumerate(b.schedule[:b.steps_done])}
    shared = [(t, where_b[key]) for t, key in enumerate(a.schedule[:a.steps_done]) if key in where_b]
    n = min(a.steps_done, b.steps_done)
    rows: list[list[object]] = []
    for tensor in a.grads:
        if tensor not in b.grads:
            continue
        ga, gb, ua, ub = a.grads[tensor], b.grads[tensor], a.updates[tensor], b.updates[tensor]
        gcos = [cosine(ga[ta], gb[tb]) for ta, tb in shared]
        ucos = [cosine(ua[t], ub[t]) for t in range(n)]
        net = cosine(np.sum(ua[:n], axis=0), np.sum(ub[:n], axis=0)) if n else float("nan")
        rows.append([a.arm.name, b.arm.name, tensor, _mean(gcos), gcos[0] if gcos else float("nan"), _mean(ucos),
                     net, len(shared), n])
    return rows


def pair_table(runs: Sequence[ArmRun]) -> pd.DataFrame:
    """A row per (arm pair, tensor) with :data:`COLUMNS`, pairs in the order the arms were given."""
    import pandas as pd

    rows = [r for a, b in combinations(runs, 2) for r in _pair_rows(a, b)]
    return pd.DataFrame(rows, columns=list(COLUMNS))
