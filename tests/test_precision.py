"""Precision floor: rounding oracles against ml_dtypes casts, and planted swamped updates."""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.analysis.kinds import precision as P
from gradforensics.analysis.kinds.precision import formats as F
from gradforensics.errors import SpecError
from gradforensics.testing.contracts import AnalysisContract
from gradforensics.testing.planted_units import planted_precision_store, run_analysis

ml_dtypes = pytest.importorskip("ml_dtypes")
CAST = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def _cast(x: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(CAST[fmt]).astype(np.float64)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_round_to_matches_a_direct_cast(fmt: str) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, 20000), rng.normal(0, 1e-3, 20000), 2.0 ** np.arange(-20, 12),
                        [0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 65504.0, 65519.0]]).astype(np.float32)
    x = x[np.abs(x) < 60000] if fmt == "fp16" else x
    np.testing.assert_array_equal(F.round_to(x, fmt), _cast(x, fmt))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_swamped_matches_a_direct_cast_on_both_sides_of_the_half_ulp_line(fmt: str) -> None:
    rng = np.random.default_rng(1)
    w = _cast(rng.normal(0, 0.05, 4000) * np.where(rng.random(4000) < 0.1, 1e-2, 1.0), fmt)
    w = w[w != 0]
    half = F.ulp(w, fmt) / 2
    sign = np.where(rng.random(w.size) < 0.5, -1.0, 1.0)
    for factor, expect_lost in ((0.98, True), (1.02, False), (0.3, True), (3.0, False)):
        d = (sign * factor * half).astype(np.float32).astype(np.float64)
        oracle = _cast(w + d, fmt) == w
        got = F.swamped(w, d, fmt)
        np.testing.assert_array_equal(got, oracle)
        # away from a power of two the line is exactly half an ULP either way
        inside = np.abs(np.frexp(w)[0]) > 0.5
        assert np.all(got[inside] == expect_lost)


def test_downward_step_at_a_power_of_two_uses_the_finer_spacing() -> None:
    w = np.array([1.0])                   # bf16 spacing above 1 is 2^-7, below it 2^-8
    assert not F.swamped(w, np.array([-0.6 * 2.0 ** -8]), "bf16")[0]
    assert F.swamped(w, np.array([+0.6 * 2.0 ** -8]), "bf16")[0]
    assert bool(_cast(w - 0.6 * 2.0 ** -8, "bf16")[0] != 1.0)


def test_pair_counts_against_numpy() -> None:
    rng = np.random.default_rng(2)
    w0 = rng.normal(0, 0.05, (40, 30)).astype(np.float32)
    d = (rng.normal(0, 1, w0.shape) * np.where(rng.random(w0.shape) < 0.5, 1e-6, 1e-3)).astype(np.float32)
    d[:5] = 0
    w1 = (w0 + d).astype(np.float32)
    g = rng.normal(size=w0.shape) != 0
    out = F.pair_counts(w0, w1, g, steps=1.0)
    delta = w1.astype(np.float64) - w0
    assert out["updated"] == int((delta != 0).sum())
    for fmt in ("bf16", "fp16"):
        oracle = (delta != 0) & (_cast(_cast(w0, fmt) + delta, fmt) == _cast(w0, fmt))
        assert out[f"swamped_{fmt}"] == int(oracle.sum())
    assert out["lost"] == int((g & (delta == 0)).sum()) == 5 * 30
    assert out["ulp_hist"].sum() == out["updated"]


def test_fp16_gradient_shares_at_power_of_two_loss_scales() -> None:
    g = np.array([2.0 ** -30, 2.0 ** -25, 2.0 ** -20, 2.0 ** -10, 1.0, 40000.0, 70000.0, 0.0, np.nan], np.float32)
    h = F.exponent_hist(g)
    assert h[-2] == 1 and h[-1] == 1 and h[:-2].sum() == 7
    s = F.fp16_gradient_shares(h, 1.0)
    direct = np.abs(g[np.isfinite(g) & (g != 0)]).astype(np.float64)
    assert s["grad_underflow_fp16"] == pytest.approx(np.mean(direct < 2.0 ** -24))
    assert s["grad_subnormal_fp16"] == pytest.approx(np.mean((direct >= 2.0 ** -24) & (direct < 2.0 ** -14)))
    assert s["grad_overflow_fp16"] == pytest.approx(np.mean(direct >= 2.0 ** 16))
    s8 = F.fp16_gradient_shares(h, 2.0 ** 8)
    scaled = direct * 2.0 ** 8
    assert s8["grad_underflow_fp16"] == pytest.approx(np.mean(scaled < 2.0 ** -24))
    assert s8["grad_overflow_fp16"] == pytest.approx(np.mean(scaled >= 2.0 ** 16))


@pytest.mark.parametrize("n", [1, 2, 999, 4096])
def test_exponent_hist_matches_frexp(n: int) -> None:
    """Counts per frexp exponent, zeros (+0, -0) and non-finite, against np.frexp; odd and even lengths."""
    rng = np.random.default_rng(n)
    g = (rng.normal(size=n) * 2.0 ** rng.integers(-150, 120, size=n)).astype(np.float32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -3e-39, 3.4e38], np.float32)
    g[: min(n, special.size)] = special[: min(n, special.size)]
    h = F.exponent_hist(g)
    fin = g[np.isfinite(g) & (g != 0)]
    ref = np.bincount(np.frexp(fin.astype(np.float64))[1] - F.EXP_MIN, minlength=F.EXP_MAX - F.EXP_MIN + 1)
    np.testing.assert_array_equal(h[:-2], ref)
    assert h[-2] == np.count_nonzero(g == 0) and h[-1] == np.count_nonzero(~np.isfinite(g))
    b = rng.integers(0, 256, size=n, dtype=np.uint8)
    np.testing.assert_array_equal(F.byte_counts(b), np.bincount(b, minlength=256))


def test_planted_swamped_tensor_is_the_only_one_flagged(tmp_path) -> None:
    planted = planted_precision_store(tmp_path / "p.zarr")
    result, flags = run_analysis(planted.path, "precision")
    assert {f.tensor for f in flags if f.severity > 0.5} == set(planted.sick)
    assert all(f.severity <= 0.5 for f in flags if f.tensor in planted.healthy)
    row = result.table.set_index("tensor").loc[planted.sick[0]]
    assert row["swamped_bf16"] > 0.9 and row["swamped_fp16"] > 0.5
    assert row["lost_share"] < 0.01          # fp32 snapshots: nothing lost yet
    assert "bf16 ULP" in flags[0].summary and planted.sick[0] in flags[0].summary


@pytest.mark.slow
def test_pure_bf16_weights_show_lost_updates(tmp_path) -> None:
    planted = planted_precision_store(tmp_path / "p.h5", pure_bf16=True)
    result, flags = run_analysis(planted.path, "precision")
    assert {f.tensor for f in flags if f.severity > 0.5} == set(planted.sick)
    assert result.table.set_index("tensor").loc[planted.sick[0], "lost_share"] > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_control_raises_nothing_above_half(tmp_path, seed: int) -> None:
    planted = planted_precision_store(tmp_path / "h.zarr", swamped=False, seed=seed)
    _, flags = run_analysis(planted.path, "precision")
    assert max((f.severity for f in flags), default=0.0) <= 0.5


def test_snapshots_every_few_records_use_the_per_step_update(tmp_path) -> None:
    planted = planted_precision_store(tmp_path / "s.zarr", n_records=16, snapshot_every=4)
    result, _ = run_analysis(planted.path, "precision")
    t = result.table.set_index("tensor")
    assert t.loc[planted.sick[0], "n_pairs"] == 3
    assert t.loc[planted.sick[0], "swamped_bf16"] > 0.9
    assert t.loc["layers.0.mlp.up.weight", "swamped_bf16"] < 0.3


def test_plot_draws_the_half_ulp_lines(tmp_path) -> None:
    from matplotlib.figure import Figure

    planted = planted_precision_store(tmp_path / "p.zarr", n_records=4)
    result, flags = run_analysis(planted.path, "precision")
    ax = Figure().subplots()
    P.plot(result, flags[0], ax)
    assert ax.get_xlabel() and ax.get_ylabel() and planted.sick[0] in ax.get_title()
    assert len(ax.lines) == 2 and len(ax.patches) == F.ULP_EDGES.size - 1


def test_options_are_validated() -> None:
    with pytest.raises(SpecError, match="format must be one of"):
        P.PrecisionOptions.parse({"format": "fp8"})
    with pytest.raises(SpecError, match="bad options"):
        P.PrecisionOptions.parse({"scale": 2})
    with pytest.raises(SpecError, match="loss_scale"):
        P.PrecisionOptions(loss_scale=-1.0)


class TestPrecisionContract(AnalysisContract):
    analysis_name = "precision"
    factory = staticmethod(lambda path, seed: planted_precision_store(path, seed=seed))


def test_table_swamped_shares_are_ml_dtypes_rounding_of_w_plus_delta(tmp_path) -> None:
    """Each tensor's ``swamped_bf16`` / ``swamped_fp16`` against a direct ml_dtypes computation on the stored
    snapshots: over every pair, the share of non-zero per-step updates ``Δ = (W_{t+1} - W_t) / steps`` with
    ``cast(cast(w) + Δ) == cast(w)`` (the sum cast from float64 straight to the format).  To 1e-4: a sum that
    lands on a float32 tie could round either way between a float64-to-format cast and two roundings."""
    import gradforensics as gf

    planted = planted_precision_store(tmp_path / "p.zarr")
    result, _ = run_analysis(planted.path, "precision")
    table = result.table.set_index("tensor")
    store = gf.open_store(planted.path)
    rec = store.weight_records()
    step = store.read("batches/step").astype(np.float64)
    for name in store.weights:
        w = np.asarray(store.weight(name).compute(), dtype=np.float64)
        assert len(rec) - 1 <= 32                       # every pair analysed
        lost = {"bf16": 0, "fp16": 0}
        updated = 0
        for t in range(len(rec) - 1):
            steps = max(step[rec[t + 1]] - step[rec[t]], 1.0) if rec[t + 1] < step.size else rec[t + 1] - rec[t]
            x0, d = w[t].ravel(), (w[t + 1] - w[t]).ravel()
            delta = d / steps
            updated += int(np.count_nonzero(d))
            for fmt, dtype in CAST.items():
                wf = x0.astype(dtype).astype(np.float64)
                lost[fmt] += int(np.count_nonzero((delta != 0) & ((wf + delta).astype(dtype).astype(np.float64) == wf)))
        assert updated > 0
        for fmt in CAST:
            np.testing.assert_allclose(table.loc[name, f"swamped_{fmt}"], lost[fmt] / updated, rtol=0, atol=1e-4)
