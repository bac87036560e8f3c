"""What a store's ``batches/*`` say about how the run drew its data.

:func:`full_batch`: the run is full-batch training (every record the whole data set),
known from the store's ``extra["dataset_size"]`` (every record's ``n_samples`` equal
to it) or ``extra["full_batch"] = True``.  Full-batch gradient descent has no sampling
noise and no data order: the record-to-record change of the gradient is the
trajectory (curvature, learning rate), never the batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["full_batch"]


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
