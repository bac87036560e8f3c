"""The source-label permutation test of conflict: seeded draws and the permuted source Gram matrices.

:func:`permutations` draws one unit's ``B`` permutations of its ``n`` records (within
consecutive blocks in a ``training`` store), seeded by the unit's name (option ``streams``: a tensor's heads may
share the tensor's);
:func:`permuted_source_grams` forms ``Q A_πᵀ K A_π Q`` for each of them (checked against a
brute-force permutation test in ``tests/test_conflict.py``); :class:`PairNulls` draws the
same permutations a round at a time for the units of one design (once per stream), the pairs' null inner
products that :func:`~gradforensics.analysis.toolkit.stats.sequential_permutation_test` stops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["CHUNK_BYTES", "PairNulls", "permutations", "permuted_source_grams"]

CHUNK_BYTES = 4 * 2**20
"""Bytes of permuted mixture columns (``n x c x S`` float64) :func:`permuted_source_grams` gathers at once, at most:
its chunk of permutations shrinks with many sources (``S = 200``, ``n = 400``: 6 a chunk)."""


def permutations(n: int, B: int, seed: int | tuple[int, ...], block: int | None) -> np.ndarray:
    """B×n seeded permutations of ``range(n)``, within consecutive blocks of *block* (None: one block).

    *seed* may be a tuple: conflict seeds each tensor and head with ``(seed, crc32(tensor), head + 1)``
    (0 for the whole tensor; with the option ``streams="tensor"`` 0 for its heads too, which then share
    the tensor's permutations), so every test draws its own permutations and stays reproducible.  A
    Monte-Carlo p-value is valid over its own draws whatever other units drew; shared draws make the
    heads' Monte-Carlo errors dependent (the severities' Bonferroni step holds under any dependence).
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


def permuted_source_grams(K: np.ndarray | Sequence[np.ndarray], A: np.ndarray, Q: np.ndarray, perms: np.ndarray,
                          chunk: int = 128) -> np.ndarray:
    """``Q A_πᵀ K A_π Q`` for every permutation π (rows of *perms*): B×S×S, or U×B×S×S for a stack of U Gram
    matrices (a sequence, or a U×n×n array: the units that share these permutations).

    ``Q = (AᵀA)⁺`` is the same for every π.  Per *chunk* permutations the permuted mixture columns
    ``W = [A_π1 … A_πc]`` are gathered once with ``np.take`` (``n × c·S``, C-contiguous), then each
    unit takes one BLAS product ``K W`` and the ``c`` small products ``A_πᵀ (K A_π)`` from the same two
    operands (with one column, ``S = 2`` and pure batches, an elementwise product summed over the
    records).

    ``Q (·) Q`` is two products of ``S×S`` matrices per permutation.  Where ``Q`` is
    diagonal (pure batches: ``AᵀA`` holds the counts) and the null finite, every entry of
    those products has one non-zero term, ``(q_i g_ij) q_j``, so it is taken entry by
    entry, without ``2B`` tiny ``gemm`` calls.

    Where every mixture row sums to 1 exactly (pure batches), so do ``A_π``'s: the last column
    ``a = 1 - A_π[:, :S-1] 1`` is not gathered, the product with ``K`` takes ``S - 1`` columns a
    permutation (half of them with two sources), and the last row and column of the result follow
    from the column sums of ``K W`` (``K`` symmetric: ``1ᵀ K w = wᵀ K 1``) and ``1ᵀ K 1``:
    ``aᵀ K w = 1ᵀ K w - (A_π[:, :S-1]ᵀ K w) 1``.
    """
    one = isinstance(K, np.ndarray) and K.ndim == 2
    Ks = [K] if one else list(K)
    n, S = A.shape
    ones = S > 1 and bool(np.all(A.sum(axis=1) == 1.0))
    m = S - 1 if ones else S
    Am = np.ascontiguousarray(A[:, :m])
    totals = [float(np.sum(Ku)) for Ku in Ks]                       # 1ᵀ K 1
    chunk = max(1, min(int(chunk), CHUNK_BYTES // (8 * n * S)))
    out = np.empty((len(Ks), perms.shape[0], S, S))
    for s in range(0, perms.shape[0], chunk):
        idx = perms[s:s + chunk]
        c = idx.shape[0]
        wide = np.take(Am, idx.T, axis=0).reshape(n, c * m)         # [A_π1 … A_πc] without the last column
        W3 = wide.reshape(n, c, m)
        for u, Ku in enumerate(Ks):
            KW = Ku @ wide                                           # n × c·m: one BLAS product
            if m == 1:
                H = np.einsum("ij,ij->j", wide, KW).reshape(c, 1, 1)
            else:
                H = np.matmul(W3.transpose(1, 2, 0), KW.reshape(n, c, m).transpose(1, 0, 2))   # c×m×m
            if not ones:
                out[u, s:s + c] = H
                continue
            o = out[u, s:s + c]
            o[:, :m, :m] = H
            wk = KW.sum(axis=0).reshape(c, m)                    # 1ᵀ K A_π[:, :m] = (A_π[:, :m]ᵀ K 1)ᵀ (K symmetric)
            o[:, m, :m] = wk - H.sum(axis=1)                     # aᵀ K A_π[:, :m]
            o[:, :m, m] = wk - H.sum(axis=2)
            o[:, m, m] = (totals[u] - wk.sum(axis=1)) - o[:, m, :m].sum(axis=1)
    q = np.diagonal(Q)
    if np.count_nonzero(Q) == np.count_nonzero(q) and np.isfinite(out).all():
        out *= q[:, None] * q[None, :]                               # (q_i g_ij) q_j: Q @ G @ Q, entry by entry
    else:
        out = Q @ out @ Q
    return out[0] if one else out


class PairNulls:
    """The null inner products of the source pairs of units sharing one design, drawn a round at a time.

    Consecutive units with the same seed (a tensor and its heads with ``streams="tensor"``:
    :func:`~gradforensics.analysis.kinds.conflict.unit.unit_seed`)
    form one *group*: they share one stream of permutations, as :func:`permutations` draws it, so a
    group's ``L`` first draws are the ``L`` first rows of ``permutations(n, B, seed, block)`` however
    the rounds split them, and each round's permutations are gathered once for all its units.  Called as
    ``draw(active, size)`` (:func:`~gradforensics.analysis.toolkit.stats.sequential_permutation_test`):
    the next *size* draws of the groups *active* (indices into :attr:`groups`' values), each unit's pairs
    ``(iu, ju)`` (indices into the design's kept sources) side by side in unit order,
    ``size x (units of active * len(iu))``.
    """

    def __init__(self, grams: list[np.ndarray], seeds: list[int | tuple[int, ...]], A: np.ndarray, Q: np.ndarray,
                 block: int | None, iu: np.ndarray, ju: np.ndarray) -> None:
        self._grams, self._A, self._Q, self._block, self._iu, self._ju = grams, A, Q, block, iu, ju
        self._n = A.shape[0]
        starts = [u for u in range(len(seeds)) if u == 0 or seeds[u] != seeds[u - 1]]
        self._members = [list(range(a, b)) for a, b in zip(starts, [*starts[1:], len(seeds)], strict=True)]
        self.groups = np.repeat(np.arange(len(starts)), [len(m) for m in self._members])
        """The group of each unit (non-decreasing)."""
        self._rngs = [_stream(seeds[m[0]], self._n, block) for m in self._members]

    def __call__(self, active: np.ndarray, size: int) -> np.ndarray:
        P = self._iu.size
        units = [u for g in np.asarray(active, dtype=np.int64).tolist() for u in self._members[g]]
        out = np.empty((size, len(units) * P))
        k = 0
        for g in np.asarray(active, dtype=np.int64).tolist():
            perms = _draw(self._rngs[g], size, self._n, self._block)
            G = permuted_source_grams([self._grams[u] for u in self._members[g]], self._A, self._Q, perms)
            for Gu in G:
                out[:, k * P:(k + 1) * P] = Gu[:, self._iu, self._ju]
                k += 1
        return out
