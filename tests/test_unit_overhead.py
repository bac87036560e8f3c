"""Issue 28: the per-unit overhead taken out of oscillation, drift and noise gives the old floats, bit for bit.

Each replacement is held with ``==`` (NaN equal to NaN), never a tolerance, against the call it
replaces, written out here or called where it still lives: SciPy's ``eigh`` against the direct
``dsyevr`` call (:func:`~gradforensics.analysis.toolkit.stacked.eigh_top`), ``kspace.top_components``
against oscillation's, the units' whole-record copy against the two takes, on random matrices of many
sizes and scales and the edge cases (constant, zero, rank one, tiny and huge entries, NaN and inf, which
go to SciPy's own error).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.linalg import eigh

from gradforensics.analysis.kinds import oscillation as osc
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit import stacked as st
from gradforensics.analysis.toolkit import units as un
from gradforensics.testing import planted_directions as P

SIZES = [1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64, 96, 127, 128, 129, 200, 257]


def _same(a: object, b: object) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def _grams(seed: int, trials: int):
    """Random symmetric matrices (Gram matrices, centred, or plain symmetric) of many sizes and scales."""
    rng = np.random.default_rng(seed)
    for t in range(trials):
        n = SIZES[t % len(SIZES)]
        X = rng.standard_normal((n, int(rng.integers(1, 2 * n + 2)))) * 10.0 ** rng.integers(-150, 150)
        kind = t % 3
        K = X @ X.T if kind == 0 else ks.centred(X @ X.T) if kind == 1 else X[:, :n] if X.shape[1] >= n else X @ X.T
        yield rng, (K + K.T) / 2.0


def _edge_cases():
    for n in (1, 2, 3, 8, 33, 128):
        yield np.zeros((n, n))
        yield np.full((n, n), 3.0)
        v = np.arange(1.0, n + 1)
        yield np.outer(v, v)                                   # rank one
        yield np.eye(n) * 1e-300
        yield np.eye(n) * 1e300
        yield ks.centred(np.full((n, n), 2.0))


def test_eigh_top_is_scipys_eigh() -> None:
    cases = [(rng, S) for rng, S in _grams(0, 144)]
    for rng, S in cases:
        n = S.shape[0]
        for k in {1, min(3, n), *((n, int(rng.integers(1, n + 1))) if n <= 64 else ())}:   # every k: small n
            got, want = st.eigh_top(S, k), eigh(S, subset_by_index=(n - k, n - 1))
            assert _same(got[0], want[0]) and _same(got[1], want[1]), (n, k)
            assert got[1].flags.f_contiguous == want[1].flags.f_contiguous
    for S in _edge_cases():
        n = S.shape[0]
        for k in {1, min(3, n), n}:
            got, want = st.eigh_top(S, k), eigh(S, subset_by_index=(n - k, n - 1))
            assert _same(got[0], want[0]) and _same(got[1], want[1]), (n, k)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_eigh_top_refuses_non_finite_as_scipy_does(bad: float) -> None:
    S = np.eye(9)
    S[2, 4] = S[4, 2] = bad
    with pytest.raises(ValueError) as want:
        eigh(S, subset_by_index=(6, 8))
    with pytest.raises(ValueError) as got:
        st.eigh_top(S, 3)
    assert str(got.value) == str(want.value)
    huge = np.full((9, 9), 1e308)                 # finite entries whose sum overflows: SciPy's call, its floats
    w, v = st.eigh_top(huge, 2)
    ref = eigh(huge, subset_by_index=(7, 8))
    assert _same(w, ref[0]) and _same(v, ref[1])


def test_top_components_is_kspace_top_components() -> None:
    for _, S in _grams(1, 120):
        n = S.shape[0]
        for k in (1, 3, 5, n + 2) if n <= 64 else (1, 3):
            got, want = osc.top_components(S, k), ks.top_components(S, k)
            assert _same(got[0], want[0]) and _same(got[1], want[1]), (n, k)
    for S in _edge_cases():
        got, want = osc.top_components(S, 3), ks.top_components(S, 3)
        assert _same(got[0], want[0]) and _same(got[1], want[1])
    rng = np.random.default_rng(5)                 # the Lanczos size: kspace's own call
    X = rng.standard_normal((ks.LANCZOS_MIN, 40))
    K = ks.centred(X @ X.T)
    got, want = osc.top_components(K, 3), ks.top_components(K, 3)
    assert _same(got[0], want[0]) and _same(got[1], want[1])


def _take_reference(ctx):
    """Every unit's restricted K as the two takes made it."""
    order = un.time_order(ctx.batches, ctx.n_records)
    for u in un.units(ctx):
        g = ctx.grams.get((u.tensor, u.head))
        if g is None:
            continue
        K = np.asarray(g.gram, dtype=np.float64)
        keep = un._kept(g, order)
        yield u, K.take(keep, axis=0).take(keep, axis=1)


@pytest.mark.parametrize("nonfinite", [False, True])
def test_units_gram_is_the_takes(nonfinite: bool) -> None:
    """A unit of every record in store order is copied whole; one with excluded records (or records out of
    time order) still taken: both the takes' floats, C-ordered float64, writeable, not the engine's array."""
    p = P.planted_conflict(seed=3, n=40, n_layers=2, where={P.q_name(1): (1, 2)}, mode="training")
    if nonfinite:
        p = P.with_nonfinite(p, P.q_name(0), [3, 17])
    ctx = p.context()
    seen = 0
    for u, want in _take_reference(ctx):
        assert u.gram.dtype == want.dtype and u.gram.shape == want.shape and _same(u.gram, want)
        assert u.gram.flags.c_contiguous and u.gram.flags.writeable
        assert not np.shares_memory(u.gram, np.asarray(ctx.grams[(u.tensor, u.head)].gram))
        seen += 1
    assert seen > 0
    whole = [u.n == ctx.n_records for u in un.units(ctx)]
    assert all(whole) != nonfinite


def test_units_out_of_time_order_are_taken() -> None:
    """Records whose steps are not in store order: the identity shortcut must not apply."""
    p = P.planted_drift(seed=4, n=48)
    ctx = p.context()
    step = np.asarray(ctx.batches["step"]).copy()
    step[[5, 6]] = step[[6, 5]]
    ctx.batches["step"] = step
    for u, want in _take_reference(ctx):
        assert _same(u.gram, want)
        assert not np.array_equal(u.records, np.arange(u.n))


def _stack_cases(seed: int, trials: int):
    """Stacks of Gram matrices (and plain symmetric ones) with row sets of many sizes, with the edge cases
    (zero, constant, NaN and inf entries, tiny and huge scales) among the items."""
    rng = np.random.default_rng(seed)
    for t in range(trials):
        n = int(rng.choice([4, 5, 8, 9, 16, 17, 33, 64, 128]))
        m = int(rng.integers(1, 7))
        X = rng.standard_normal((m, n, int(rng.integers(1, 3 * n)))) * 10.0 ** rng.integers(-150, 150)
        Ks = np.matmul(X, X.transpose(0, 2, 1))
        if t % 4 == 1:
            Ks[0] = 0.0
        if t % 4 == 2:
            Ks[-1] = 7.5
        if t % 5 == 3:
            Ks[0, int(rng.integers(n)), int(rng.integers(n))] = rng.choice([np.nan, np.inf, -np.inf])
        w = int(rng.integers(1, n))
        rows = np.sort(rng.choice(n, size=w, replace=False))
        other = np.setdiff1d(np.arange(n), rows)
        if other.size == 0:
            other = rows[:1]
        other = other[: int(rng.integers(1, other.size + 1))]
        yield np.ascontiguousarray(Ks), rows, other


def test_drift_stacked_blocks_are_the_single_calls() -> None:
    """The opening records' leave-one-out cosines and the debiased cosine over a stack against
    ``drift._opening_fix`` and ``kspace.debiased_cosine`` item by item, ``==``."""
    from gradforensics.analysis.kinds import drift as dr

    raised = ok = 0
    with np.errstate(all="ignore"):
        for Ks, rows, other in _stack_cases(7, 400):
            n = Ks.shape[1]
            base = np.random.default_rng(n).standard_normal((Ks.shape[0], n))
            got = dr._opening_fix_each(Ks, rows, base.copy())
            for j, K in enumerate(Ks):
                assert _same(got[j], dr._opening_fix(K, rows, base[j].copy())), (n, rows.size)
            wants = []
            for K in Ks:
                try:
                    wants.append(ks.debiased_cosine(K, other, rows))
                except ZeroDivisionError:    # U-statistics whose product underflows: the single call raises
                    wants.append(None)
            if any(w is None for w in wants):
                with pytest.raises(ZeroDivisionError):
                    dr._debiased_each(Ks, other, rows)
                raised += 1
                continue
            got_db = dr._debiased_each(Ks, other, rows)
            assert all(_same(g, w) for g, w in zip(got_db, wants, strict=True)), (n, rows.size, other.size)
            ok += 1
    assert raised > 0 and ok > 300


def test_blocks_are_kspace_block() -> None:
    """Evenly spaced rows (every record, an opening window, a round-robin source) as a slice's copy, others as
    the takes: ``kspace.block``'s floats, shape, dtype and C order, item by item of a stack too."""
    rng = np.random.default_rng(11)
    seen_slice = 0
    for t in range(300):
        n = int(rng.integers(1, 40))
        K = rng.standard_normal((n, n)) * 10.0 ** rng.integers(-300, 300)
        if t % 7 == 0:
            K[int(rng.integers(n)), int(rng.integers(n))] = rng.choice([np.nan, np.inf])
        kind = t % 5
        if kind == 0:
            rows = np.arange(n)
        elif kind == 1:
            rows = np.arange(int(rng.integers(n)), n, int(rng.integers(1, 4)))
        elif kind == 2:
            rows = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False))
        elif kind == 3:
            rows = rng.permutation(n)[: int(rng.integers(1, n + 1))]
        else:
            rows = np.arange(n)[::-1][: int(rng.integers(1, n + 1))]
        cols = None if t % 2 else np.arange(0, n, int(rng.integers(1, 3)))
        got, want = st.block(K, rows, cols), ks.block(K, rows, cols)
        assert got.shape == want.shape and got.dtype == want.dtype and got.flags.c_contiguous
        assert _same(got, want) and not np.shares_memory(got, K)
        seen_slice += st._as_slice(rows) is not None
        Ks = np.stack([K, K * 3.0, -K])
        stack = st.blocks_each(Ks, rows, cols)
        assert stack.flags.c_contiguous
        assert all(_same(b, ks.block(k, rows, cols)) for b, k in zip(stack, Ks, strict=True))
    assert seen_slice > 100
    for bad in (np.array([0, 5]), np.array([-1, 0])):      # out of range / negative: the takes' own behaviour
        K = np.arange(16.0).reshape(4, 4)
        try:
            want = ks.block(K, bad)
        except IndexError:
            with pytest.raises(IndexError):
                st.block(K, bad)
        else:
            assert _same(st.block(K, bad), want)
    assert st.block(np.eye(3), np.zeros(0, np.int64)).shape == ks.block(np.eye(3), np.zeros(0, np.int64)).shape


class _Counting(dict):
    """``ctx.grams`` that counts its reads (``[]`` and ``get``)."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().__getitem__(key)

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().get(key, default)


@pytest.mark.parametrize("mode,nonfinite", [("training", False), ("replay", False), ("training", True),
                                             ("replay", True)])
def test_noise_flags_read_no_gram_again_and_flag_the_same(mode: str, nonfinite: bool) -> None:
    """The feature counts the table's pass saw (``table.attrs``) against the Gram results read again (a table
    without them, or with unreadable ones, as one read back from a store): the same flags; with them no Gram
    result is read; the model's rows read each whole tensor once."""
    import dataclasses

    from gradforensics.analysis.contract.model import AnalysisResult
    from gradforensics.analysis.kinds import noise as nz
    from gradforensics.analysis.kinds.noise.findings import flags
    from gradforensics.analysis.kinds.noise.table import MODEL, N_FEATURES

    p = P.planted_conflict(seed=5, n=48, n_layers=3, where={P.q_name(1): (1, 2)}, mode=mode)
    if nonfinite:
        p = P.with_nonfinite(p, P.q_name(2), [4, 9])
    base = p.context()
    counting = _Counting(base.grams)
    ctx = dataclasses.replace(base, grams=counting)
    _Counting.reads = 0
    res = nz.compute(ctx)
    whole = [k for k in base.grams if k[1] is None]
    if nonfinite:       # the whole tensors with other usable records than the model's are estimated again
        assert len(base.grams) < _Counting.reads < len(base.grams) + len(whole)
    else:               # each unit once: the model's rows read nothing again (before: every whole tensor twice)
        assert _Counting.reads == len(base.grams)
    raw = np.frombuffer(bytes.fromhex(res.table.attrs[N_FEATURES]), dtype=np.float64)
    json.dumps(res.table.attrs)                          # a table written with its attrs still writes
    recs = res.table.to_dict("records")
    assert raw.size == len(recs)
    for r, v in zip(recs, raw, strict=True):
        if r["tensor"] == MODEL:
            assert np.isnan(v)
        else:
            key = (r["tensor"], un.head_of(r["head"]))
            assert v == float(base.grams[key].n_features) > 0
    _Counting.reads = 0
    got = flags(res, ctx)
    assert _Counting.reads == 0
    bare = AnalysisResult(table=res.table.copy())
    bare.table.attrs.clear()
    want = flags(bare, ctx)
    assert _Counting.reads > 0
    assert [repr(f) for f in got] == [repr(f) for f in want]
    odd = AnalysisResult(table=res.table.copy())
    odd.table.attrs[N_FEATURES] = "zz" * 8 * len(recs)         # not hex: ignored, the Gram results read instead
    assert [repr(f) for f in flags(odd, ctx)] == [repr(f) for f in want]


def test_centred_is_kspace_centred() -> None:
    """Oscillation's centring against ``kspace.centred``: random Gram matrices of many sizes and scales, the
    edge cases, NaN and inf entries, non-contiguous and float32 inputs (the latter two: kspace's own call)."""
    from gradforensics.analysis.toolkit import oscillationstats as ost

    with np.errstate(all="ignore"):
        for _, S in _grams(3, 150):
            assert _same(ost.centred(S), ks.centred(S))
            assert _same(ost.centred(S[::-1]), ks.centred(S[::-1]))
        for S in _edge_cases():
            assert _same(ost.centred(S), ks.centred(S))
        rng = np.random.default_rng(9)
        for n in (1, 2, 8, 33, 128):
            K = rng.standard_normal((n, n))
            K[int(rng.integers(n)), int(rng.integers(n))] = rng.choice([np.nan, np.inf, -np.inf])
            assert _same(ost.centred(K), ks.centred(K))
            assert _same(ost.centred(K.astype(np.float32)), ks.centred(K.astype(np.float32)))
        K = np.full((4, 4), 1e308)
        assert _same(ost.centred(K), ks.centred(K))        # overflowing sums: inf and NaN alike


def test_drift_nan_to_num_is_numpys() -> None:
    from gradforensics.analysis.kinds import drift as dr

    rng = np.random.default_rng(13)
    for _t in range(200):
        c = rng.uniform(-1.0, 1.0, int(rng.integers(1, 12)))
        for _ in range(int(rng.integers(0, 4))):
            c[int(rng.integers(c.size))] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e308])
        got, want = dr._nan_to_num(c, -2.0), np.nan_to_num(c, nan=-2.0)
        assert got.tobytes() == want.tobytes() and not np.shares_memory(got, c)
        assert np.array_equal(np.argsort(-got), np.argsort(-want))


def test_syevr_top_in_place_is_scipys_eigh() -> None:
    """Oscillation's in-place call (``S.T`` of an exactly symmetric ``S``, LAPACK working in it) and the means it
    divides itself: SciPy's ``eigh`` and ``mean``'s floats."""
    from gradforensics.analysis.toolkit import oscillationstats as ost

    for _, S in _grams(4, 60):
        n = S.shape[0]
        for k in (1, min(3, n)):
            want = eigh(S, subset_by_index=(n - k, n - 1))
            spent = S.copy()
            got = st.syevr_top(spent.T, k, overwrite=True)
            assert got is not None and _same(got[0], want[0]) and _same(got[1], want[1]), (n, k)
        x = S.ravel()
        assert _same(ost._mean(x), x.mean()) and _same(ost._mean(x[::3]), x[::3].mean())
    bad = np.eye(5)
    bad[1, 1] = np.nan
    assert st.syevr_top(bad.T, 2, overwrite=True) is None and np.isnan(bad[1, 1])     # refused before LAPACK
