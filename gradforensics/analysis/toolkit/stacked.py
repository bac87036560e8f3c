"""Least squares over a stack of small problems, through NumPy's public SVD.

The per-series fits of the signal toolkit (the log-time trend's five bases, the
Savitzky-Golay edges, a line per row) are many small least-squares problems at once.
NumPy's :func:`numpy.linalg.lstsq` takes one matrix; its :func:`numpy.linalg.svd`
takes a stack.  Both functions here give the minimum-norm solution that ``lstsq``
gives (singular values at or below ``rcond`` times the largest treated as zero,
``rcond=None``: ``eps * max(m, k)``, as ``lstsq``), to rounding:

* :func:`pinv_stack` - the pseudo-inverse ``A⁺`` of one design or of each of a stack
  (a design used again, as the log-time bases of one length, keeps its ``A⁺``);
* :func:`lstsq_each` - one design, many right-hand sides: ``A⁺`` once, then a matrix product.

A failed SVD raises :class:`numpy.linalg.LinAlgError`, as ``lstsq`` does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lstsq_each", "pinv_stack"]


def pinv_stack(A: np.ndarray, rcond: float | None = None) -> np.ndarray:
    """``A⁺`` (``(..., k, m)``) of a design ``(m, k)`` or a stack ``(..., m, k)``: ``x = A⁺ b`` is
    ``np.linalg.lstsq(A, b, rcond)[0]``."""
    A = np.asarray(A, dtype=np.float64)
    m, k = A.shape[-2:]
    if not (m and k):
        return np.zeros((*A.shape[:-2], k, m))
    u, s, vt = np.linalg.svd(A, full_matrices=False)
    cut = (np.finfo(np.float64).eps * max(m, k) if rcond is None else rcond) * s[..., :1]
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > cut)
    return np.matmul(np.swapaxes(vt, -1, -2) * inv[..., None, :], np.swapaxes(u, -1, -2))


def lstsq_each(A: np.ndarray, B: np.ndarray, rcond: float | None = None) -> np.ndarray:
    """``[np.linalg.lstsq(A, b, rcond)[0] for b in B]`` (``(U, k)``) for one ``(m, k)`` design *A* and rows *B* ``(U, m)``."""
    return np.asarray(B, dtype=np.float64) @ pinv_stack(A, rcond).T
