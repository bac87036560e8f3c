"""The run's own logs (``import --logs``): TensorBoard event files written by the real writer, joined to a dump.

Event files here are written by ``torch.utils.tensorboard.SummaryWriter`` - the writer
Megatron-LM (``megatron/training/global_vars.py`` ``_set_tensorboard_writer``) and the
Hugging Face Trainer's ``TensorBoardCallback`` use - with the tags and the order of
Megatron-LM's ``training_log`` (``megatron/training/training.py``, NVIDIA/Megatron-LM main,
2025-26): ``learning-rate``, ``lm loss``, ``loss-scale`` every logged iteration,
``grad-norm`` only where the optimizer returned one (``None`` on a step the fp16 scaler
skipped).  The scale logged at iteration i is read after that iteration's optimizer step;
the dump of iteration i carries the scale of the step before.  The truth (unscaled
gradients, their norm) is computed here in torch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from test_import_megatron import Layout, reference, write_dump  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.errors import LogReadError  # noqa: E402
from gradforensics.runlog import read_run_log  # noqa: E402


def _writer(d):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(d))


# iteration -> (scale logged after the step, skipped?): an overflow at iteration 4 backs the scale off
SCALES = {1: 2.0 ** 16, 2: 2.0 ** 16, 3: 2.0 ** 16, 4: 2.0 ** 15, 5: 2.0 ** 15, 6: 2.0 ** 15}
SKIPPED = {4}
LAYOUT = Layout(tp=2)


def _fp16_run(tmp_path):
    """A Megatron-style fp16 run: dumps scaled by the scale of the step before, inf at the skipped iteration,
    and its TensorBoard log.  Returns (save dir, log dir, {iteration: unscaled reference gradients})."""
    truth = {it: reference(LAYOUT, it) for it in SCALES}
    dumped = {}
    for it, grads in truth.items():
        used = SCALES.get(it - 1, SCALES[it])
        g = {n: t * used for n, t in grads.items()}
        if it in SKIPPED:
            g["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = math.inf
        dumped[it] = g
    save = write_dump(tmp_path / "save", LAYOUT, dumped)
    logs = tmp_path / "tb"
    w = _writer(logs)
    for it, scale in SCALES.items():
        w.add_scalar("learning-rate", 1e-3 * it, it)
        w.add_scalar("lm loss", 5.0 - 0.1 * it, it)
        w.add_scalar("loss-scale", scale, it)
        if it not in SKIPPED:
            norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in truth[it].values()))
            w.add_scalar("grad-norm", norm, it)
    w.close()
    return save, logs, truth


def test_event_files_read_through_tensorboard_with_megatron_tags(tmp_path):
    _save, logs, _truth = _fp16_run(tmp_path)
    log = read_run_log(logs)
    assert log.steps.tolist() == list(SCALES)
    assert np.allclose(log.values["loss"], [5.0 - 0.1 * i for i in SCALES], rtol=1e-6)
    assert np.allclose(log.values["loss_scale"], list(SCALES.values()))
    assert log.skipped.tolist() == [it in SKIPPED for it in SCALES]
    assert log.origin == {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
                          "loss_scale": "loss-scale"}
    assert log.scale_used(4) == 2.0 ** 16 and log.scale_used(5) == 2.0 ** 15 and log.scale_used(1) == 2.0 ** 16


def test_fp16_dump_is_unscaled_skipped_step_marked_not_a_finding_and_norm_checked(tmp_path):
    save, logs, truth = _fp16_run(tmp_path)
    store = gf.import_run(save, tmp_path / "imp.zarr", heads=None, gated_mlp=True, logs=logs)
    b = store.batches()
    assert b["step"].tolist() == list(SCALES)
    assert b["skipped"].tolist() == [int(it in SKIPPED) for it in SCALES]
    assert np.allclose(b["loss"], [5.0 - 0.1 * i for i in SCALES], rtol=1e-6)
    assert np.allclose(b["lr"], [1e-3 * i for i in SCALES], rtol=1e-6)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    got = store.read(f"grads/{name}")
    for i, it in enumerate(SCALES):
        # the unscaled gradient is the truth to float32 rounding (x * 2^k / 2^k is exact in binary)
        np.testing.assert_allclose(got[i], truth[it][name].numpy(), rtol=1e-6, atol=0)
    check = store.meta.extra["import"]["grad_norm_check"]
    assert check["records"] == len(SCALES) - len(SKIPPED) and check["agree"], check
    assert abs(check["median_ratio"] - 1) < 1e-6
    res = gf.analyze(store, only="nonfinite")
    assert not [f for f in res.flags if f.kind == "nonfinite"], res.flags
    row = res.results["nonfinite"].table
    fc2 = row[(row["tensor"] == "decoder.layers.1.mlp.linear_fc2.weight") & (row["source"] == "")]
    assert int(fc2["records_skipped"].iloc[0]) == 1 and int(fc2["records_nonfinite"].iloc[0]) == 0


def test_without_the_logs_the_same_dump_is_raw_and_its_inf_a_finding(tmp_path):
    """The before: what the join changes (scale left in, the skipped step a nonfinite finding)."""
    save, _logs, truth = _fp16_run(tmp_path)
    store = gf.import_run(save, tmp_path / "raw.zarr", heads=None, gated_mlp=True)
    assert "skipped" not in store.batches()
    got = store.read("grads/decoder.layers.0.mlp.linear_fc2.weight")
    assert np.allclose(got[0], truth[1]["decoder.layers.0.mlp.linear_fc2.weight"].numpy() * 2 ** 16)
    res = gf.analyze(store, only="nonfinite")
    assert [f.tensor for f in res.flags if f.kind == "nonfinite"] == ["decoder.layers.1.mlp.linear_fc2.weight"]


def test_a_missing_shard_shows_as_a_norm_disagreement_in_inspect(tmp_path):
    """The norm check sees what a join lost: a logged norm twice the dump's, as if half the gradient were missing."""
    save, _logs, truth = _fp16_run(tmp_path)
    wrong = tmp_path / "tb-wrong"
    w = _writer(wrong)
    for it, scale in SCALES.items():
        w.add_scalar("lm loss", 5.0, it)
        w.add_scalar("loss-scale", scale, it)
        if it not in SKIPPED:    # a norm twice the truth's: as if half the gradient were missing from the dump
            w.add_scalar("grad-norm", 2 * math.sqrt(sum(float((t.double() ** 2).sum())
                                                        for t in truth[it].values())), it)
    w.close()
    out = tmp_path / "imp.zarr"
    gf.import_run(save, out, heads=None, gated_mlp=True, logs=wrong)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    text = subprocess.run([sys.executable, "-m", "gradforensics", "inspect", str(out)], capture_output=True,
                          text=True, env=env, check=True).stdout
    assert "grad norm: dump / logged, median 0.500000" in text and "DISAGREES" in text, text
    assert "1 iterations skipped by the loss scaler" in text
    js = json.loads(subprocess.run([sys.executable, "-m", "gradforensics", "inspect", str(out), "--json"],
                                   capture_output=True, text=True, env=env, check=True).stdout)
    assert js["run_logs"]["grad_norm_check"]["agree"] is False


def test_a_restarted_run_keeps_the_later_values_of_a_relogged_step(tmp_path):
    d = tmp_path / "tb"
    w = _writer(d)
    for it in (1, 2, 3):
        w.add_scalar("lm loss", 9.0, it)
    w.close()
    w = _writer(d)                 # a restart from iteration 2: its values replace the first run's
    for it in (2, 3, 4):
        w.add_scalar("lm loss", float(it), it)
    w.close()
    log = read_run_log(d)
    assert log.steps.tolist() == [1, 2, 3, 4]
    assert log.values["loss"].tolist() == [9.0, 2.0, 3.0, 4.0]


def test_trainer_state_log_history_is_a_run_log(tmp_path):
    state = {"log_history": [{"step": 10, "loss": 2.5, "learning_rate": 1e-4, "grad_norm": 0.7},
                             {"step": 20, "loss": 2.0, "learning_rate": 5e-5, "grad_norm": 0.6},
                             {"step": 20, "eval_loss": 2.2}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    log = read_run_log(tmp_path)
    assert log.steps.tolist() == [10, 20]
    assert log.values["grad_norm"].tolist() == [0.7, 0.6] and log.values["lr"].tolist() == [1e-4, 5e-5]
    assert not log.skipped.any() and not log.has_loss_scale


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "fifo", "no-tags"])
def test_unreadable_logs_are_one_line(tmp_path, case):
    d = tmp_path / "tb"
    d.mkdir()
    if case == "garbage":
        (d / "events.out.tfevents.1.host").write_bytes(b"\x00\x01not a record" * 50)
    elif case == "fifo":
        os.mkfifo(d / "events.out.tfevents.2.host")
    elif case == "no-tags":
        w = _writer(d)
        w.add_scalar("accuracy", 0.5, 1)
        w.close()
    with pytest.raises(LogReadError) as e:
        read_run_log(d if case != "missing" else tmp_path / "nope")
    assert "\n" not in str(e.value) and str(e.value)
