"""Least squares over a stack of small problems, through NumPy's public SVD.

The per-series fits of the signal toolkit (the log-time trend's five bases, the
Savitzky-Golay edges, a line per row) are many small least-squares problems at once.
NumPy's :func:`numpy.linalg.lstsq` takes one matrix; its :func:`numpy.linalg.svd`
takes a stack.  Both functions here give the minimum-norm solution that ``lstsq``
gives (singular values at or below ``rcond`` times the largest treated as zero,
``rcond=None``: ``eps * max(m, k)``, as ``lstsq``), to rounding:

* :func:`lstsq_each` - one design, many right-hand sides: one SVD (``A⁺`` once), then
  a matrix product;
* :func:`lstsq_stack` - a stack of designs, one right-hand side each: one stacked SVD.

A failed SVD raises :class:`numpy.linalg.LinAlgError`, as ``lstsq`` does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lstsq_each", "lstsq_stack"]


def _inverse_values(s: np.ndarray, m: int, k: int, rcond: float | None) -> np.ndarray:
    """``1 / s`` where a singular value is kept (above ``rcond × max s`` along the last axis), else 0."""
    cut = (np.finfo(np.float64).eps * max(m, k) if rcond is None else rcond) * s[..., :1]
    big = s > cut
    return np.divide(1.0, s, out=np.zeros_like(s), where=big)


def lstsq_each(A: np.ndarray, B: np.ndarray, rcond: float | None = None) -> np.ndarray:
    """``[np.linalg.lstsq(A, b, rcond)[0] for b in B]`` (``(U, k)``) for one ``(m, k)`` design *A* and rows *B* ``(U, m)``."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    m, k = A.shape
    if not (m and k):
        return np.zeros((B.shape[0], k))
    u, s, vt = np.linalg.svd(A, full_matrices=False)
    pinv = (vt.T * _inverse_values(s, m, k, rcond)) @ u.T          # A⁺ (k × m)
    return B @ pinv.T


def lstsq_stack(A: np.ndarray, B: np.ndarray, rcond: float | None = None) -> np.ndarray:
    """``[np.linalg.lstsq(a, b, rcond)[0] for a, b in zip(A, B)]`` (``(U, k)``) for designs *A* ``(U, m, k)`` and rows
    *B* ``(U, m)``."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    U, m, k = A.shape
    if not (U and m and k):
        return np.zeros((U, k))
    u, s, vt = np.linalg.svd(A, full_matrices=False)
    ub = np.matmul(B[:, None, :], u)[:, 0, :] * _inverse_values(s, m, k, rcond)      # Uᵀb / s per item
    return np.matmul(ub[:, None, :], vt)[:, 0, :]
