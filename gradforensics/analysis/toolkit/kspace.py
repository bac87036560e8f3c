"""K-space algebra the direction analyses share: per-record gradients through their Gram matrix.

Every vector the direction analyses need lies in the span of the records
``g_1 .. g_N`` (rows of ``X``), so it is ``v = Xᵀa`` for a *coefficient vector*
``a`` of length N, and every inner product is a quadratic form in the Gram
matrix ``K = X Xᵀ``::

    <Xᵀa, Xᵀb> = aᵀ K b

The least-squares per-source mean gradients of mixed batches are the rows of
``C = (AᵀA)⁻¹Aᵀ`` (``A`` = ``batches/mixture``, N×S), so ``M Mᵀ = C K Cᵀ``.  Nothing
here reads a gradient: the analyses get ``K`` once from the engine's Gram pass.

What one analysis alone uses lives beside it (drift's window cosines in
:mod:`gradforensics.analysis.kinds.drift.stats`, oscillation's principal directions in
:mod:`gradforensics.analysis.kinds.oscillation.stats`); the units K comes in (one per tensor
and head) are :mod:`gradforensics.analysis.toolkit.units`, and turning the statistics into
flags is :mod:`gradforensics.analysis.toolkit.flagging`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from gradforensics.errors import SpecError

__all__ = ["SourceFit", "block", "fit_sources", "gram_to_cos", "noise_energy", "safe_div", "shared_fit", "source_gram",
           "source_grams", "window_edges", "window_size"]


def block(K: np.ndarray, rows: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """``K[..., rows, cols]`` as a C-ordered copy (``K[np.ix_(rows, cols)]`` of each matrix of a stack ``(..., N, N)``;
    *cols* None: *rows*): a strided slice's copy where the rows and columns are evenly spaced (a whole record set,
    an opening window, a round-robin source's records), else two one-axis takes."""
    K = np.asarray(K)
    rows = np.asarray(rows)
    cols = rows if cols is None else np.asarray(cols)
    r, c = _as_slice(rows), _as_slice(cols)
    if r is not None and c is not None and r.stop <= K.shape[-2] and c.stop <= K.shape[-1]:
        return np.array(K[..., r, c], order="C")
    return np.take(np.take(K, rows, axis=-2), cols, axis=-1)


def _as_slice(rows: np.ndarray) -> slice | None:
    """*rows* (1-d integers) as the slice that lists them, when they are evenly spaced and increasing; else None."""
    n = rows.size
    if n == 0 or rows.ndim != 1 or rows.dtype.kind not in "iu" or int(rows[0]) < 0:
        return None
    first = int(rows[0])
    step = int(rows[1]) - first if n > 1 else 1
    if step <= 0 or not np.array_equal(rows, np.arange(first, first + step * n, step)):
        return None
    return slice(first, first + step * (n - 1) + 1, step)


def safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` clipped to [-1, 1] where ``den > 1e-300``, NaN elsewhere (*den* broadcast to *num*'s shape)."""
    num = np.asarray(num, dtype=np.float64)
    den = np.broadcast_to(np.asarray(den, dtype=np.float64), num.shape)
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 1e-300)
    return np.clip(out, -1.0, 1.0, out=out)


def window_size(n: int, requested: int | None = None) -> int:
    """Records per window: *requested*, or ``max(4, ceil(n / 16))``."""
    return int(requested) if requested else max(4, math.ceil(n / 16))


def window_edges(n: int, windows: int = 8) -> np.ndarray:
    """Record boundaries of ``min(windows, n)`` contiguous, near-equal windows (``[0, ..., n]``)."""
    return np.linspace(0, n, min(windows, n) + 1).round().astype(int) if n else np.zeros(1, int)


# ------------------------------------------------------- sources (mixtures)
@dataclass(frozen=True)
class SourceFit:
    """Least-squares per-source mean gradients, as coefficients over the records.

    ``M = C X`` with ``C = (AᵀA)⁺Aᵀ`` solves ``min_M |X - A M|²`` (``A``: mixture
    rows of the unit's records; a one-hot row for a pure batch, for which the
    row of ``C`` is just ``1_s / n_s``).  ``index`` are the store's source
    indices of the rows of ``C`` (sources absent from these records are dropped).
    """

    A: np.ndarray         # N×S' mixture of the kept sources
    C: np.ndarray         # S'×N
    index: np.ndarray     # S' source indices into ctx.sources
    weight: np.ndarray    # S' total share of each kept source (effective records)
    rank_ok: bool

    @property
    def hat(self) -> np.ndarray:
        """``A C`` (N×N), the records' projection on the source means (not kept: a shared fit stays small)."""
        return self.A @ self.C


def fit_sources(mixture: np.ndarray) -> SourceFit:
    """Least-squares coefficients of the per-source means for these mixture rows."""
    A = np.asarray(mixture, dtype=np.float64)
    if A.ndim != 2:
        raise SpecError(f"batches/mixture must be (N, S); got shape {A.shape}.")
    present = np.flatnonzero(A.sum(axis=0) > 0)
    A = A[:, present]
    G = A.T @ A
    rank_ok = bool(present.size and np.linalg.matrix_rank(G) == present.size)
    C = np.linalg.pinv(G) @ A.T
    return SourceFit(A=A, C=C, index=present, weight=A.sum(axis=0), rank_ok=rank_ok)


def shared_fit(mixture: np.ndarray) -> SourceFit:
    """:func:`fit_sources` of these rows, computed once for every unit that has the same rows.

    A store's units (a tensor's heads, and usually every tensor) share their records, so
    the per-unit statistics fit the same mixture hundreds of times; this returns the one
    fit (the same numbers: the same function on the same float64 rows), its arrays
    read-only.  A few distinct row sets are kept (least recently used dropped).
    """
    A = np.ascontiguousarray(mixture, dtype=np.float64)
    if A.ndim != 2:
        raise SpecError(f"batches/mixture must be (N, S); got shape {A.shape}.")
    return _shared_fit(A.shape, A.tobytes())


@functools.lru_cache(maxsize=8)
def _shared_fit(shape: tuple[int, int], raw: bytes) -> SourceFit:
    fit = fit_sources(np.frombuffer(raw, dtype=np.float64).reshape(shape))
    for arr in (fit.A, fit.C, fit.index, fit.weight):
        arr.flags.writeable = False
    return fit



def noise_energy(K: np.ndarray, fit: SourceFit) -> np.ndarray:
    """Per-record noise energy ``|g_i - (A M)_i|² / (1 - h_ii)`` (HC2; MacKinnon & White 1985).

    Unbiased for ``tr Σ_i`` under homoscedastic noise; used to remove the noise
    floor from ``C K Cᵀ``.
    """
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    resid = np.diag(K) - 2.0 * np.einsum("is,si->i", A, CK) + np.einsum("is,st,it->i", A, G, A)
    h = np.einsum("is,si->i", A, C)
    return np.where(h < 1.0 - 1e-9, resid / np.maximum(1.0 - h, 1e-9), np.nan)


def source_gram(K: np.ndarray, fit: SourceFit, debias: bool = False) -> np.ndarray:
    """``M Mᵀ = C K Cᵀ`` (S'×S'); with *debias*, minus the noise floor ``C diag(r) Cᵀ``."""
    G = fit.C @ K @ fit.C.T
    if debias:
        r = noise_energy(K, fit)
        r = np.where(np.isfinite(r), r, 0.0)
        G = G - (fit.C * r) @ fit.C.T
    return G


def source_grams(K: np.ndarray, fit: SourceFit) -> tuple[np.ndarray, np.ndarray]:
    """``(source_gram(K, fit), source_gram(K, fit, debias=True))`` with ``C K`` and ``C K Cᵀ`` formed once."""
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    resid = np.diag(K) - 2.0 * np.einsum("is,si->i", A, CK) + np.einsum("is,st,it->i", A, G, A)
    h = np.einsum("is,si->i", A, C)
    r = np.where(h < 1.0 - 1e-9, resid / np.maximum(1.0 - h, 1e-9), np.nan)
    r = np.where(np.isfinite(r), r, 0.0)
    return G, G - (C * r) @ C.T


def gram_to_cos(G: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.where(np.diag(G) > 0, np.diag(G), np.nan))
    with np.errstate(invalid="ignore"):
        return np.clip(G / np.outer(d, d), -1.0, 1.0)
