"""Spectra of 2-D matrices: singular values (exact or randomized), stable and effective rank, power-law tail.

The maths the spectral analysis (:mod:`gradforensics.analysis.kinds.spectral`) applies
to every weight snapshot, window-mean gradient and head block:

* :func:`stacked_singular_values`: exact up to :data:`EXACT_MAX_DIM` on the smaller side
  (the eigenvalues of the smaller Gram side, LAPACK, float64, one ``eigvalsh`` call a
  shape), ``σ_1`` alone by Lanczos where only it is wanted on more than
  :data:`TOP_MIN_DIM` rows, a randomized top :data:`RANDOMIZED_K` above (Halko,
  Martinsson & Tropp 2011); :func:`singular_values` is a stack of one;
* :func:`stable_ranks` ``‖W‖_F² / ‖W‖_2²`` (Rudelson & Vershynin 2007),
  :func:`effective_rank` ``exp(H(p))`` (Roy & Vetterli 2007), :func:`top_share`;
* :func:`powerlaw_fit`: the tail exponent of ``σ²`` with ``xmin`` by Kolmogorov–Smirnov
  distance (Clauset, Shalizi & Newman 2009; as WeightWatcher fits it);
* :func:`block_matrices` / :func:`block_spectra`: a matrix and its per-head blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "EVALS_THRESH",
    "EXACT_MAX_DIM",
    "MIN_EVALS",
    "NO_FIT",
    "RANDOMIZED_K",
    "TOP_MIN_DIM",
    "TOP_TOL",
    "PowerLawFit",
    "Spectrum",
    "block_matrices",
    "block_spectra",
    "effective_rank",
    "powerlaw_fit",
    "singular_values",
    "stable_ranks",
    "stacked_singular_values",
    "top_share",
]

EXACT_MAX_DIM = 4096       # exact SVD when min(shape) <= this, randomized top-k above
RANDOMIZED_K = 256
TOP_TOL = 1e-8             # relative tolerance of the Lanczos sigma_1 of the window means but the last
TOP_MIN_DIM = 64           # at most this many Gram rows: the whole spectrum (as cheap, no ARPACK set-up)
EVALS_THRESH = 1e-5        # WeightWatcher's floor on eigenvalues entering the fit
MIN_EVALS = 20             # no fit below this many eigenvalues


@dataclass(frozen=True)
class Spectrum:
    """Singular values (descending), ``‖W‖_F²`` and whether the values are all of them."""

    sv: np.ndarray
    fro2: float
    exact: bool


def singular_values(m: np.ndarray, exact_max: int = EXACT_MAX_DIM, k: int = RANDOMIZED_K,
                    top_only: bool = False) -> Spectrum:
    """The :class:`Spectrum` of one 2-D matrix: :func:`stacked_singular_values` of a stack of one."""
    return stacked_singular_values([m], [top_only], exact_max, k)[0]


def stacked_singular_values(ms: Sequence[np.ndarray], top_only: Sequence[bool], exact_max: int = EXACT_MAX_DIM,
                            k: int = RANDOMIZED_K) -> list[Spectrum]:
    """Singular values of each 2-D matrix of *ms*: exact up to ``min(shape) <= exact_max``, else top-*k* randomized.

    The exact route takes the eigenvalues (float64) of the smaller Gram side
    (``a aᵀ`` or ``aᵀ a``, a product in the matrix's own precision, float32 for
    stored weights and gradients): the ESD is of ``σ²`` anyway, and it costs a
    fraction of an SVD on a rectangular matrix.  Eigenvalues agree with LAPACK's
    SVD to ``~1e-6 σ_max²`` in float32 (``~1e-15`` in float64): the tail a power
    law is fitted to is unchanged, only the smallest singular values lose digits.
    The matrices of one shape and precision that take it have their eigenvalues
    taken in one stacked ``eigvalsh`` call (a head block of 4 x 32 floats cost
    ~50 µs a call alone, most of it NumPy's per-call overhead).

    ``top_only`` (per matrix): only ``σ_1`` (and the exact ``‖W‖_F²``) is wanted, as
    for every window-mean gradient but the last: the largest eigenvalue of the same
    Gram side by Lanczos (ARPACK ``eigsh``, relative tolerance :data:`TOP_TOL`, a
    fixed start vector: deterministic), 2-3x cheaper than the whole spectrum at
    448-960 rows and equal to its largest value to ``~1e-12`` relative.  The
    spectrum then holds ``σ_1`` alone and ``exact`` is False (not all values).
    Matrices whose smaller side is at most :data:`TOP_MIN_DIM` take the exact
    route regardless.
    """
    out: list[Spectrum | None] = [None] * len(ms)
    groups: dict[tuple[int, ...], list[tuple[int, np.ndarray]]] = {}
    for i, (m, top) in enumerate(zip(ms, top_only, strict=True)):
        a = _finite(m)
        small = min(a.shape)
        if small <= exact_max and (not top or small <= TOP_MIN_DIM):
            groups.setdefault((*a.shape, a.dtype.itemsize), []).append((i, a))
        elif small <= exact_max:
            top_ev = _top_eigenvalue(_gram_side(a).astype(np.float64))
            out[i] = Spectrum(np.array([np.sqrt(max(top_ev, 0.0))]), _fro2(a), False)
        else:
            from sklearn.utils.extmath import randomized_svd

            _, sv, _ = randomized_svd(a.astype(np.float32), n_components=k, n_iter=7, random_state=0)
            out[i] = Spectrum(np.sort(sv.astype(np.float64))[::-1], _fro2(a), False)
    for items in groups.values():
        ev = np.linalg.eigvalsh(np.stack([_gram_side(a) for _, a in items]).astype(np.float64))
        sv = np.sort(np.sqrt(np.maximum(ev, 0.0)), axis=-1)[:, ::-1]
        for (i, a), row in zip(items, sv, strict=True):
            out[i] = Spectrum(row, _fro2(a), True)
    return [s for s in out if s is not None]


def _finite(m: np.ndarray) -> np.ndarray:
    """*m* as float32 (float32 in) or float64, non-finite elements as 0."""
    dtype: Any = np.float32 if np.asarray(m).dtype == np.float32 else np.float64
    a: np.ndarray = np.asarray(m, dtype=dtype)
    if not np.isfinite(a).all():
        a = np.where(np.isfinite(a), a, 0.0).astype(dtype)
    return a


def _fro2(a: np.ndarray) -> float:
    return float(np.einsum("ij,ij->", a, a, dtype=np.float64))


def _gram_side(a: np.ndarray) -> np.ndarray:
    """The smaller Gram side of *a*, in its own precision."""
    return a @ a.T if a.shape[0] <= a.shape[1] else a.T @ a


def _top_eigenvalue(g: np.ndarray) -> float:
    """The largest eigenvalue of the symmetric positive semi-definite *g* (Lanczos, ARPACK)."""
    from scipy.sparse.linalg import eigsh

    if not np.any(g):
        return 0.0
    return float(eigsh(g, k=1, which="LA", return_eigenvectors=False, tol=TOP_TOL,
                       v0=np.ones(g.shape[0]))[0])


def stable_ranks(spectra: Sequence[Spectrum]) -> np.ndarray:
    """``‖W‖_F² / ‖W‖_2²`` of each spectrum (NaN where ``σ_1`` is 0 or absent)."""
    top = np.array([s.sv[0] if s.sv.size else 0.0 for s in spectra], dtype=np.float64)
    fro2 = np.array([s.fro2 for s in spectra], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(top > 0, fro2 / top ** 2, np.nan)


def effective_rank(sv: np.ndarray) -> float:
    """``exp(-Σ p_i ln p_i)`` with ``p_i = σ_i / Σσ`` (Roy & Vetterli 2007)."""
    sv = np.asarray(sv, dtype=np.float64)
    total = sv.sum()
    if total <= 0:
        return float("nan")
    p = sv[sv > 0] / total
    return float(np.exp(-np.sum(p * np.log(p))))


def top_share(s: Spectrum, k: int) -> float:
    """Share of ``‖W‖_F²`` in the top *k* singular values."""
    return float(np.sum(s.sv[:k] ** 2) / s.fro2) if s.fro2 > 0 else float("nan")


@dataclass(frozen=True)
class PowerLawFit:
    alpha: float
    xmin: float
    ks: float
    n_tail: int


NO_FIT = PowerLawFit(float("nan"), float("nan"), float("nan"), 0)


def powerlaw_fit(evals: np.ndarray, thresh: float = EVALS_THRESH) -> PowerLawFit:
    """Power-law exponent of the tail of *evals*, with xmin chosen by KS distance.

    For each candidate ``xmin = λ_(i)`` (every sorted eigenvalue above *thresh* but
    the largest): ``α̂ = 1 + n / Σ_{j≥i} ln(λ_j / xmin)`` and
    ``D = max_j |1 - (λ_j/xmin)^(1-α̂) - (j-i)/n|``; the fit with the smallest ``D``
    wins (the estimator WeightWatcher 0.7 uses).  Fewer than :data:`MIN_EVALS`
    eigenvalues give NaN.
    """
    x = np.sort(np.asarray(evals, dtype=np.float64))
    x = x[np.isfinite(x) & (x > thresh)]
    n_all = x.size
    if n_all < MIN_EVALS:
        return NO_FIT
    logx = np.log(x)
    tail_sum = np.cumsum(logx[::-1])[::-1]                  # Σ_{j>=i} ln λ_j
    n = (n_all - np.arange(n_all - 1)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alphas = 1.0 + n / (tail_sum[:-1] - n * logx[:-1])
    ds = np.ones(n_all - 1)
    cand = np.flatnonzero(alphas > 1.0)
    j = np.arange(n_all)
    step = max(1, (1 << 22) // n_all)                       # candidates per block: ~32 MB of float64
    for s in range(0, cand.size, step):
        i = cand[s:s + step, None]
        with np.errstate(over="ignore", invalid="ignore"):
            cdf = 1.0 - np.exp((1.0 - alphas[i]) * (logx[None, :] - logx[i]))
        gap = np.where(j[None, :] >= i, np.abs(cdf - (j[None, :] - i) / (n_all - i)), 0.0)
        ds[cand[s:s + step]] = gap.max(axis=1)
    best = int(np.argmin(ds))
    return PowerLawFit(float(alphas[best]), float(x[best]), float(ds[best]), int(n_all - best))


def block_spectra(m: np.ndarray, spec: Any, split: bool, top_only: bool = False) -> dict[int | None, Spectrum]:
    """Spectra of a matrix (key None) and of its per-head blocks (keys 0..H-1).

    *m* is the whole matrix when ``split`` is False (blocks are cut with *spec*), or
    already ``(H, ...)`` head blocks when True (the whole matrix is rebuilt).
    ``top_only``: ``σ_1`` and ``‖W‖_F²`` only (:func:`singular_values`).
    """
    keys, mats = block_matrices(m, spec, split)
    return dict(zip(keys, stacked_singular_values(mats, [top_only] * len(mats)), strict=True))


def block_matrices(m: np.ndarray, spec: Any, split: bool) -> tuple[list[int | None], list[np.ndarray]]:
    """The keys and 2-D matrices :func:`block_spectra` takes the spectra of: the whole (None), each head."""
    m = np.asarray(m)
    if spec is None:
        return [None], [m]
    blocks = m if split else spec.split(m)
    whole = spec.merge(blocks) if split else m
    keys: list[int | None] = [None, *range(blocks.shape[0])]
    return keys, [whole, *(blocks[h].reshape(blocks.shape[1], -1) for h in range(blocks.shape[0]))]
