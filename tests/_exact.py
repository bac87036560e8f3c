"""Shared by the tests that hold a faster path to the numbers of the code it replaced, bit for bit."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["reference_null", "same"]


def same(a: object, b: object) -> bool:
    """``a == b``, NaN equal to NaN (floats compared exactly)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def reference_null(K: np.ndarray, A: np.ndarray, Q: np.ndarray, perms: np.ndarray, chunk: int = 128) -> np.ndarray:
    """Conflict's permutation null as the first version computed it: fancy-indexed gathers, ``Q @ G @ Q`` a chunk."""
    n, S = A.shape
    out = np.empty((perms.shape[0], S, S))
    for s in range(0, perms.shape[0], chunk):
        Pm = A[perms[s:s + chunk]]
        c = Pm.shape[0]
        KP = (K @ Pm.transpose(1, 0, 2).reshape(n, c * S)).reshape(n, c, S).transpose(1, 0, 2)
        out[s:s + c] = Q @ np.matmul(Pm.transpose(0, 2, 1), KP) @ Q
    return out
