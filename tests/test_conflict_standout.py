"""When a conflict is a finding (issue 40): a pair that stands out, or a source whose loss stalls.

Oracles: the stand-out of analytic cosine matrices (the planted geometry, a symmetric base rate, one
source apart from two others), the per-source loss levels against NumPy, and planted stores whose
sources all disagree alike (context, below 0.5) until one source's loss stops falling (named).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.kinds.conflict import standout as so
from gradforensics.testing import planted_directions as P


def _cos(pairs: dict[tuple[int, int], float], S: int = 3) -> np.ndarray:
    C = np.eye(S)
    for (a, b), c in pairs.items():
        C[a, b] = C[b, a] = c
    return C


@pytest.mark.parametrize("strength", [1.2, 1.5, 2.0, 3.0])
def test_planted_pair_geometry_stands_out_fully(strength: float) -> None:
    """planted_conflict's means: cos(pair) = (1 - s²)/(1 + s²), each member to the third 1/√(1 + s²)."""
    c, r = (1 - strength**2) / (1 + strength**2), 1 / math.sqrt(1 + strength**2)
    assert so.pair_standout(_cos({(0, 1): c, (0, 2): r, (1, 2): r}), 0, 1) == pytest.approx(1.0, abs=1e-12)
    assert so.pair_standout(_cos({(0, 1): c, (0, 2): r, (1, 2): r}), 0, 2) == 0.0


def test_base_rates_do_not_stand_out() -> None:
    # three sources at 120 degrees: every pair at -0.5
    sym = _cos({(0, 1): -0.5, (0, 2): -0.5, (1, 2): -0.5})
    assert [so.pair_standout(sym, a, b) for a, b in ((0, 1), (0, 2), (1, 2))] == [0.0, 0.0, 0.0]
    # one source apart from two others that agree (a distant domain: the mixture twin's 'records')
    apart = _cos({(0, 1): 0.44, (0, 2): -0.32, (1, 2): -0.32})
    assert [so.pair_standout(apart, a, b) for a, b in ((0, 1), (0, 2), (1, 2))] == [0.0, 0.0, 0.0]
    # two sources only: no "others" to judge against
    assert so.pair_standout(_cos({(0, 1): -0.9}, S=2), 0, 1) == 0.0


def test_a_pair_beyond_a_negative_base_rate() -> None:
    """Four sources at -0.3: a pair at -0.6 is within the base rate's own depth, one at -0.9 is beyond it."""
    for c, want in ((-0.6, 0.0), (-0.75, 0.5), (-0.9, 1.0)):
        C = np.full((4, 4), -0.3)
        np.fill_diagonal(C, 1.0)
        C[0, 1] = C[1, 0] = c
        assert so.pair_standout(C, 0, 1) == pytest.approx(want, abs=1e-12)


def test_source_losses_match_numpy() -> None:
    rng = np.random.default_rng(0)
    n, S = 90, 3
    mix = np.zeros((n, S))
    mix[np.arange(n), rng.integers(S, size=n)] = 1.0
    loss = rng.normal(3.0, 0.4, n)
    loss[5] = np.nan
    got = so.source_losses(loss, mix)
    for k in range(S):
        y = loss[(mix[:, k] == 1) & np.isfinite(loss)]
        m, t = max(3, math.ceil(y.size / 10)), max(3, y.size // 3)
        se = math.sqrt(y[:m].var(ddof=1) / m + y[-t:].var(ddof=1) / t)
        ls = got[k]
        assert ls is not None and ls.n == y.size
        assert ls.early == pytest.approx(y[:m].mean(), abs=1e-12) and ls.late == pytest.approx(y[-t:].mean(), abs=1e-12)
        assert ls.z_fall == pytest.approx((y[:m].mean() - y[-t:].mean()) / se, rel=1e-12)
    assert so.source_losses(loss[:10], mix[:10], min_records=6).count(None) >= 1


def _curves(n: int, flat: int | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Round-robin records of 3 sources; each loss falls 5.5 -> 3 (noise 0.1), source *flat* stays at 5.5."""
    rng = np.random.default_rng(seed)
    mix = P.round_robin(n, 3).astype(np.float64)
    t = np.arange(n) / n
    loss = 3.0 + 2.5 * np.exp(-5 * t) + rng.normal(0, 0.1, n)
    if flat is not None:
        rows = mix[:, flat] == 1
        loss[rows] = 5.5 + rng.normal(0, 0.1, rows.sum())
    return loss, mix


def test_loss_stall_names_the_source_that_does_not_learn() -> None:
    loss, mix = _curves(150, flat=2)
    q = so.loss_stall(so.source_losses(loss, mix))
    assert q[2] == pytest.approx(1.0) and q[0] == 0.0 and q[1] == 0.0
    loss, mix = _curves(150, flat=None)                 # every source learns: nothing stalls
    assert (so.loss_stall(so.source_losses(loss, mix)) == 0).all()
    flat = np.full(150, 5.5) + np.random.default_rng(1).normal(0, 0.1, 150)   # nothing learns: no "others fall"
    assert (so.loss_stall(so.source_losses(flat, mix)) == 0).all()


def _apart(seed: int = 0, n: int = 150) -> P.Planted:
    """Three sources whose mean gradients in every unit are three unit vectors at 120 degrees (pairwise
    cos -0.5, the base rate of a mixture of different domains), training mode, round-robin batches."""
    rng = np.random.default_rng([seed, 90])
    A = P.round_robin(n, 3)
    means = {}
    for tensor, heads in ((P.q_name(0), P.HEADS), (P.mlp_name(0), 0)):
        for head in [None] if not heads else list(range(heads)):
            d = P._unit_dim(tensor)
            u = rng.standard_normal(d)
            v = P._orthogonal_to(rng, u)
            u, v = u / np.linalg.norm(u), v / np.linalg.norm(v)
            dirs = np.stack([np.cos(a) * u + np.sin(a) * v for a in (0, 2 * np.pi / 3, 4 * np.pi / 3)])
            means[(tensor, head)] = 2.0 * (A.astype(np.float64) @ dirs) * math.sqrt(d)
    grads = P._model(rng, n, 1, 1.0, 0.0, means)
    return P.Planted(grads, P._heads(1), A, ("a", "b", "c"), "training", {})


def test_a_symmetric_base_rate_is_context_until_a_source_stalls() -> None:
    p = _apart()
    ctx = p.context()
    loss, _ = _curves(p.n, flat=None)
    ctx.batches["loss"] = loss.astype(np.float32)
    res = cf.compute(ctx)
    t = res.table
    assert (t.cosine_debiased < -0.3).all()             # strongly negative, significant, but the base rate
    assert 0.3 < t.severity.max() <= so.CONTEXT
    assert all("Context" in f.summary for f in cf.flags(res, ctx))

    loss, _ = _curves(p.n, flat=2)                      # source c stops learning
    ctx.batches["loss"] = loss.astype(np.float32)
    res = cf.compute(ctx)
    loud = [f for f in cf.flags(res, ctx) if f.severity >= 0.5]
    assert loud and all("c" in f.sources and f.evidence["named"] == ["c"] for f in loud)
    assert all("'c' stands out" in f.summary for f in loud)
    assert (res.table[res.table.source_b != "c"].severity <= so.CONTEXT).all()   # the a-b pair stays context


def test_planted_pair_is_named_as_a_pair() -> None:
    ctx = P.planted_conflict(seed=0).context()
    res = cf.compute(ctx)
    loud = [f for f in cf.flags(res, ctx) if f.severity >= 0.5]
    assert loud and all(f.evidence["why"] == "pair" and set(f.evidence["named"]) == {"zh", "en"} for f in loud)


def _two_sources(n: int, late_scale: float, c_norm: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """Noise-free records of sources a, b (alternating): the shared unit mean m until n/2, then
    ``late_scale·(m' ± c)`` with |m'| = 1, |c| = c_norm, m' ⟂ c; returns K, mixture, the exact rise."""
    rng = np.random.default_rng(seed)
    m, m2, c = np.linalg.qr(rng.standard_normal((16, 3)))[0].T
    src = np.arange(n) % 2
    X = np.where((np.arange(n) < n // 2)[:, None], m[None, :],
                 late_scale * (m2[None, :] + np.where(src == 0, 1.0, -1.0)[:, None] * c_norm * c[None, :]))
    want = -late_scale**2 * (1 - c_norm**2)             # -G_ab(late) / sqrt(G_aa G_bb)(early), |m| = 1
    return X @ X.T, np.eye(2)[src], want


@pytest.mark.parametrize(("late_scale", "c_norm"), [(1.0, 3.0), (0.3, 1.5), (0.5, 0.5)])
def test_rise_matches_the_exact_inner_products(late_scale: float, c_norm: float) -> None:
    K, mix, want = _two_sources(64, late_scale, c_norm)
    assert so.rise(K, mix, 0, 1) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_falling_cosine_of_shrinking_gradients_is_no_rise() -> None:
    """cos +1 early, (1 - 2.25)/(1 + 2.25) = -0.38 late, but the late gradients are 0.3 of the early ones."""
    K, mix, want = _two_sources(64, 0.3, 1.5)
    assert want < 1 and so.rise(K, mix, 0, 1) < 1


def test_two_source_conflict_that_appears_mid_run_is_a_rise() -> None:
    """planted_long's conflict tensor (cos +1 -> -0.8 at half the run, |c| = 3|m|) in a two-source store."""
    from gradforensics.testing.planted_long import CONFLICT, long_history_arrays

    g, src, _ = long_history_arrays(400, seed=0)
    X = g[CONFLICT].astype(np.float64)
    assert so.rise(X @ X.T, np.eye(2)[src], 0, 1) > 5


def test_pair_standouts_of_a_unit_match_the_definition_pair_by_pair() -> None:
    """The vectorised stand-out of every pair of a unit (some sources absent) against the module's definition,
    a loop over the third sources with both cosines finite."""
    rng = np.random.default_rng(0)
    S = 9
    C = rng.uniform(-1, 1, (S, S))
    C = (C + C.T) / 2
    C[[2, 5], :] = np.nan
    C[:, [2, 5]] = np.nan
    C[3, 7] = C[7, 3] = np.nan
    a, b = np.triu_indices(S, 1)
    got = so.pair_standouts(C, a, b)
    for x, y, g in zip(a, b, got, strict=True):
        rest = [t for t in range(S) if t not in (x, y) and np.isfinite(C[x, t]) and np.isfinite(C[y, t])]
        if not rest or not np.isfinite(C[x, y]):
            assert g == 0.0
            continue
        r = min(np.mean(C[x, rest]), np.mean(C[y, rest]))
        assert g == pytest.approx(float(np.clip((r - C[x, y] - max(0.0, -r)) / so.PAIR_FULL, 0, 1)), abs=1e-12)
    assert (got > 0).sum() > 3
