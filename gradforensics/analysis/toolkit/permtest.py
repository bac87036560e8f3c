"""The source-label permutation test of conflict: seeded draws and the permuted source Gram matrices.

:func:`permutations` draws one unit's ``B`` permutations of its ``n`` records (within
consecutive blocks in a ``training`` store), seeded by the unit's name;
:func:`permuted_source_grams` forms ``Q A_πᵀ K A_π Q`` for each of them.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["permutations", "permuted_source_grams"]


def permutations(n: int, B: int, seed: int | tuple[int, ...], block: int | None) -> np.ndarray:
    """B×n seeded permutations of ``range(n)``, within consecutive blocks of *block* (None: one block).

    *seed* may be a tuple: conflict seeds each tensor and head with
    ``(seed, crc32(tensor), head + 1)`` (0 for the whole tensor), so every test draws its own permutations
    (a Monte-Carlo permutation p-value is valid over independent draws; one draw
    shared by every unit would bias them all the same way) and stays reproducible.
    """
    parts = [int(x) for x in (seed if isinstance(seed, tuple) else (seed,))]
    rng = np.random.default_rng([*parts, n, block or 0])
    keys = rng.random((B, n))
    if block:
        keys += _block_offsets(n, block)[None, :]
    return np.argsort(keys, axis=1)


@functools.lru_cache(maxsize=32)
def _block_offsets(n: int, block: int) -> np.ndarray:
    """``arange(n) // block`` as float64 (exact integers: the same sums as adding the integers), built once."""
    out = (np.arange(n) // block).astype(np.float64)
    out.flags.writeable = False
    return out


def permuted_source_grams(K: np.ndarray, A: np.ndarray, Q: np.ndarray, perms: np.ndarray,
                          chunk: int = 128) -> np.ndarray:
    """``Q A_πᵀ K A_π Q`` for every permutation π (rows of *perms*): B×S×S.

    ``Q = (AᵀA)⁺`` is the same for every π.  One BLAS product ``K [A_π1 … A_πc]``
    per *chunk* permutations.  The permuted mixtures are gathered with ``np.take``
    straight into the layouts the two products read (``n×c×S`` for ``K``'s, ``c×n×S``
    for the small one).

    ``Q (·) Q`` is two products of ``S×S`` matrices per permutation.  Where ``Q`` is
    diagonal (pure batches: ``AᵀA`` holds the counts) and the null finite, it is the
    entrywise ``(q_i g_ij) q_j``, without ``2B`` tiny ``gemm`` calls.
    """
    n, S = A.shape
    out = np.empty((perms.shape[0], S, S))
    for s in range(0, perms.shape[0], chunk):
        idx = perms[s:s + chunk]
        c = idx.shape[0]
        wide = np.take(A, idx.T, axis=0).reshape(n, c * S)          # [A_π1 … A_πc], C-contiguous
        KP = (K @ wide).reshape(n, c, S).transpose(1, 0, 2)
        P = np.take(A, idx, axis=0)                                  # c×n×S
        out[s:s + c] = np.matmul(P.transpose(0, 2, 1), KP)
    q = np.diagonal(Q)
    if np.count_nonzero(Q) == np.count_nonzero(q) and np.isfinite(out).all():
        return out * q[:, None] * q[None, :]                         # (q_i g_ij) q_j: Q @ G @ Q, entry by entry
    return Q @ out @ Q
