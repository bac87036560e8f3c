"""The sequential Monte-Carlo permutation test (Besag & Clifford 1991) against direct counts, the fixed test and a
planted null; conflict's restructured (slabbed, columnar) computation against its one-unit form."""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.kinds.conflict import permtest as pt
from gradforensics.analysis.kinds.conflict import unit as cu
from gradforensics.analysis.toolkit.stats import sequential_permutation_test


class _Stored:
    """A draw function over stored draws ``(tests, B)``: every test its own group, reads counted."""

    def __init__(self, draws: np.ndarray) -> None:
        self.draws, self.at, self.read = draws, np.zeros(draws.shape[0], dtype=int), 0

    def __call__(self, active: np.ndarray, size: int) -> np.ndarray:
        out = np.stack([self.draws[g, self.at[g]:self.at[g] + size] for g in active], axis=1)
        self.at[active] += size
        self.read += out.size
        return out


def _direct(null: np.ndarray, t: float, B: int, h: int) -> tuple[float, int, bool]:
    """``h / L`` by a direct count (the first L with h draws <= t, L < B), else ``(1 + #) / (B + 1)``."""
    reached = 0
    for L, x in enumerate(null[:B], start=1):
        reached += x <= t
        if reached == h and L < B:
            return h / L, L, True
    return (1 + int(np.sum(null[:B] <= t))) / (B + 1), B, False


def test_early_stop_p_is_h_over_L_by_a_direct_count() -> None:
    rng = np.random.default_rng(0)
    m, B, h = 300, 199, 10
    obs = rng.normal(size=m) - np.linspace(0, 4, m)          # from null-like to far in the tail
    draws = rng.normal(size=(m, B))
    res = sequential_permutation_test(obs, _Stored(draws), np.arange(m), B, h)
    for i in range(m):
        p, L, stopped = _direct(draws[i], obs[i], B, h)
        assert (res.p[i], res.draws[i], bool(res.stopped[i])) == (p, L, stopped), i
        assert res.mean[i] == pytest.approx(draws[i, :L].mean(), abs=1e-12)
        assert res.sd[i] == pytest.approx(draws[i, :L].std(), rel=1e-10)
    assert 50 < res.stopped.sum() < m - 50                     # both kinds present


def test_tests_that_run_to_B_get_the_fixed_p_and_rounds_do_not_matter() -> None:
    rng = np.random.default_rng(1)
    m, B = 200, 999
    obs = rng.normal(size=m) - np.linspace(0, 4, m)
    draws = rng.normal(size=(m, B))
    fixed = sequential_permutation_test(obs, _Stored(draws), np.arange(m), B, None)
    np.testing.assert_array_equal(fixed.p, (1 + (draws <= obs[:, None]).sum(axis=1)) / (B + 1))
    seq = sequential_permutation_test(obs, (s := _Stored(draws)), np.arange(m), B, 10)
    full = ~seq.stopped
    assert full.sum() > 20 and seq.stopped.sum() > 100
    np.testing.assert_array_equal(seq.p[full], fixed.p[full])
    assert s.read < 0.7 * draws.size                            # the stopped ones drew fewer
    other = sequential_permutation_test(obs, _Stored(draws), np.arange(m), B, 10, blocks=(7, 300), cells=500)
    np.testing.assert_array_equal(other.p, seq.p)
    np.testing.assert_array_equal(other.draws, seq.draws)


def test_sequential_p_values_are_valid_under_a_planted_null() -> None:
    """Observed statistic and its draws i.i.d. (exchangeable): P(p <= a) <= a within binomial tolerance."""
    rng = np.random.default_rng(2)
    m, B = 20000, 999
    obs = rng.normal(size=m)

    def draw(active: np.ndarray, size: int) -> np.ndarray:
        return rng.normal(size=(size, active.size))

    res = sequential_permutation_test(obs, draw, np.arange(m), B, 10)
    for a in (0.01, 0.05, 0.1, 0.25, 0.5):
        assert np.mean(res.p <= a) <= a + 3 * np.sqrt(a * (1 - a) / m), a
    assert np.mean(res.p <= 0.05) > 0.04                          # not void either
    assert res.stopped.mean() > 0.95 and res.draws[res.stopped].mean() < 100


def test_conflict_units_under_the_null_are_valid_and_stop_early() -> None:
    """Real conflict draws: 600 units of pure noise, two sources; the p-values are valid and most units stop."""
    rng = np.random.default_rng(3)
    n, U = 24, 600
    mix = np.eye(2)[np.arange(n) % 2]
    opts = cu.ConflictOptions()
    design = cu.source_design(mix, opts, training=False)
    X = rng.standard_normal((U, n, 6))
    out = cu.conflict_units(list(X @ X.transpose(0, 2, 1)), mix, opts, False, [(0, u) for u in range(U)], design)
    p = np.array([cols["p_value"][0] for cols, _, _ in out])
    draws = np.array([cols["draws"][0] for cols, _, _ in out])
    for a in (0.05, 0.1, 0.5):
        assert np.mean(p <= a) <= a + 3 * np.sqrt(a * (1 - a) / U), a
    assert np.mean(draws < 999) > 0.9


@pytest.mark.parametrize("training", [False, True])
def test_units_tested_together_match_each_alone_and_the_fixed_test(training: bool) -> None:
    """conflict_units over several units (many sources, rounds cut small; pairs of units sharing one tensor's
    stream) = each unit alone; pairs that ran to B have the fixed 999-draw test's p-value on the same stream, and the null draws are the documented ones."""
    rng = np.random.default_rng(4)
    n, S, U = 48, 8, 5
    src = np.arange(n) % S
    mix = np.eye(S)[src]
    opts = cu.ConflictOptions()
    design = cu.source_design(mix, opts, training)
    means = rng.standard_normal((S, 10))
    means[1] = -means[0]                                        # one conflicting pair
    grams, seeds = [], []
    for u in range(U):
        X = means[src] * (u + 1) / 2 + rng.standard_normal((n, 10))
        grams.append(X @ X.T)
        seeds.append(cu.unit_seed(0, f"t{u // 2}", u % 2 or None, "tensor"))   # units 0, 1 (2, 3): a tensor, a head
    together = cu.conflict_units(grams, mix, opts, training, seeds, design)
    fixed = cu.conflict_units(grams, mix, cu.ConflictOptions(hits=None), training, seeds, design)
    stopped = ran = 0
    for K, seed, (cols, cos, _), (fcols, _, _) in zip(grams, seeds, together, fixed, strict=True):
        rows, cos1, _ = cu.conflict_unit(K, mix, opts, training, seed, design)
        np.testing.assert_array_equal(cos, cos1)
        assert [r["p_value"] for r in rows] == cols["p_value"].tolist()
        full = cols["draws"] == 999
        np.testing.assert_array_equal(cols["p_value"][full], fcols["p_value"][full])
        stopped, ran = stopped + int((~full).sum()), ran + int(full.sum())
        # the draws are the documented stream's first rows: the early p by a direct count over them
        perms = pt.permutations(n, 999, seed, design.block)
        null = pt.permuted_source_grams(K, design.fit.A, design.Q, perms)
        iu, ju = np.triu_indices(S, 1)
        G = (design.Q @ design.fit.A.T @ K @ design.fit.A @ design.Q)
        for k in np.flatnonzero(~full)[:6]:
            t = G[iu[k], ju[k]]
            p, L, _ = _direct(null[:, iu[k], ju[k]], t + 1e-12 * np.abs(np.diagonal(G)).max(), 999, 10)
            assert (cols["p_value"][k], cols["draws"][k]) == (p, L)
    assert stopped > 0 and ran > 0


def test_many_sources_use_bounded_rounds() -> None:
    """200 sources: a round's null statistics stay within SEQUENTIAL_CELLS and the chunks within CHUNK_BYTES."""
    from gradforensics.analysis.toolkit import stats

    seen: list[int] = []
    real = pt.PairNulls.__call__

    def spy(self: pt.PairNulls, active: np.ndarray, size: int) -> np.ndarray:
        out = real(self, active, size)
        seen.append(out.size)
        return out

    rng = np.random.default_rng(5)
    n, S = 404, 200
    mix = np.eye(S)[np.arange(n) % S]
    opts = cu.ConflictOptions(permutations=39)
    design = cu.source_design(mix, opts, False)
    X = rng.standard_normal((n, 12))
    pt.PairNulls.__call__ = spy  # type: ignore[method-assign]
    try:
        (cols, _, _), = cu.conflict_units([X @ X.T], mix, opts, False, [(0, 1)], design)
    finally:
        pt.PairNulls.__call__ = real  # type: ignore[method-assign]
    assert cols["p_value"].size == S * (S - 1) // 2 and np.isfinite(cols["p_value"]).all()
    assert seen and max(seen) <= stats.SEQUENTIAL_CELLS
