"""The ``logits`` analysis (log Z growth of the output logits) against planted series and torch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import theilslopes

import gradforensics as gf
from gradforensics.analysis.kinds import logits as L
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.store.reader import open_store


def _stats(logz: np.ndarray, spread: float) -> dict[str, np.ndarray]:
    n = logz.size
    return {"logz_mean": logz, "logz_max": logz + 1.0, "logit_max": logz + 0.5, "logit_mean": logz - spread,
            "row_norm_ratio": np.full(n, np.nan)}


def test_planted_series_onset_growth_and_slope() -> None:
    """log Z flat at log V = 5.5 to record 200, then +0.2 nats a record: onset, growth and slope to the plant."""
    rng = np.random.default_rng(0)
    n, start, slope, log_v = 320, 200, 0.2, math.log(256)
    logz = log_v + slope * np.clip(np.arange(n) - start, 0, None) + 0.1 * rng.standard_normal(n)
    edges = window_edges(n, L.WINDOWS)
    row = L.logit_row("head", _stats(logz, log_v), np.full(n, 3.0), np.arange(n) * 4.0, edges)
    # the threshold open + log V is crossed log V / slope = 27.7 records after the onset: within one window (10)
    assert abs(row["since_record"] - (start + log_v / slope)) <= 10
    assert row["since_step"] == 4 * row["since_record"]
    want = logz[edges[-2]:].mean() - logz[:edges[1]].mean()
    assert row["growth"] == pytest.approx(want, rel=1e-9)
    assert row["rel_growth"] == pytest.approx(want / log_v, rel=1e-9)
    assert row["slope"] == pytest.approx(slope, rel=0.02)                      # Theil-Sen on the windows
    assert row["slope_step"] == pytest.approx(slope / 4, rel=0.02)             # 4 steps a record
    centres = (edges[:-1] + edges[1:] - 1) / 2
    w = L.windowed(logz, edges)
    k = np.searchsorted(edges, row["since_record"])
    assert row["slope"] == pytest.approx(theilslopes(w[k:], centres[k:])[0], rel=1e-9)   # scipy's Theil-Sen
    assert row["logit_shift"] == pytest.approx(row["growth"], abs=1e-9)              # the spread held: a pure shift
    assert L.severity(row["rel_growth"]) == 1.0                                # 19 nats/5.5 > 4


@pytest.mark.parametrize(("rel", "want"), [(0.5, 0.0), (1.0, 0.0), (2.0, 0.5), (4.0, 1.0), (40.0, 1.0),
                                           (math.sqrt(8), 0.75), (math.nan, 0.0), (math.inf, 1.0)])
def test_severity_is_log4_of_the_growth_over_the_opening_spread(rel: float, want: float) -> None:
    assert L.severity(rel) == pytest.approx(want, abs=1e-12)


def test_onset_needs_a_sustained_rise() -> None:
    assert L.onset_window(np.array([0, 0, 5, 5, 5.0]), 1.0) == 2
    assert L.onset_window(np.array([0, 0, 5, 0, 5, 5.0]), 1.0) == 4            # the dip resets it
    assert L.onset_window(np.array([0, 0, 0, 0, 5.0]), 1.0) is None            # the last window alone: a spike
    assert L.onset_window(np.array([0, 0, 5, np.nan, 5.0]), 1.0) is None       # a non-finite window is not above


def test_an_overflowed_log_z_is_a_growth_not_a_gap() -> None:
    n = 64
    edges = window_edges(n, L.WINDOWS)
    logz = np.where(np.arange(n) < 40, 5.5, np.inf)
    row = L.logit_row("head", _stats(logz, 5.5), np.full(n, 3.0), np.arange(n, dtype=float), edges)
    assert row["since_record"] == 40 and row["growth"] == np.inf and L.row_severity(row) == (1.0, False)


def test_healthy_and_falling_log_z_are_not_flagged() -> None:
    rng = np.random.default_rng(1)
    n = 150
    edges = window_edges(n, L.WINDOWS)
    learn = 5.5 + 1.5 * (1 - np.exp(-np.arange(n) / 30)) + 0.2 * rng.standard_normal(n)   # +1.5 nats: healthy
    fall = 5.5 - 0.3 * np.arange(n)                                                      # -45 nats: not a rise
    for logz in (learn, fall):
        row = L.logit_row("head", _stats(logz, 5.5), np.full(n, 3.0), np.arange(n, dtype=float), edges)
        assert row["since_record"] is None and L.severity(row["rel_growth"]) == 0.0


def test_a_spread_grown_while_the_loss_fell_is_learning_but_a_shift_is_not() -> None:
    """log Z +30 nats with the loss falling 3 -> 0.5: as spread (confidence) context, as common shift a flag."""
    n, log_v = 150, math.log(10)
    edges = window_edges(n, L.WINDOWS)
    logz = log_v + 30 * np.clip((np.arange(n) - 30) / 100, 0, 1)
    loss = 3.0 - 2.5 * np.clip(np.arange(n) / 140, 0, 1)
    confident = _stats(logz, log_v)
    confident["logit_mean"] = np.zeros(n)                           # mean logit held: the spread grew
    row = L.logit_row("head", confident, loss, np.arange(n, dtype=float), edges)
    assert row["loss_change"] < -0.5 and row["logit_shift"] == pytest.approx(0, abs=1e-9)
    assert L.row_severity(row) == (0.0, True)
    drifting = L.logit_row("head", _stats(logz, log_v), loss, np.arange(n, dtype=float), edges)   # a shift
    assert L.row_severity(drifting) == (1.0, True)
    rising = L.logit_row("head", confident, loss[::-1].copy(), np.arange(n, dtype=float), edges)  # loss climbs
    assert L.row_severity(rising) == (1.0, False)


@pytest.fixture(scope="module")
def sick(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("torch")
    from gradforensics.testing.planted_logits import planted_logits_store

    return planted_logits_store(tmp_path_factory.mktemp("logits") / "sick.zarr")


def test_captured_log_z_equals_scipy_logsumexp_of_the_planted_logits(sick) -> None:
    from gradforensics.testing.planted_logits import planted_logits

    z = planted_logits().astype(np.float64)
    lz = logsumexp(z, axis=-1)                                    # (N, positions)
    s = open_store(sick)
    assert s.logit_modules == ["lm_head"]
    np.testing.assert_allclose(s.logits("lm_head", "logz_mean"), lz.mean(1), rtol=1e-5)
    np.testing.assert_allclose(s.logits("lm_head", "logz_max"), lz.max(1), rtol=1e-5)
    np.testing.assert_allclose(s.logits("lm_head", "logit_mean"), z.mean((1, 2)), rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError):
        s.logits("lm_head", "nope")


def test_planted_divergence_is_flagged_on_the_head_since_its_onset(sick, tmp_path) -> None:
    findings = gf.analyze(sick, progress=False)
    first = findings.flags[0]
    assert (first.kind, first.tensor, first.head) == ("logits", "lm_head", None)
    assert first.severity == 1.0 and first.evidence["growth"] > 30
    assert 16 <= first.evidence["since_record"] <= 30 and first.records == (first.evidence["since_record"], 47)
    assert "log Z of the output logits grew" in first.summary
    table = findings.table("logits")
    assert list(table.columns[:2]) == ["tensor", "head"] and len(table) == 1
    gf.report(findings, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Output-logit divergence" in md and "z-loss" in md
    assert "Output-logit divergence" in (tmp_path / "out" / "report.html").read_text()
    assert (tmp_path / "out" / "figures" / "finding-01-logits.png").is_file()


@pytest.mark.parametrize("kw", [{"shift": 0.0, "scale": 1.0}, {"shift": -40.0, "scale": 1.0}])
def test_flat_or_falling_planted_log_z_raises_no_logits_flag(tmp_path, kw) -> None:
    pytest.importorskip("torch")
    from gradforensics.testing.planted_logits import planted_logits_store

    path = planted_logits_store(tmp_path / "h.zarr", **kw)
    findings = gf.analyze(path, progress=False, only=["logits"])
    assert not [f for f in findings.flags if f.kind == "logits"]
    assert len(findings.table("logits")) == 1


def test_replay_store_fills_the_table_and_raises_no_flag(tmp_path) -> None:
    pytest.importorskip("torch")
    from gradforensics.testing.planted_logits import planted_logits_store

    path = planted_logits_store(tmp_path / "r.zarr", mode="replay")
    findings = gf.analyze(path, progress=False, only=["logits"])
    assert not findings.flags and findings.table("logits")["growth"].iloc[0] > 30
