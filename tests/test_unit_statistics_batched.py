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
from _exact import reference_null, same

from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import Context
from gradforensics.analysis.kinds import conflict as cf
from gradforensics.analysis.kinds import drift as dr
from gradforensics.analysis.kinds import noise as nz
from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import noisescale as nsc
from gradforensics.analysis.toolkit import permtest as pt
from gradforensics.analysis.toolkit import units as un
from gradforensics.store.schema import StoreMeta


def _mixture(rng: np.random.Generator, n: int, S: int, pure: bool) -> np.ndarray:
    return np.eye(S)[np.arange(n) % S][rng.permutation(n)] if pure else rng.dirichlet(np.ones(S), n)


@pytest.mark.parametrize("pure", [True, False])
def test_permutation_null_is_the_reference(pure: bool) -> None:
    """The diagonal-``Q`` shortcut (pure batches) and the general path give the reference null, also with
    a non-finite K (then the shortcut is not taken: ``0 · inf`` is NaN in the products)."""
    rng = np.random.default_rng(11 if pure else 12)
    shortcut = 0
    for trial in range(30):
        n, S, B = int(rng.integers(6, 150)), int(rng.integers(2, 5)), int(rng.integers(19, 300))
        A = _mixture(rng, n, S, pure)
        Q = np.linalg.pinv(A.T @ A)
        X = rng.standard_normal((n, int(rng.integers(2, 60)))) * 10.0 ** rng.integers(-3, 4)
        K = X @ X.T
        if trial % 6 == 5:
            K[1, 2] = K[2, 1] = (np.inf, np.nan)[trial % 2]
        shortcut += int(np.count_nonzero(Q) == S and np.isfinite(K).all())
        perms = pt.permutations(n, B, (trial, 3), None if trial % 3 == 0 else int(rng.integers(2, 12)))
        chunk = (128, 37, 1)[trial % 3]
        with np.errstate(invalid="ignore"):
            got, want = pt.permuted_source_grams(K, A, Q, perms, chunk), reference_null(K, A, Q, perms, chunk)
        assert np.array_equal(got, want, equal_nan=True), trial
    assert (shortcut > 20) == pure                       # pure batches took the shortcut, mixed ones never


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


@pytest.mark.parametrize("n,S,mode,pure,bad", CASES)
def test_conflict_table_is_each_units_own_function(n: int, S: int, mode: str, pure: bool, bad: bool) -> None:
    ctx = _context(np.random.default_rng(n * S), n, S, mode, pure, bad)
    res = cf.compute(ctx)
    opts, mix = cf.ConflictOptions(), np.asarray(ctx.batches["mixture"], dtype=np.float64)
    ref, cosm = [], []
    for u in un.units(ctx):
        ks._shared_fit.cache_clear()
        rows, cos, idx = cf.conflict_unit(u.gram, mix[u.records], opts, mode == "training",
                                          cf.unit_seed(opts.seed, u.tensor, u.head))
        ref += [(u, float(np.mean(np.diag(u.gram))), r) for r in rows]
        if cos is not None:
            full = np.full((S, S), np.nan)
            full[np.ix_(idx, idx)] = cos
            cosm.append(full)
    assert len(ref) == len(res.table) > 0
    for (u, energy, r), got in zip(ref, res.table.itertuples(index=False), strict=True):
        assert (got.tensor, un.head_of(got.head), got.n_records, got.n_excluded) == (u.tensor, u.head, u.n,
                                                                                     u.n_excluded)
        assert same(float(got.energy), energy)
        for key in ("cosine", "p_value", "cosine_debiased", "z", "z_cross", "n_a", "n_b"):
            assert same(float(getattr(got, key)), r[key]), (u.where(), key)
    assert np.array_equal(res.series["cosine_matrix"], np.stack(cosm), equal_nan=True)


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


def _reference_noise_table(ctx: Context) -> list[dict]:
    """noise.csv as the first version built it: the model's parts estimated again on the common records."""
    d = nz.design(np.asarray(ctx.batches["n_samples"]), ctx.batches.get("mixture"), ctx.source_of_record(),
                  ctx.sources, ctx.meta.mode)
    rows = nz.model_rows(ctx.grams, d)                                  # no parts handed over: all estimated
    for key in sorted(ctx.grams, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        rows += nz.noise_rows(ctx.grams[key], d)[0]
    return rows


def _reference_outliers(rows: list[dict], opts: nz.NoiseOptions) -> dict[int, float]:
    """noise's outlier rule with the robust z and the peers' median taken row by row (the first version)."""
    levels = np.array([nz._level(r) for r in rows])
    if np.isfinite(levels).sum() < 3:
        return {}
    ref = math.exp(float(np.median(levels[np.isfinite(levels)])))
    excess = nz._noise_excess(rows, None)
    out = {}
    for r in rows:
        hi = nz._upper(r)
        if r["n"] < opts.min_records or not math.isfinite(hi) or not excess.get(id(r), math.inf) >= \
                math.log(opts.outlier_ratio):
            continue
        sev = nz.severity(float(r["snr"]), hi, ref, opts.outlier_ratio,
                          float(nsc.robust_z(levels, math.log(max(hi, 1e-12)))), opts.outlier_z)
        if sev > 0:
            out[id(r)] = sev
    return out


@pytest.mark.parametrize("n,S,mode,pure,bad", CASES)
def test_noise_table_and_outliers_are_the_reference(n: int, S: int, mode: str, pure: bool, bad: bool) -> None:
    ctx = _context(np.random.default_rng(100 + n), n, S, mode, pure, bad)
    got = nz.compute(ctx).table.to_dict("records")
    want = _reference_noise_table(ctx)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        for key, v in w.items():
            assert same(un.head_of(g[key]) if key == "head" else g[key], v), (w["tensor"], w["source"], key)
    rows = [dict(r) for r in want if r["source"] == "" and r["tensor"] != nz.MODEL]
    for r in rows:                                      # a quiet tensor and ordinary ones: some pass the noise rule
        r["trace_sigma"] = float(r["trace_sigma"]) * (40.0 if r["tensor"].endswith("4.w.weight") else 1.0)
    opts = nz.NoiseOptions(outlier_z=0.5, outlier_ratio=1.01)
    got_o, want_o = nz._outliers(rows, opts), _reference_outliers(rows, opts)
    assert got_o == want_o and want_o          # some rows flagged: the rule ran, not only its early exits
