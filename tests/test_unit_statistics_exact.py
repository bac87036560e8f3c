"""Issue 28: the shared and re-laid-out per-unit paths give the per-unit reference numbers, bit for bit.

``compute`` of conflict, oscillation and drift shares what depends on the records alone
(one source fit and design per distinct record set, one periodogram design and window
set per length) and gathers conflict's permuted mixtures with ``np.take``.  The
oracles: the fancy-indexed gather the permutation test used before (written out here),
:func:`~gradforensics.analysis.toolkit.kspace.fit_sources` run afresh for every unit,
and ``K[np.ix_(rows, cols)]``.  Equality is ``==`` on every float, not a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from _exact import same

from gradforensics.analysis.kinds import drift as dr
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import units as un
from gradforensics.testing import planted_directions as P


def test_shared_fit_and_block_are_their_references() -> None:
    rng = np.random.default_rng(3)
    A = rng.dirichlet(np.ones(3), 40)
    A[:, 2] = 0.0                                    # an absent source is dropped, as fit_sources does
    A /= A.sum(axis=1, keepdims=True)
    fit, ref = ks.shared_fit(A), ks.fit_sources(A)
    assert ks.shared_fit(A.copy()) is fit            # the same rows: the one fit
    for name in ("A", "C", "index", "weight"):
        assert np.array_equal(getattr(fit, name), getattr(ref, name))
        assert not getattr(fit, name).flags.writeable
    assert fit.rank_ok == ref.rank_ok and np.array_equal(fit.hat, ref.A @ ref.C)
    K = rng.standard_normal((40, 40))
    rows, cols = rng.permutation(40)[:17], rng.permutation(40)[:9]
    assert np.array_equal(ks.block(K, rows, cols), K[np.ix_(rows, cols)])
    assert np.array_equal(ks.block(K, rows), K[np.ix_(rows, rows)])
    for n, w in ((64, 4), (37, 5), (3, 4)):
        W, rows_of = dr._windows(n, w)
        ref_w = ks.window_coefficients(n, w)
        assert np.array_equal(W, ref_w)
        assert all(np.array_equal(r, np.flatnonzero(ref_w[i] > 0)) for i, r in enumerate(rows_of))


def _context(mode: str):
    p = P.planted_conflict(seed=2, n=40, n_layers=2, where={P.q_name(1): (1, 2)}, mode=mode)
    p = P.with_nonfinite(p, P.q_name(0), [3, 17])       # a tensor with other records: two record sets
    return p.context()


def _units_afresh(ctx):
    """Every unit with the source fits forgotten before it: its own per-unit arithmetic."""
    for u in un.units(ctx):
        ks._shared_fit.cache_clear()
        yield u


@pytest.mark.parametrize("mode", ["training", "replay"])
def test_oscillation_and_drift_tables_are_the_per_unit_reference(mode: str) -> None:
    ctx = _context(mode)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    osc_t, drift_t = osc.compute(ctx).table, dr.compute(ctx).table
    units = list(_units_afresh(ctx))
    assert len(osc_t) == len(drift_t) == len(units)
    for u, o, d in zip(_units_afresh(ctx), osc_t.to_dict("records"), drift_t.to_dict("records"), strict=True):
        row, _ = osc.oscillation_unit(u.gram, mix[u.records], mode == "replay", osc.OscillationOptions(), ctx.sources)
        for key, want in row.items():
            assert same(o[key], want), (u.where(), "oscillation", key)
        ks._shared_fit.cache_clear()
        want_d = dr.drift_unit(u.gram, mix[u.records], None).row
        for key in ("cos_early", "cos_late", "cos_late_debiased", "rotation", "rho", "p_value", "rho_windows",
                    "aligned_cosine"):
            assert same(float(d[key]), float(want_d[key])), (u.where(), "drift", key)
