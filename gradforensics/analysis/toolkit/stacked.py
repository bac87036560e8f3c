"""Small NumPy calls over a stack of equal-shaped items, each item's floats those of the single call.

The per-unit statistics at small N are mostly per-call overhead of small NumPy calls
(an ``lstsq`` of a few dozen rows, an FFT, a mean).  Stacked, one call covers a whole
stack; what makes it the same floats as the calls it replaces:

* :func:`row_means` - ``X.mean(axis=-1)`` of a C-contiguous stack: each row is reduced
  along its contiguous axis, with the pairwise sum the 1-d ``x.mean()`` uses;
* :func:`row_dots` - ``x @ x`` per row as ``np.matmul`` of ``(m, 1, n)`` by ``(m, n, 1)``:
  the same ``dot`` per item;
* :func:`lstsq_each` - ``np.linalg.lstsq(A, b, rcond=None)[0]`` for every item of a stack:
  the generalised ufunc ``np.linalg.lstsq`` itself calls (LAPACK ``gelsd``, one call an
  item, the same sizes and ``rcond``) given the stack; a *matrix* right-hand side would be
  one ``gelsd`` with several columns, whose floats differ from one column at a time;
* ``np.fft.rfft(X, axis=-1)`` transforms each row as the 1-d call does (used as it is);
* :func:`cosines_each`, :func:`record_cosines_each` - ``kspace.cosines`` and
  ``kspace.record_cosines`` of every Gram matrix of a stack: the products by ``np.matmul`` on
  the stack (the single call's ``gemm``/``gemv``/``dot`` per item), the ``einsum`` norms item by
  item (a stacked ``einsum`` need not reduce in the same order), the rest elementwise.

* :func:`block`, :func:`blocks_each` - ``kspace.block(K, rows, cols)`` (two one-axis takes) of one
  matrix or of every item of a stack: where the rows (columns) are evenly spaced, as a whole record
  set, an opening window or a round-robin source's records are, a strided slice's copy (the same
  floats: a copy is a copy), else the takes;
* :func:`eigh_top` - ``scipy.linalg.eigh(S, subset_by_index=(n - k, n - 1))``: the same LAPACK
  ``dsyevr`` call with the same arguments (its workspace sizes asked once per ``n``), without the
  wrapper's per-call checks and look-ups; anything the wrapper would complain about (a non-finite
  entry, a failed call) goes to the wrapper itself.

``tests/test_stacked_equalities.py`` holds each against the single calls, on random
inputs of many sizes and scales and on the planted stores, with ``==``.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["block", "blocks_each", "cosines_each", "eigh_top", "lstsq_each", "lstsq_gufunc", "lstsq_stack", "matvec_each",
           "record_cosines_each", "row_dots", "row_means", "syevr_top"]


def row_means(X: np.ndarray) -> np.ndarray:
    """``[x.mean() for x in X]`` of a 2-d stack (made C-contiguous), bit for bit."""
    return np.ascontiguousarray(X, dtype=np.float64).mean(axis=-1)


def row_dots(X: np.ndarray) -> np.ndarray:
    """``[x @ x for x in X]`` of a 2-d stack, bit for bit (one ``dot`` per row, as ``np.matmul`` runs it)."""
    X = np.ascontiguousarray(X, dtype=np.float64)
    return np.matmul(X[:, None, :], X[:, :, None])[:, 0, 0]


def lstsq_each(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """``[np.linalg.lstsq(A, b, rcond=None)[0] for b in B]`` for one ``(m, k)`` design *A* and rows *B* (``(U, m)``)."""
    A = np.asarray(A, dtype=np.float64)
    return lstsq_stack(np.broadcast_to(A, (np.shape(B)[0], *A.shape)), B)


def lstsq_stack(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """``[np.linalg.lstsq(a, b, rcond=None)[0] for a, b in zip(A, B)]`` for designs *A* ``(U, m, k)`` and rows *B* ``(U, m)``.

    One call of the generalised ufunc behind :func:`numpy.linalg.lstsq` over the stack
    (``gelsd`` once per item, as the single call runs it); where this NumPy does not
    expose it, the loop itself.  A failed SVD raises :class:`numpy.linalg.LinAlgError`, as the single call does.
    """
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    U, m, k = A.shape
    if _LSTSQ is None or not U or m == 0 or k == 0:
        return np.array([np.linalg.lstsq(a, b, rcond=None)[0] for a, b in zip(A, B)]).reshape(U, k)
    rcond = np.finfo(np.float64).eps * max(m, k)
    try:
        with np.errstate(invalid="raise", over="ignore", divide="ignore", under="ignore"):
            x = _LSTSQ(A, B[:, :, None], rcond, signature="ddd->ddid")[0]
    except FloatingPointError:          # as numpy.linalg.lstsq says it
        raise np.linalg.LinAlgError("SVD did not converge in Linear Least Squares") from None
    return np.ascontiguousarray(x[:, :, 0])


def matvec_each(A: np.ndarray, C: np.ndarray) -> np.ndarray:
    """``[A @ c for c in C]`` for one ``(m, k)`` matrix *A* and rows *C* (``(U, k)``), bit for bit (``np.matmul`` on
    the stack: the single call's product per item)."""
    A = np.asarray(A, dtype=np.float64)
    C = np.ascontiguousarray(C, dtype=np.float64)
    return np.matmul(np.broadcast_to(A, (C.shape[0], *A.shape)), C[:, :, None])[:, :, 0]


def _lstsq_gufunc():  # type: ignore[no-untyped-def]
    try:
        from numpy.linalg import _umath_linalg
    except ImportError:          # pragma: no cover - a NumPy without it: the loop
        return None
    return getattr(_umath_linalg, "lstsq", None)


_LSTSQ = _lstsq_gufunc()


def lstsq_gufunc():  # type: ignore[no-untyped-def]
    """The generalised ufunc behind ``np.linalg.lstsq`` (LAPACK ``gelsd`` once per item of a stack), or None
    where this NumPy does not expose it (callers then make the single calls)."""
    return _LSTSQ


def cosines_each(Ks: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """``[kspace.cosines(K, A, B) for K in Ks]`` (``(U, p, q)``) for a stack *Ks* (``(U, N, N)``) and coefficient
    rows *A* (``p × N``) and *B* (``q × N``; None: *A*), each item's floats the single call's."""
    from gradforensics.analysis.toolkit.kspace import safe_div

    A = np.atleast_2d(A)
    same = B is None or B is A
    B = A if B is None else np.atleast_2d(B)
    Ks = np.asarray(Ks, dtype=np.float64)
    AK = np.matmul(A, Ks)                                    # A @ K per item
    num = np.matmul(AK, B.T)                                 # (A K) Bᵀ per item
    na = np.sqrt(np.maximum(np.stack([np.einsum("ij,ij->i", ak, A) for ak in AK]), 0.0))
    if same:
        nb = na
    else:
        BK = np.matmul(B, Ks)
        nb = np.sqrt(np.maximum(np.stack([np.einsum("ij,ij->i", bk, B) for bk in BK]), 0.0))
    return safe_div(num, na[:, :, None] * nb[:, None, :])    # np.outer(na, nb) per item


def record_cosines_each(Ks: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``[kspace.record_cosines(K, a) for K in Ks]`` (``(U, N)``) for a stack *Ks* (``(U, N, N)``), each item's
    floats the single call's (``K a`` and ``a K`` by ``np.matmul`` on the stack, ``(a K) · a`` one ``dot`` an
    item)."""
    from gradforensics.analysis.toolkit.kspace import safe_div

    Ks = np.asarray(Ks, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    num = np.matmul(Ks, a)                                   # K @ a per item
    aK = np.matmul(a, Ks)                                    # a @ K per item
    aKa = np.matmul(aK[:, None, :], a[:, None])[:, 0, 0]     # (a @ K) @ a per item
    diag = np.diagonal(Ks, axis1=1, axis2=2)
    den = np.sqrt(np.maximum(diag, 0.0) * np.maximum(aKa, 0.0)[:, None])
    return safe_div(num, den)


def eigh_top(S: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``scipy.linalg.eigh(S, subset_by_index=(n - k, n - 1))`` of a real float64 square *S* (``1 <= k <= n``), bit
    for bit: its ``dsyevr`` (lower triangle, eigenvectors, ``range="I"``) called directly with the workspace
    sizes the wrapper asks for.  A matrix the wrapper would refuse (a non-finite entry: the sum is not finite,
    and a finite sum that overflowed too) and a call that fails go to the wrapper, which says it as before."""
    got = syevr_top(S, k)
    if got is not None:
        return got
    from scipy.linalg import eigh

    n = S.shape[0]
    return eigh(S, subset_by_index=(n - k, n - 1))


def syevr_top(S: np.ndarray, k: int, overwrite: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`eigh_top`'s direct ``dsyevr`` call, or None where it would go to the wrapper (a matrix the wrapper
    refuses, a call that fails).  *overwrite*: LAPACK may work in *S* itself (``eigh``'s ``overwrite_a``; a
    Fortran-ordered *S* then spares the copy), which is then spent, whatever the outcome."""
    n = S.shape[0]
    if not (S.dtype == np.float64 and S.ndim == 2 and S.shape[1] == n and 1 <= k <= n):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(np.add.reduce(S, axis=None)):
            return None
    drv, lwork, liwork = _syevr(n)
    w, v, m, _, info = drv(a=S, overwrite_a=bool(overwrite), range="I", il=n - k + 1, iu=n, lower=1, compute_v=1,
                           lwork=lwork, liwork=liwork)
    return (w[:m], v[:, :m]) if info == 0 else None


@functools.lru_cache(maxsize=16)
def _syevr(n: int):  # type: ignore[no-untyped-def]
    """The float64 ``syevr`` of SciPy's LAPACK and its workspace sizes for an ``n × n`` matrix, as ``eigh`` finds
    them (``get_lapack_funcs`` on a float64 array, ``_compute_lwork`` of ``syevr_lwork(n, lower=1)``)."""
    from scipy.linalg.lapack import _compute_lwork, get_lapack_funcs

    drv, drvlw = get_lapack_funcs(("syevr", "syevr_lwork"), [np.zeros((1, 1))])
    lwork, liwork = _compute_lwork(drvlw, n=n, lower=1)
    return drv, lwork, liwork


def _as_slice(rows: np.ndarray) -> slice | None:
    """*rows* (1-d integers) as the slice that lists them, when they are evenly spaced and increasing; else None."""
    n = rows.size
    if n == 0 or rows.ndim != 1 or rows.dtype.kind not in "iu":
        return None
    first = int(rows[0])
    if first < 0:
        return None
    if n == 1:
        return slice(first, first + 1)
    step = int(rows[1]) - first
    if step <= 0 or int(rows[-1]) != first + step * (n - 1):
        return None
    if not np.array_equal(rows, np.arange(first, first + step * n, step)):
        return None
    return slice(first, first + step * (n - 1) + 1, step)


def block(K: np.ndarray, rows: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """``kspace.block(K, rows, cols)`` (``K[np.ix_(rows, cols)]``, C-ordered float copy), bit for bit: a strided
    slice's copy where *rows* and *cols* are evenly spaced in range, else the two one-axis takes."""
    return blocks_each(np.asarray(K)[None], rows, cols)[0]


def blocks_each(Ks: np.ndarray, rows: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """``[kspace.block(K, rows, cols) for K in Ks]`` (``(U, r, c)``, C-ordered) for a stack *Ks*, bit for bit."""
    Ks = np.asarray(Ks)
    rows = np.asarray(rows)
    cols = rows if cols is None else np.asarray(cols)
    r, c = _as_slice(rows), _as_slice(cols)
    if r is not None and c is not None and r.stop <= Ks.shape[1] and c.stop <= Ks.shape[2]:
        return np.array(Ks[:, r, c], order="C")
    return np.take(np.take(Ks, rows, axis=1), cols, axis=2)
