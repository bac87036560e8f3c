"""What a store's ``batches/*`` say about how the run drew its data.

:func:`full_batch`: the run is full-batch training (every record the whole data set),
known from the store's ``extra["dataset_size"]`` (every record's ``n_samples`` equal
to it) or ``extra["full_batch"] = True``.  Full-batch gradient descent has no sampling
noise and no data order: the record-to-record change of the gradient is the
trajectory (curvature, learning rate), never the batches.

:func:`loss_change` / :func:`learning`: the recorded loss fell over the run (the last
third of the records against the opening window): a gradient that turns, or a tensor
whose gradient is noisy, while the model learns is ordinary training, context rather
than trouble.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["LEARNING_DROP", "full_batch", "learning", "loss_change"]

#: Relative fall of the recorded loss over a training run that makes it "learning" (:func:`learning`).
LEARNING_DROP = 0.05


def full_batch(meta: Any, batches: Any) -> int | None:
    """The data set's size when every record is a full batch of it; ``None`` otherwise (or not known)."""
    extra = getattr(meta, "extra", None) or {}
    n = np.asarray(batches.get("n_samples", np.zeros(0)) if hasattr(batches, "get") else np.zeros(0))
    if extra.get("full_batch") is True:
        return int(n[0]) if n.size and np.all(n == n[0]) and n[0] > 0 else 0
    size = extra.get("dataset_size")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or not n.size:
        return None
    return size if bool(np.all(n == size)) else None


def loss_change(loss: Any, step: np.ndarray, window: int | None = None) -> float:
    """Relative change of the recorded loss: mean of the last third of the records (step order) over the
    opening window's mean, minus 1; NaN when fewer than 8 records carry a finite loss."""
    if loss is None:
        return math.nan
    y = np.asarray(loss, dtype=np.float64)[np.argsort(step, kind="stable")]
    y = y[np.isfinite(y)]
    if y.size < 8:
        return math.nan
    w = window or max(4, math.ceil(y.size / 16))
    first, last = float(np.mean(y[:w])), float(np.mean(y[-max(y.size // 3, 1):]))
    return last / first - 1.0 if first > 0 else math.nan


def learning(meta: Any, batches: Any) -> bool:
    """A training store whose recorded loss fell by at least :data:`LEARNING_DROP` over the run."""
    if getattr(meta, "mode", "training") != "training" or not hasattr(batches, "get"):
        return False
    step = np.asarray(batches.get("step", np.arange(len(np.asarray(batches.get("loss", []))))))
    change = loss_change(batches.get("loss"), step)
    return bool(np.isfinite(change) and change <= -LEARNING_DROP)
