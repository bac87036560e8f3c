"""The source-label permutation test of conflict: seeded draws and the permuted source Gram matrices.

:func:`permutations` draws one unit's ``B`` permutations of its ``n`` records (within
consecutive blocks in a ``training`` store), seeded by the unit's name;
:func:`permuted_source_grams` forms ``Q A_πᵀ K A_π Q`` for each of them.  Both give the
numbers of the first version bit for bit (``tests/test_unit_statistics_exact.py``,
``tests/test_unit_statistics_batched.py``).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

__all__ = ["INDEX_BITS", "KEEP_BYTES", "permutation_null", "permutations", "permuted_source_grams", "sorted_order"]

#: Low bits of a key's int64 image that carry the record index in :func:`sorted_order` (n ≤ 2,048).
INDEX_BITS = 11
_LOW = (1 << INDEX_BITS) - 1
#: The largest work array (bytes) :func:`permutation_null` keeps for the thread's next unit.
KEEP_BYTES = 8 * 2**20
_WORK = threading.local()


def permutations(n: int, B: int, seed: int | tuple[int, ...], block: int | None) -> np.ndarray:
    """B×n seeded permutations of ``range(n)``, within consecutive blocks of *block* (None: one block).

    *seed* may be a tuple: conflict seeds each tensor and head with
    ``(seed, crc32(tensor), head + 1)`` (0 for the whole tensor), so every test draws its own permutations
    (a Monte-Carlo permutation p-value is valid over independent draws; one draw
    shared by every unit would bias them all the same way) and stays reproducible.

    The rows are ``np.argsort`` of uniform keys plus the block number, found by
    :func:`sorted_order` (the same rows, bit for bit; a row it cannot prove is argsorted).
    """
    return _draw(n, B, seed, block, np.empty((B, n)), np.empty((B, n), dtype=np.intp))


def permutation_null(K: np.ndarray, A: np.ndarray, Q: np.ndarray, B: int, seed: int | tuple[int, ...],
                     block: int | None) -> np.ndarray:
    """``permuted_source_grams(K, A, Q, permutations(len(K), B, seed, block))``, the same floats.

    The keys, the permutations and the products' operands are written into work arrays the
    calling thread keeps for its next unit (up to :data:`KEEP_BYTES` each): a unit's fresh
    arrays (2 MB at 128 records) cost it a page fault every 4 KB, about a millisecond.
    """
    n = K.shape[0]
    perms = _draw(n, B, seed, block, _work("keys", (B, n), np.float64), _work("perms", (B, n), np.intp))
    return permuted_source_grams(K, A, Q, perms, work=True)


def _draw(n: int, B: int, seed: int | tuple[int, ...], block: int | None, keys: np.ndarray,
          out: np.ndarray) -> np.ndarray:
    """:func:`permutations` into *out* (B×n intp), *keys* (B×n float64) its scratch."""
    parts = [int(x) for x in (seed if isinstance(seed, tuple) else (seed,))]
    _keys(parts, n, block, keys)
    if n > 1 << INDEX_BITS:
        out[...] = np.argsort(keys, axis=1)
        return out
    unproven = sorted_order(keys, out)
    if unproven.size:                     # a near-tie (about 1e-8 a row): numpy's own order of the same keys
        out[unproven] = np.argsort(_keys(parts, n, block, np.empty((B, n)))[unproven], axis=1)
    return out


def _keys(parts: list[int], n: int, block: int | None, out: np.ndarray) -> np.ndarray:
    """The draw's sort keys into *out* (B×n): uniforms in [0, 1), plus the block number in a ``training`` store."""
    np.random.default_rng([*parts, n, block or 0]).random(out=out)
    if block:
        out += _block_offsets(n, block)[None, :]
    return out


def _work(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A C-contiguous work array of *shape* that this thread keeps (a fresh one when over :data:`KEEP_BYTES`)."""
    size = math.prod(shape)
    if size * np.dtype(dtype).itemsize > KEEP_BYTES:
        return np.empty(shape, dtype=dtype)
    kept: dict[str, np.ndarray] = _WORK.__dict__.setdefault("arrays", {})
    buf = kept.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = kept[name] = np.empty(size, dtype=dtype)
    return buf[:size].reshape(shape)


def sorted_order(keys: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, axis=1)`` into *out* for non-negative float64 keys (n ≤ 2**INDEX_BITS), *keys* overwritten.

    Returns the rows it could not prove (for the caller to argsort from the original
    keys).  A non-negative double's bits, read as an int64, order as the double does;
    their low :data:`INDEX_BITS` bits are replaced by the column index and the int64 rows
    sorted (``np.sort`` of integers costs a third of ``argsort`` of floats), the index read
    back from the low bits.  A row is proven when its sorted high parts (the keys without
    their low bits) strictly increase: then its keys strictly increase along the
    permutation, the only order that sorts them, so every ``argsort`` (any kind, with ties
    or without) gives it.  A row with two keys within ``2**11`` units in the last place of
    each other (a tie among them) is left unproven.
    """
    n = keys.shape[1]
    comp = keys.view(np.int64)
    comp &= ~_LOW
    comp |= np.arange(n, dtype=np.int64)
    comp.sort(axis=1)
    np.bitwise_and(comp, _LOW, out=out)
    comp ^= out                                              # the high parts, in sorted order
    proven = (comp[:, 1:] > comp[:, :-1]).all(axis=1)
    return np.flatnonzero(~proven)


@functools.lru_cache(maxsize=32)
def _block_offsets(n: int, block: int) -> np.ndarray:
    """``arange(n) // block`` as float64 (exact integers: the same sums as adding the integers), built once."""
    out = (np.arange(n) // block).astype(np.float64)
    out.flags.writeable = False
    return out


def permuted_source_grams(K: np.ndarray, A: np.ndarray, Q: np.ndarray, perms: np.ndarray,
                          chunk: int = 128, work: bool = False) -> np.ndarray:
    """``Q A_πᵀ K A_π Q`` for every permutation π (rows of *perms*): B×S×S.

    ``Q = (AᵀA)⁺`` is the same for every π.  One BLAS product ``K [A_π1 … A_πc]``
    per *chunk* permutations.  The permuted mixtures are gathered with ``np.take``
    straight into the layouts the two products read (``n×c×S`` for ``K``'s, ``c×n×S``
    for the small one), which are the arrays the fancy-indexed gather and its
    transposed copy gave: the same products on the same operands, bit for bit, at a
    third of the gathering cost.  The gathers and products write into three buffers
    allocated once for all chunks (``out=``; ``mode="clip"`` so that ``np.take`` writes
    straight into them instead of through a copy: the rows of *perms* are permutations of
    ``range(n)``, so no index is clipped): the same calls on the same operands, without a
    fresh array a chunk.  *work*: the thread's kept work arrays instead (:func:`permutation_null`).

    ``Q (·) Q`` is two products of ``S×S`` matrices per permutation.  Where ``Q`` is
    diagonal (pure batches: ``AᵀA`` holds the counts) and the null finite, every entry of
    those products has one non-zero term, ``(q_i g_ij) q_j``, so it is taken entry by
    entry: the same floats (the other terms are exact zeros), without ``2B`` tiny
    ``gemm`` calls.
    """
    n, S = A.shape
    B = perms.shape[0]
    out = np.empty((B, S, S))
    size = n * min(chunk, B) * S
    bufs = tuple(_work(name, (size,), np.float64) if work else np.empty(size) for name in ("wide", "KP", "P"))
    for s in range(0, B, chunk):
        idx = perms[s:s + chunk]
        c = idx.shape[0]
        wide, KP, P = (b[:n * c * S] for b in bufs)
        np.take(A, idx.T, axis=0, out=wide.reshape(n, c, S), mode="clip")   # [A_π1 … A_πc], C-contiguous
        np.matmul(K, wide.reshape(n, c * S), out=KP.reshape(n, c * S))
        np.take(A, idx, axis=0, out=P.reshape(c, n, S), mode="clip")       # c×n×S
        np.matmul(P.reshape(c, n, S).transpose(0, 2, 1), KP.reshape(n, c, S).transpose(1, 0, 2), out=out[s:s + c])
    q = np.diagonal(Q)
    if np.count_nonzero(Q) == np.count_nonzero(q) and np.isfinite(out).all():
        return out * q[:, None] * q[None, :]                         # (q_i g_ij) q_j: Q @ G @ Q, entry by entry
    return Q @ out @ Q
