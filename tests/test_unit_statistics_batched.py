"""Issue 28: the shared per-unit paths give the per-unit reference numbers, bit for bit, on random inputs.

What changed for many units (conflict's permutation null with a diagonal ``Q`` taken entry
by entry, its two source Gram matrices from one ``C K``, the tables built from each unit's
records without copying its K again, noise's parts of a whole tensor reused for the whole
model's rows and its outlier medians taken once) is held here against the per-unit
functions they replace, on random Gram matrices of several record counts ``N``, source
counts ``S``, both modes, pure and mixed batches, heads, and units with non-finite
records.  Equality is ``==`` on every float (NaN equal to NaN), never a tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _exact import same

from gradforensics.analysis.contract.model import Context, GramResult
from gradforensics.analysis.kinds import drift as dr
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import units as un
from gradforensics.store.schema import StoreMeta


def _mixture(rng: np.random.Generator, n: int, S: int, pure: bool) -> np.ndarray:
    return np.eye(S)[np.arange(n) % S][rng.permutation(n)] if pure else rng.dirichlet(np.ones(S), n)


def test_source_grams_are_the_two_source_grams() -> None:
    rng = np.random.default_rng(4)
    for trial in range(40):
        n, S = int(rng.integers(4, 90)), int(rng.integers(1, 5))
        fit = ks.fit_sources(_mixture(rng, n, S, trial % 2 == 0))
        X = rng.standard_normal((n, int(rng.integers(1, 40))))
        G, G_db = ks.source_grams(X @ X.T, fit)
        assert np.array_equal(G, ks.source_gram(X @ X.T, fit), equal_nan=True)
        assert np.array_equal(G_db, ks.source_gram(X @ X.T, fit, debias=True), equal_nan=True)


def _context(rng: np.random.Generator, n: int, S: int, mode: str, pure: bool, bad: bool) -> Context:
    """Random Gram matrices of 5 tensors (one in 3 heads, one all but silent), some with non-finite records."""
    mix = _mixture(rng, n, S, pure)
    means = rng.standard_normal((S, 24))
    grams: dict[tuple[str, int | None], GramResult] = {}
    for t in range(5):
        name = f"model.layers.{t}.w.weight"
        X = mix @ means * rng.uniform(0.1, 2.0) + rng.standard_normal((n, 24)) * (1e-3 if t == 4 else 1.0)
        nonfinite = np.zeros(n, np.int64)
        if bad and t in (1, 3):
            nonfinite[rng.choice(n, 2, replace=False)] = 1
            X = np.where(nonfinite[:, None] > 0, 0.0, X)
        parts = [X[:, 8 * h:8 * (h + 1)] for h in range(3)] if t == 2 else []
        for h, Xh in enumerate(parts):
            grams[(name, h)] = GramResult(name, h, Xh @ Xh.T, nonfinite, Xh.shape[1])
        grams[(name, None)] = GramResult(name, None, X @ X.T, nonfinite, X.shape[1])
    batches = {"step": np.arange(n, dtype=np.int64), "loss": np.full(n, np.nan, np.float32),
               "mixture": mix.astype(np.float32), "n_samples": rng.integers(8, 64, n).astype(np.int32)}
    return Context(store=None, meta=StoreMeta(sources=tuple("abcd"[:S]), mode=mode, n_records=n),  # type: ignore[arg-type]
                   batches=batches, grams=grams)


CASES = [(n, S, mode, pure, bad) for n, S, mode, pure, bad in
         [(12, 2, "training", True, False), (32, 2, "replay", True, True), (40, 3, "training", False, True),
          (57, 3, "replay", False, False), (64, 4, "training", True, True), (24, 2, "replay", False, True)]]


@pytest.mark.parametrize("n,S,mode,pure,bad", CASES[:3])
def test_oscillation_and_drift_tables_are_each_units_own_function(n: int, S: int, mode: str, pure: bool,
                                                                  bad: bool) -> None:
    ctx = _context(np.random.default_rng(7 + n), n, S, mode, pure, bad)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    osc_t, drift_t = osc.compute(ctx).table, dr.compute(ctx).table
    units = list(un.units(ctx))
    assert len(osc_t) == len(drift_t) == len(units)
    for u, o, d in zip(units, osc_t.to_dict("records"), drift_t.to_dict("records"), strict=True):
        assert (o["tensor"], un.head_of(o["head"]), o["n_excluded"]) == (u.tensor, u.head, u.n_excluded)
        ks._shared_fit.cache_clear()
        row, _ = osc.oscillation_unit(u.gram, mix[u.records], mode == "replay", osc.OscillationOptions(),
                                      ctx.sources)
        for key, want in row.items():
            assert same(o[key], want), (u.where(), "oscillation", key)
        ks._shared_fit.cache_clear()
        want_d = dr.drift_unit(u.gram, mix[u.records], None).row
        for key in ("cos_early", "cos_late", "cos_late_debiased", "rotation", "rho", "p_value", "rho_windows"):
            assert same(float(d[key]), float(want_d.get(key, math.nan))), (u.where(), "drift", key)
        assert (d["n_excluded"], d["n_records"]) == (u.n_excluded, u.n)
