"""The source-label permutation test of conflict: seeded draws and the permuted source Gram matrices.

:func:`permutations` draws one unit's ``B`` permutations of its ``n`` records (within
consecutive blocks in a ``training`` store), seeded by the unit's name;
:func:`permuted_source_grams` forms ``Q A_πᵀ K A_π Q`` for each of them (checked against a
brute-force permutation test in ``tests/test_conflict.py``); :class:`PairNulls` draws the
same permutations a round at a time for the units of one design, the pairs' null inner
products that :func:`~gradforensics.analysis.toolkit.stats.sequential_permutation_test` stops.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["CHUNK_BYTES", "PairNulls", "permutations", "permuted_source_grams"]

CHUNK_BYTES = 4 * 2**20
"""Bytes of permuted mixture columns (``n x c x S`` float64) :func:`permuted_source_grams` gathers at once, at most:
its chunk of permutations shrinks with many sources (``S = 200``, ``n = 400``: 6 a chunk)."""


def permutations(n: int, B: int, seed: int | tuple[int, ...], block: int | None) -> np.ndarray:
    """B×n seeded permutations of ``range(n)``, within consecutive blocks of *block* (None: one block).

    *seed* may be a tuple: conflict seeds each tensor and head with
    ``(seed, crc32(tensor), head + 1)`` (0 for the whole tensor), so every test draws its own permutations
    (a Monte-Carlo permutation p-value is valid over independent draws; one draw
    shared by every unit would bias them all the same way) and stays reproducible.
    """
    return _draw(_stream(seed, n, block), B, n, block)


def _stream(seed: int | tuple[int, ...], n: int, block: int | None) -> np.random.Generator:
    """The generator of one unit's permutations (:func:`permutations`)."""
    parts = [int(x) for x in (seed if isinstance(seed, tuple) else (seed,))]
    return np.random.default_rng([*parts, n, block or 0])


def _draw(rng: np.random.Generator, B: int, n: int, block: int | None) -> np.ndarray:
    """The next *B* permutations of *rng*'s stream: ``B x n`` uniform keys (row after row), argsorted.

    NumPy fills ``random((B, n))`` from the stream in order, so drawing ``B1`` then ``B2`` rows gives the
    rows of one ``B1 + B2`` draw: the permutations do not depend on how the draws are split.
    """
    keys = rng.random((B, n))
    if block:
        keys += _block_offsets(n, block)[None, :]
    return np.argsort(keys, axis=1)


@functools.lru_cache(maxsize=32)
def _block_offsets(n: int, block: int) -> np.ndarray:
    """``arange(n) // block`` as float64, built once."""
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
    diagonal (pure batches: ``AᵀA`` holds the counts) and the null finite, every entry of
    those products has one non-zero term, ``(q_i g_ij) q_j``, so it is taken entry by
    entry, without ``2B`` tiny ``gemm`` calls.

    Where every mixture row sums to 1 exactly (pure batches), so do ``A_π``'s, and the last
    column of ``K A_π`` is ``K 1`` less the others: the product with ``K`` takes ``S - 1``
    columns a permutation (half of them with two sources).
    """
    n, S = A.shape
    ones = S > 1 and bool(np.all(A.sum(axis=1) == 1.0))
    m = S - 1 if ones else S
    Am = np.ascontiguousarray(A[:, :m])
    row_sums = K.sum(axis=1)[:, None] if ones else None
    chunk = max(1, min(int(chunk), CHUNK_BYTES // (8 * n * S)))
    out = np.empty((perms.shape[0], S, S))
    for s in range(0, perms.shape[0], chunk):
        idx = perms[s:s + chunk]
        c = idx.shape[0]
        wide = np.take(Am, idx.T, axis=0).reshape(n, c * m)         # [A_π1 … A_πc], C-contiguous
        KW = (K @ wide).reshape(n, c, m).transpose(1, 0, 2)
        P = np.take(A, idx, axis=0)                                  # c×n×S
        PT = P.transpose(0, 2, 1)
        H = np.matmul(PT, KW)                                        # c×S×m
        if row_sums is None:
            out[s:s + c] = H
        else:                       # the last column: A_πᵀ K 1 - (A_πᵀ K A_π[:, :S-1]) 1
            out[s:s + c, :, :m] = H
            out[s:s + c, :, m] = np.matmul(PT, row_sums)[:, :, 0] - H.sum(axis=2)
    q = np.diagonal(Q)
    if np.count_nonzero(Q) == np.count_nonzero(q) and np.isfinite(out).all():
        return out * q[:, None] * q[None, :]                         # (q_i g_ij) q_j: Q @ G @ Q, entry by entry
    return Q @ out @ Q


class PairNulls:
    """The null inner products of the source pairs of units sharing one design, drawn a round at a time.

    Unit ``u`` (Gram matrix ``grams[u]``, seed ``seeds[u]``) draws its permutations from its own stream,
    as :func:`permutations` does, so its ``L`` first draws are the ``L`` first rows of
    ``permutations(n, B, seeds[u], block)`` however the rounds split them.  Called as
    ``draw(active, size)`` (:func:`~gradforensics.analysis.toolkit.stats.sequential_permutation_test`):
    the next *size* draws of the units *active*, each unit's pairs ``(iu, ju)`` (indices into the
    design's kept sources) side by side, ``size x (len(active) * len(iu))``.
    """

    def __init__(self, grams: list[np.ndarray], seeds: list[int | tuple[int, ...]], A: np.ndarray, Q: np.ndarray,
                 block: int | None, iu: np.ndarray, ju: np.ndarray) -> None:
        self._grams, self._A, self._Q, self._block, self._iu, self._ju = grams, A, Q, block, iu, ju
        self._n = A.shape[0]
        self._rngs = [_stream(s, self._n, block) for s in seeds]

    def __call__(self, active: np.ndarray, size: int) -> np.ndarray:
        out = np.empty((size, len(active) * self._iu.size))
        for k, u in enumerate(np.asarray(active, dtype=np.int64).tolist()):
            perms = _draw(self._rngs[u], size, self._n, self._block)
            G = permuted_source_grams(self._grams[u], self._A, self._Q, perms)
            out[:, k * self._iu.size:(k + 1) * self._iu.size] = G[:, self._iu, self._ju]
        return out
