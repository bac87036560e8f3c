"""K-space algebra: direction statistics of per-record gradients through their Gram matrix.

Every vector the direction analyses need lies in the span of the records
``g_1 .. g_N`` (rows of ``X``), so it is ``v = Xᵀa`` for a *coefficient vector*
``a`` of length N, and every inner product is a quadratic form in the Gram
matrix ``K = X Xᵀ``::

    <Xᵀa, Xᵀb> = aᵀ K b

A window mean is ``a = 1_W / |W|``; the least-squares per-source mean gradients
of mixed batches are the rows of ``C = (AᵀA)⁻¹Aᵀ`` (``A`` = ``batches/mixture``,
N×S), so ``M Mᵀ = C K Cᵀ``; the principal directions of the records are the
eigenvectors of the centred ``H K H`` (``H = I - 11ᵀ/N``; Schölkopf et al. 1998,
kernel PCA with a linear kernel), whose scores are ``u_k √λ_k``.  Nothing here
reads a gradient: the analyses get ``K`` once from the engine's Gram pass.

Pure maths over K and coefficient vectors; the units K comes in (one per tensor
and head) are :mod:`gradforensics.analysis.toolkit.units`, and turning the
statistics into flags is :mod:`gradforensics.analysis.toolkit.flagging`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from gradforensics.errors import SpecError

__all__ = ["LANCZOS_MIN", "SourceFit", "block", "centred", "consecutive_cosines", "cosines", "debiased_cosine", "fit_sources",
           "gram_to_cos", "inner", "mean_coefficients", "noise_energy", "record_cosines", "residual_gram", "safe_div",
           "shared_fit",
           "source_gram", "source_grams", "top_components", "u_statistic_norm2", "window_coefficients", "window_edges", "window_size"]



# ------------------------------------------------------------- inner products
def inner(K: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """Inner products ``<Xᵀa_i, Xᵀb_j> = A K Bᵀ`` of coefficient rows ``A`` (p×N), ``B`` (q×N)."""
    A = np.atleast_2d(A)
    B = A if B is None else np.atleast_2d(B)
    return A @ K @ B.T


def cosines(K: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """Cosine matrix between the vectors ``Xᵀa_i`` and ``Xᵀb_j`` (NaN where a norm is 0)."""
    A = np.atleast_2d(A)
    B = A if B is None else np.atleast_2d(B)
    AK = A @ K
    num = AK @ B.T
    na = np.sqrt(np.maximum(np.einsum("ij,ij->i", AK, A), 0.0))      # diag(A K Aᵀ) without A K Aᵀ
    nb = na if B is A else np.sqrt(np.maximum(np.einsum("ij,ij->i", B @ K, B), 0.0))
    return safe_div(num, np.outer(na, nb))


def record_cosines(K: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Cosine of each record ``g_i`` with the vector ``Xᵀa``."""
    num = K @ a
    den = np.sqrt(np.maximum(np.diag(K), 0.0) * max(float(a @ K @ a), 0.0))
    return safe_div(num, den)


def consecutive_cosines(K: np.ndarray) -> np.ndarray:
    """``cos(g_i, g_{i+1})`` for consecutive rows of K (length N-1)."""
    d = np.sqrt(np.maximum(np.diag(K), 0.0))
    return safe_div(np.diag(K, 1), d[:-1] * d[1:])


def block(K: np.ndarray, rows: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """``K[np.ix_(rows, cols)]`` (*cols* None: *rows*) as two one-axis takes: the same C-ordered copy, cheaper."""
    return np.take(np.take(K, rows, axis=0), rows if cols is None else cols, axis=1)


def safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` clipped to [-1, 1] where ``den > 1e-300``, NaN elsewhere (*den* broadcast to *num*'s shape):
    one masked ``np.divide`` into a NaN-filled array, the same quotients as dividing the selected entries."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    if den.shape != num.shape and np.broadcast_shapes(num.shape, den.shape) != num.shape:
        den = np.broadcast_to(den, num.shape)          # its error: den must broadcast to num
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 1e-300)
    return np.clip(out, -1.0, 1.0, out=out)


# ------------------------------------------------------------------- windows
def window_size(n: int, requested: int | None = None) -> int:
    """Records per window: *requested*, or ``max(4, ceil(n / 16))``."""
    return int(requested) if requested else max(4, math.ceil(n / 16))


def window_coefficients(n: int, size: int) -> np.ndarray:
    """Coefficient rows (W×n) of the means of consecutive windows of *size* rows.

    A last window shorter than half a window is merged into the one before.
    """
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] < size / 2:
        starts.pop()
    bounds = [*starts, n]
    W = np.zeros((len(starts), n))
    for w in range(len(starts)):
        W[w, bounds[w]:bounds[w + 1]] = 1.0 / (bounds[w + 1] - bounds[w])
    return W


def window_edges(n: int, windows: int = 8) -> np.ndarray:
    """Record boundaries of ``min(windows, n)`` contiguous, near-equal windows (``[0, ..., n]``)."""
    return np.linspace(0, n, min(windows, n) + 1).round().astype(int) if n else np.zeros(1, int)


def mean_coefficients(n: int, rows: np.ndarray) -> np.ndarray:
    """Coefficient vector of the mean of the given rows."""
    a = np.zeros(n)
    rows = np.asarray(rows)
    if rows.size:
        a[rows] = 1.0 / rows.size
    return a


def u_statistic_norm2(K: np.ndarray, rows: np.ndarray) -> float:
    """Unbiased ``|E g|²`` from independent records: ``Σ_{i≠j} K_ij / (n(n-1))``.

    Equals ``|mean|² - tr(Σ̂)/n`` with the unbiased sample covariance, i.e. the
    squared norm of the window mean with the noise floor removed (Hoeffding 1948).
    """
    rows = np.asarray(rows)
    n = rows.size
    if n < 2:
        return math.nan
    sub = block(K, rows)
    return float((sub.sum() - np.trace(sub)) / (n * (n - 1)))


def debiased_cosine(K: np.ndarray, rows_a: np.ndarray, rows_b: np.ndarray) -> float:
    """Cosine between the *population* means of two disjoint record sets.

    ``mean_{i∈a, j∈b} K_ij / sqrt(U_a U_b)`` with U-statistic norms: free of the
    attenuation noise puts on the cosine of sample means (the disattenuated
    correlation of Spearman 1904).  NaN where either U is not positive.
    """
    ua, ub = u_statistic_norm2(K, rows_a), u_statistic_norm2(K, rows_b)
    if not (ua > 0 and ub > 0):
        return math.nan
    cross = float(block(K, rows_a, rows_b).mean())
    return float(np.clip(cross / math.sqrt(ua * ub), -1.0, 1.0))


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


def residual_gram(K: np.ndarray, fit: SourceFit) -> np.ndarray:
    """Gram matrix of the records with their source means removed: ``E K E``, ``E = I - A C``.

    Costs O(N² S) (never forms E K E by N×N products).
    """
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    ACK = A @ CK
    return K - ACK - ACK.T + A @ G @ A.T


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
    """``(source_gram(K, fit), source_gram(K, fit, debias=True))`` with ``C K`` and ``C K Cᵀ`` formed once: the
    same products in the same order (``C @ K @ Cᵀ`` is ``(C K) Cᵀ``), so the same floats."""
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


# ----------------------------------------------------------------- PCA via K
def centred(K: np.ndarray) -> np.ndarray:
    """``H K H`` with ``H = I - 11ᵀ/N``: the Gram matrix of the centred records."""
    r = K.mean(axis=0)
    return K - r[None, :] - r[:, None] + K.mean()


def top_components(Kc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-*k* eigenpairs of a (centred) Gram matrix, largest first.

    Returns ``(lam, U)``; the scores of the records on component j are
    ``U[:, j] * sqrt(lam[j])`` (kernel PCA, linear kernel).  Dense ``eigh`` up to
    ``LANCZOS_MIN`` records, Lanczos (``eigsh``, seeded start vector) above.
    """
    n = Kc.shape[0]
    k = max(1, min(k, n))
    S = (Kc + Kc.T) / 2.0
    if n >= LANCZOS_MIN and k < n // 4:
        from scipy.sparse.linalg import eigsh

        v0 = np.random.default_rng(0).standard_normal(n)
        lam, U = eigsh(S, k=k, which="LA", v0=v0, tol=1e-8)
        order = np.argsort(lam)
        lam, U = lam[order], U[:, order]
    else:
        from scipy.linalg import eigh

        lam, U = eigh(S, subset_by_index=(n - k, n - 1))
    lam, U = lam[::-1], U[:, ::-1]
    # deterministic sign: the largest-magnitude entry positive
    s = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])])
    return np.maximum(lam, 0.0), U * np.where(s == 0, 1.0, s)


LANCZOS_MIN = 768
