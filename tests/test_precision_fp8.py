"""FP8 (E4M3, E5M2) in the precision analysis: ULP oracles, ml_dtypes casts, amax scale, planted store."""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.kinds import precision as P
from gradforensics.analysis.kinds.precision import formats as F
from gradforensics.testing.planted_units import planted_precision_store, run_analysis

ml_dtypes = pytest.importorskip("ml_dtypes")
CAST = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
LIMITS = {"fp8_e4m3": (3, -6, 448.0), "fp8_e5m2": (2, -14, 57344.0)}   # mantissa bits, min normal exp, max


def _cast(x: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(CAST[fmt]).astype(np.float64)


def _direct_ulp(x: np.ndarray, fmt: str) -> np.ndarray:
    """ULP from log2 (not frexp): 2^(max(floor(log2|x|), emin) - p)."""
    p, emin, _ = LIMITS[fmt]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(x)))
    return 2.0 ** (np.maximum(e, emin) - p)


HAND = {  # value -> ULP, by hand from the format definitions
    "fp8_e4m3": {1.0: 2 ** -3, 1.5: 2 ** -3, 0.875: 2 ** -4, 2 ** -6: 2 ** -9, 2 ** -7: 2 ** -9, 2 ** -9: 2 ** -9,
                 3 * 2 ** -9: 2 ** -9, 256.0: 32.0, 448.0: 32.0, 2.0: 2 ** -2, -0.5: 2 ** -4},
    "fp8_e5m2": {1.0: 2 ** -2, 1.25: 2 ** -2, 0.75: 2 ** -3, 2 ** -14: 2 ** -16, 2 ** -15: 2 ** -16,
                 2 ** -16: 2 ** -16, 3 * 2 ** -16: 2 ** -16, 32768.0: 8192.0, 57344.0: 8192.0, -4.0: 1.0},
}


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_format_constants_and_hand_picked_ulps(fmt: str) -> None:
    assert F.FORMATS[fmt] == LIMITS[fmt]
    assert float(ml_dtypes.finfo(CAST[fmt]).max) == LIMITS[fmt][2]
    x = np.array(list(HAND[fmt]))
    np.testing.assert_array_equal(F.ulp(x, fmt), np.array(list(HAND[fmt].values())))
    np.testing.assert_array_equal(F.ulp(x, fmt), _direct_ulp(x, fmt))
    np.testing.assert_array_equal(F.round_to(x, fmt), x)              # all representable


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_round_to_matches_ml_dtypes_casts_including_subnormals_and_overflow(fmt: str) -> None:
    rng = np.random.default_rng(0)
    vmax = LIMITS[fmt][2]
    x = np.concatenate([rng.normal(0, 1, 20000), rng.normal(0, 1e-3, 20000), rng.normal(0, vmax / 2, 5000),
                        2.0 ** np.arange(-20, 17), [0.0, vmax, 1.06 * vmax, 3 * vmax]]).astype(np.float32)
    got, oracle = F.round_to(x, fmt), _cast(x, fmt)
    fin = np.isfinite(oracle)                                          # e4m3fn casts overflow to NaN
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_array_equal(got[fin], oracle[fin])
    fine = (np.abs(x) > 0) & (np.abs(x) <= vmax)
    np.testing.assert_array_equal(F.ulp(x[fine], fmt), _direct_ulp(oracle[fine], fmt))


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_swamped_matches_w_plus_delta_equals_w_in_ml_dtypes(fmt: str) -> None:
    rng = np.random.default_rng(1)
    w = _cast(rng.normal(0, 1, 6000) * 2.0 ** rng.integers(-12, 6, 6000), fmt)   # normals and subnormals
    w = w[np.isfinite(w)]
    half = F.ulp(w, fmt) / 2
    sign = np.where(rng.random(w.size) < 0.5, -1.0, 1.0)
    for factor in (0.3, 0.98, 1.02, 3.0):
        d = (sign * factor * half * rng.uniform(0.9, 1.1, w.size)).astype(np.float32).astype(np.float64)
        oracle = (d != 0) & (_cast(w + d, fmt) == w)
        np.testing.assert_array_equal(F.swamped(w, d, fmt), oracle)


def test_amax_scale_is_the_largest_power_of_two_that_keeps_amax_finite() -> None:
    for fmt, (_, _, vmax) in LIMITS.items():
        for amax in (1.0, 0.05, 3e-7, vmax, vmax / 2, 2.0 ** -20, 1e4, 448.0 / 1.75):
            s = F.amax_scale(amax, fmt)
            assert s == 2.0 ** np.floor(np.log2(vmax / amax))
            assert amax * s <= vmax < 2 * amax * s
    assert F.amax_scale(0.0, "fp8_e4m3") == 1.0


def test_pair_counts_fp8_against_scaled_ml_dtypes_casts() -> None:
    rng = np.random.default_rng(2)
    w0 = rng.normal(0, 0.05, (40, 30)).astype(np.float32)
    d = (w0 * rng.normal(0, 1, w0.shape) * np.where(rng.random(w0.shape) < 0.5, 0.01, 0.5)).astype(np.float32)
    w1 = (w0 + d).astype(np.float32)
    out = F.pair_counts(w0, w1, None, steps=1.0)
    delta = w1.astype(np.float64) - w0
    for fmt, (_, _, vmax) in LIMITS.items():
        s = 2.0 ** np.floor(np.log2(vmax / np.abs(w0).max()))
        wf = _cast(w0 * s, fmt)
        oracle = (delta != 0) & (_cast(wf + delta * s, fmt) == wf)
        assert out[f"swamped_{fmt}"] == int(oracle.sum())
        assert 0 < out[f"swamped_{fmt}"] < out["updated"]


def test_fp8_gradient_shares_against_a_direct_count() -> None:
    rng = np.random.default_rng(3)
    g = (rng.normal(0, 1, 5000) * 2.0 ** rng.integers(-30, 3, 5000)).astype(np.float32)
    g[:10] = 0
    shares = F.fp8_gradient_shares(F.exponent_hist(g), F.finite_amax(g))
    a = np.abs(g[g != 0]).astype(np.float64)
    for fmt, (p, emin, vmax) in LIMITS.items():
        x = a * 2.0 ** np.floor(np.log2(vmax / a.max()))
        assert shares[f"grad_underflow_{fmt}"] == pytest.approx(np.mean(x < 2.0 ** (emin - p)))
        assert shares[f"grad_subnormal_{fmt}"] == pytest.approx(np.mean((x >= 2.0 ** (emin - p)) & (x < 2.0 ** emin)))
        assert shares[f"grad_underflow_{fmt}"] > 0.1
    assert np.isnan(F.fp8_gradient_shares(F.exponent_hist(g), None)["grad_underflow_fp8_e4m3"])


def test_planted_tensor_swamped_in_fp8_but_not_bf16_shows_in_the_table_and_raises_no_flag(tmp_path) -> None:
    # the "sick" tensor's updates are ~1-4 % of |w|: fine in bf16 (half ULP <= 0.4 %), mostly lost in fp8;
    # the others move ~50 % of |w| per step: kept even in fp8
    planted = planted_precision_store(tmp_path / "p.zarr", healthy_rel=0.5, swamped_rel=0.02)
    result, flags = run_analysis(planted.path, "precision")
    t = result.table.set_index("tensor")
    sick, other = planted.sick[0], "layers.0.mlp.up.weight"
    assert t.loc[sick, "swamped_bf16"] < 0.1 and t.loc[sick, "swamped_fp16"] < 0.05
    assert t.loc[sick, "swamped_fp8_e4m3"] > 0.5 and t.loc[sick, "swamped_fp8_e5m2"] > 0.5
    assert t.loc[other, "swamped_fp8_e4m3"] < 0.2 and t.loc[other, "swamped_fp8_e5m2"] < 0.3
    assert (t["swamped_fp8_e5m2"] >= t["swamped_fp8_e4m3"]).all()     # fewer mantissa bits, more lost
    for fmt in LIMITS:
        assert t[f"grad_underflow_{fmt}"].between(0, 1).all() and t[f"grad_subnormal_{fmt}"].between(0, 1).all()
        assert f"swamped_{fmt}/{sick}" in result.series
    assert flags == []                                                  # FP8 is reported, never flagged


def test_fp8_is_not_a_flag_format() -> None:
    from gradforensics.errors import SpecError

    with pytest.raises(SpecError, match="format must be one of"):
        P.PrecisionOptions.parse({"format": "fp8_e4m3"})
