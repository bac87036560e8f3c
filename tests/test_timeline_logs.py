"""The run's own logs join the timeline (``analyze --logs DIR``, ``import --logs``): loss scale and logged
gradient norm as series, skipped iterations out of the spike rule's window.

Event files are written by the real writer (``torch.utils.tensorboard.SummaryWriter``) with Megatron-LM's
tags (``lm loss``, ``learning-rate``, ``loss-scale``, ``grad-norm``), beside the planted store of
:mod:`gradforensics.testing.planted_timeline` (kurtosis of ``mlp.act`` from record 40, gradient norm of
``layer.1.weight`` from 50, loss spike at 60; one record a step).  The truth here: the logged gradient
norm steps up 4x at :data:`LOGGED_ONSET`, so it departs there exactly and leads the spike by
``60 - 45`` steps; the spike rule's window against a direct ``np.mean`` / ``np.std``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tensorboard")

import gradforensics as gf
from gradforensics.analysis.kinds.timeline import TimelineOptions, timeline_rows
from gradforensics.analysis.toolkit.departure import SpikeTest, spikes
from gradforensics.analysis.toolkit.signals import collect
from gradforensics.store.reader import open_store
from gradforensics.testing.planted_timeline import PLANTED, planted_timeline_store

#: the record (= step) where the planted log's gradient norm steps up 4x
LOGGED_ONSET = 45
N = PLANTED["n_records"]


def _write_log(d, grad_norm: np.ndarray, loss_scale: np.ndarray, every: int = 1) -> None:
    """Megatron-LM's scalars at every *every*-th step; no ``grad-norm`` where it is NaN (a skipped step)."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(d))
    for i in range(0, grad_norm.size, every):
        w.add_scalar("learning-rate", 1e-3 * min(1.0, (i + 1) / 20), i)       # warmup: a plan, never a signal
        w.add_scalar("lm loss", 2.0, i)
        w.add_scalar("loss-scale", float(loss_scale[i]), i)
        if math.isfinite(grad_norm[i]):
            w.add_scalar("grad-norm", float(grad_norm[i]), i)
    w.close()


def _noise(seed: int) -> np.ndarray:
    return np.exp(0.03 * np.random.default_rng(seed).standard_normal(N))


def _events(findings) -> tuple[list[tuple[str, str, int, int]], list[tuple[str, int]]]:
    t = findings.flags_json()["timeline"]
    before = [(e["signal"], e["tensor"], e["record"], e["lead_steps"]) for e in t["spikes"][0]["signals"]]
    return before, [(e["signal"], e["record"]) for e in t["departures"]]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_timeline_store(tmp_path_factory.mktemp("tl-logs") / "planted.zarr")


def test_the_logged_gradient_norm_departs_at_its_record_with_its_lead(planted, tmp_path):
    norm = _noise(3) * np.where(np.arange(N) >= LOGGED_ONSET, 4.0, 1.0)
    _write_log(tmp_path / "tb", norm, np.full(N, 2.0 ** 16))
    before = set(open_store(planted).batches())
    findings = gf.analyze(planted, logs=tmp_path / "tb", progress=False)
    from gradforensics.reporting import flagsjson

    flagsjson.validate(findings.flags_json())
    spike = PLANTED["spike"]
    got, _ = _events(findings)
    assert got == [("kurtosis", "mlp.act", PLANTED["kurt_onset"], spike - PLANTED["kurt_onset"]),
                   ("logged_grad_norm", "", LOGGED_ONSET, spike - LOGGED_ONSET),
                   ("grad_norm", "layer.1.weight", PLANTED["grad_onset"], spike - PLANTED["grad_onset"])]
    row = findings.table("timeline").query("signal == 'logged_grad_norm'").iloc[0]
    assert row["label"] == "gradient norm logged by the run"
    assert row["value"] == pytest.approx(norm[int(row["alarm_record"])], rel=1e-6)   # float32 in the event file
    assert set(open_store(planted).batches()) == before            # the store's records are not modified


def test_a_healthy_log_adds_no_departure(planted, tmp_path):
    """Noise, one loss-scale backoff (a skipped step, no grad-norm there), a warmup lr, logged every 2nd step."""
    scale = np.where(np.arange(N) >= 30, 2.0 ** 15, 2.0 ** 16)
    norm = _noise(5)
    norm[30] = np.nan
    _write_log(tmp_path / "tb", norm, scale, every=2)
    with_logs = gf.analyze(planted, logs=tmp_path / "tb", progress=False)
    without = gf.analyze(planted, progress=False)
    assert _events(with_logs) == _events(without)
    assert _events(without)[1] == [("kurtosis", PLANTED["kurt_onset"]), ("grad_norm", PLANTED["grad_onset"])]


def _loss_scale_departs(scale: np.ndarray) -> list[int]:
    """Onsets of the departed series of a store-less collection holding only this loss scale and a flat loss."""
    batches = {"loss": 2.0 + 0.01 * np.random.default_rng(0).standard_normal(N), "loss_scale": scale}
    signals = collect(None, batches, (), {}, N)
    assert [s.signal for s in signals] == ["loss", "loss_scale"]
    rows, _ = timeline_rows(signals, np.arange(N), TimelineOptions())
    return [r["record"] for r in rows if r["signal"] == "loss_scale"]


def test_a_loss_scale_departs_when_it_falls_and_stays_not_when_it_rises():
    steps = np.arange(N)
    halvings = np.clip(steps - 51, 0, 4)                 # 4 consecutive backoffs at 52..55: 2^16 -> 2^12, stays
    onsets = _loss_scale_departs(2.0 ** (16 - halvings))
    # one backoff is one robust sd, two sit at the CUSUM's allowance of 2: the onset falls within the backoffs
    assert len(onsets) == 1 and 52 <= onsets[0] <= 55, onsets
    assert _loss_scale_departs(2.0 ** (16 + halvings)) == []          # growth is not trouble
    assert _loss_scale_departs(2.0 ** (16 - np.clip(steps - 51, 0, 2))) == []    # two backoffs: healthy scaling


def test_skipped_records_leave_the_spike_rules_window():
    rng = np.random.default_rng(7)
    loss = 2.0 + 0.05 * rng.standard_normal(N)
    loss[40] = 50.0                                       # the overflowing (skipped) step's loss
    loss[45] = 3.0
    skipped = np.zeros(N, bool)
    skipped[40] = True
    test = SpikeTest()
    w = test.window_for(N)
    assert spikes(loss, test).tolist() == [40]
    assert spikes(loss, test, skipped).tolist() == [40, 45]
    # the oracle: record 45 against its window, with and without the skipped record
    win = loss[45 - w:45]
    kept = np.delete(win, 40 - (45 - w))
    assert loss[45] < win.mean() + 6 * win.std() and loss[45] > kept.mean() + 6 * kept.std()


def test_a_store_imported_with_logs_holds_the_loss_scale_series(tmp_path):
    from test_runlog import SCALES, SKIPPED, _fp16_run

    save, logs, _ = _fp16_run(tmp_path)
    store = gf.import_run(save, tmp_path / "imp.zarr", heads=None, gated_mlp=True, logs=logs)
    b = store.batches()
    signals = {s.signal: s for s in collect(store, b, store.sources, {}, store.n_records)}
    np.testing.assert_array_equal(signals["loss_scale"].values,
                                  [SCALES.get(it - 1, SCALES[it]) for it in SCALES])   # the scale the step used
    assert signals["loss_scale"].direction == -1
    g = signals["logged_grad_norm"].values
    assert [not np.isfinite(v) for v in g] == [it in SKIPPED for it in SCALES]
    findings = gf.analyze(store, only="timeline", progress=False)      # 6 records: too few to test; it runs
    assert findings.flags_json()["timeline"]["departures"] == []


def test_analyze_logs_unreadable_is_one_line_and_writes_nothing(planted, tmp_path, capsys):
    from gradforensics import cli

    (tmp_path / "empty").mkdir()
    assert cli.main(["analyze", str(planted), "--out", str(tmp_path / "rep"), "--logs", str(tmp_path / "empty"),
                     "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no TensorBoard event file" in err, err
    assert not (tmp_path / "rep").exists()


def test_the_join_by_step_leaves_unlogged_records_nan(tmp_path):
    from gradforensics.runlog import read_run_log

    norm = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0])
    _write_log(tmp_path / "tb", norm, 2.0 ** np.array([16, 16, 15, 15, 15, 15]), every=2)   # steps 0, 2, 4
    got = read_run_log(tmp_path / "tb").join(np.array([0, 1, 2, 4, 7]))
    np.testing.assert_array_equal(got["grad_norm"], [1.0, np.nan, np.nan, 5.0, np.nan])
    np.testing.assert_array_equal(got["loss_scale"], [2.0 ** 16, np.nan, 2.0 ** 15, 2.0 ** 15, np.nan])
    assert got["skipped"].tolist() == [False, False, True, False, False]     # no grad-norm, the scale fell
