"""Issue 28: conflict's permutation test, cheaper, with every float of the code it replaced.

:func:`~gradforensics.analysis.toolkit.permtest.permutations` finds the ``argsort`` of its
keys by an int64 sort of their bits (rows it cannot prove argsorted), and
:func:`~gradforensics.analysis.toolkit.permtest.permutation_null` writes the draws and the
products' operands into work arrays each thread keeps.  The oracles are the two functions
as they were at 26c235c, copied here; equality is ``np.array_equal`` / ``.tobytes()``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gradforensics.analysis.toolkit import permtest as pt


# ------------------------------------------------------------ the oracles (26c235c)
def old_permutations(n: int, B: int, seed: int | tuple[int, ...], block: int | None) -> np.ndarray:
    parts = [int(x) for x in (seed if isinstance(seed, tuple) else (seed,))]
    rng = np.random.default_rng([*parts, n, block or 0])
    keys = rng.random((B, n))
    if block:
        keys += (np.arange(n) // block).astype(np.float64)[None, :]
    return np.argsort(keys, axis=1)


def old_grams(K: np.ndarray, A: np.ndarray, Q: np.ndarray, perms: np.ndarray, chunk: int = 128) -> np.ndarray:
    n, S = A.shape
    out = np.empty((perms.shape[0], S, S))
    for s in range(0, perms.shape[0], chunk):
        idx = perms[s:s + chunk]
        c = idx.shape[0]
        wide = np.take(A, idx.T, axis=0).reshape(n, c * S)
        KP = (K @ wide).reshape(n, c, S).transpose(1, 0, 2)
        P = np.take(A, idx, axis=0)
        out[s:s + c] = np.matmul(P.transpose(0, 2, 1), KP)
    q = np.diagonal(Q)
    if np.count_nonzero(Q) == np.count_nonzero(q) and np.isfinite(out).all():
        return out * q[:, None] * q[None, :]
    return Q @ out @ Q


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------ permutations
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 128, 1000, 2048, 2049, 3000])
def test_permutations_are_the_argsort_of_the_old_keys(n: int) -> None:
    """Lengths around the packed sort's limit (2,048 records: larger ones argsort), blocks None, 1, 7, n and more."""
    B = 999 if n <= 128 else 25
    for block in (None, 1, 2, 7, 8, max(n, 1), n + 5):
        for seed in range(6 if n <= 128 else 2):
            s = (seed, 12345 + n, block or 0)
            assert _same(pt.permutations(n, B, s, block), old_permutations(n, B, s, block)), (n, block, seed)


def test_permutations_over_many_seeds() -> None:
    rng = np.random.default_rng(28)
    for trial in range(300):
        n, B = int(rng.integers(2, 300)), int(rng.integers(1, 60))
        block = None if trial % 3 == 0 else int(rng.integers(1, 40))
        seed = (trial, int(rng.integers(0, 2**32)), trial % 9) if trial % 2 else trial
        assert _same(pt.permutations(n, B, seed, block), old_permutations(n, B, seed, block)), trial


def _argsorted(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sorted_order's result with its unproven rows argsorted (what permutations does), and those rows."""
    out = np.empty(keys.shape, dtype=np.intp)
    unproven = pt.sorted_order(keys.copy(), out)
    out[unproven] = np.argsort(keys[unproven], axis=1)
    return out, unproven


def test_planted_ties_are_left_to_argsort() -> None:
    """Exact ties, ties the block offsets make (two keys rounding to one sum, a block's top rounding onto the
    next block), near ties: each row is left unproven, and the result is numpy's own argsort of the keys."""
    rng = np.random.default_rng(5)
    n, block = 128, 8
    off = (np.arange(n) // block).astype(np.float64)
    keys = rng.random((12, n))
    keys[0, 5] = keys[0, 3]                                    # an exact tie, same block
    keys[1, 40] = keys[1, 100]                                 # an exact tie, no blocks
    keys[2, 10], keys[2, 11] = 0.5, 0.5 + 2.0**-53              # distinct uniforms ...
    keys[3, 16], keys[3, 24] = 1.0 - 2.0**-53, 0.0              # ... a block's top, the next block's bottom
    keys[4, 5] = np.nextafter(keys[4, 6], 2.0)                  # one unit in the last place apart
    keys[5, 77] = keys[5, 78] + 1000 * np.spacing(keys[5, 78])  # within 2**11 units
    keys[6, :] = 0.25                                          # a constant row
    keys[7, :] = 0.0                                           # zeros
    blocked = keys + off[None, :]
    assert blocked[2, 10] == blocked[2, 11] and blocked[3, 16] == blocked[3, 24]   # the sums do tie
    for k, tied in ((blocked, (0, 2, 3, 4, 5, 6, 7)), (keys, (0, 1, 4, 5, 6, 7))):
        got, unproven = _argsorted(k)
        assert _same(got, np.argsort(k, axis=1))
        assert set(tied) <= set(unproven.tolist())
        assert not set(unproven.tolist()) - set(range(8))           # the untouched rows are proven


def test_random_rows_are_proven_and_the_keys_redraw_the_same() -> None:
    """Rows of a real draw are proven (the fallback is for near ties only), and a redraw gives the same keys."""
    keys = pt._keys([1, 2, 3], 128, 8, np.empty((999, 128)))
    ref = np.random.default_rng([1, 2, 3, 128, 8]).random((999, 128)) + (np.arange(128) // 8)[None, :]
    assert _same(keys, ref)
    assert _same(pt._keys([1, 2, 3], 128, 8, np.empty((999, 128))), keys)
    got, unproven = _argsorted(keys)
    assert unproven.size == 0 and _same(got, np.argsort(keys, axis=1))


# --------------------------------------------------------- the permuted Gram matrices
def _case(rng: np.random.Generator, n: int, S: int, pure: bool, nan: bool = False):
    X = rng.standard_normal((n, int(rng.integers(2, 60))))
    K = X @ X.T
    if nan:
        K[0, 0] = np.nan
    A = np.eye(S)[rng.integers(0, S, n)] if pure else rng.dirichlet(np.ones(S), n)
    return K, np.ascontiguousarray(A), np.linalg.pinv(A.T @ A)


@pytest.mark.parametrize("pure", [True, False])
def test_permuted_source_grams_are_the_old_floats(pure: bool) -> None:
    """Every chunk size (one, a few, 128, more than B), S 1 to 4, a non-finite K, both with and without work arrays."""
    rng = np.random.default_rng(7 + pure)
    for trial in range(30):
        n, S, B = int(rng.integers(3, 150)), int(rng.integers(1, 5)), int(rng.integers(1, 300))
        K, A, Q = _case(rng, n, S, pure, nan=trial % 10 == 9)
        perms = old_permutations(n, B, (trial, 3), None if trial % 3 == 0 else int(rng.integers(2, 12)))
        for chunk in (128, 37, 1, B + 3):
            want = old_grams(K, A, Q, perms, chunk)
            assert _same(pt.permuted_source_grams(K, A, Q, perms, chunk), want), (trial, chunk)
            assert _same(pt.permuted_source_grams(K, A, Q, perms, chunk, work=True), want), (trial, chunk)


def test_permutation_null_is_the_old_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work arrays reused over units of other sizes (larger, smaller, then over KEEP_BYTES: fresh arrays)."""
    rng = np.random.default_rng(11)
    sizes = [(128, 2, 999), (40, 3, 99), (128, 3, 999), (7, 2, 19), (200, 2, 301)]
    for keep in (pt.KEEP_BYTES, 1000):
        monkeypatch.setattr(pt, "KEEP_BYTES", keep)
        for trial, (n, S, B) in enumerate(sizes * 2):
            K, A, Q = _case(rng, n, S, trial % 2 == 0)
            seed, block = (trial, 99, 1), (None, 8)[trial % 2]
            want = old_grams(K, A, Q, old_permutations(n, B, seed, block))
            assert _same(pt.permutation_null(K, A, Q, B, seed, block), want), (keep, trial)


def test_permutation_null_on_threads_is_the_serial_one() -> None:
    """Each thread keeps its own work arrays: units run four at a time give every unit's own floats."""
    rng = np.random.default_rng(3)
    cases = [(*_case(rng, int(n), 2, True), (i, 5, 0)) for i, n in enumerate(rng.integers(60, 140, 24))]
    want = [old_grams(K, A, Q, old_permutations(K.shape[0], 199, s, 8)) for K, A, Q, s in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda c: pt.permutation_null(c[0], c[1], c[2], 199, c[3], 8), cases))
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))
