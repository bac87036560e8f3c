"""replay(): fixed checkpoint, per-batch gradients, sources interleaved, size estimate, progress."""

from __future__ import annotations

import warnings
from collections import namedtuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402
from gradforensics.replay import replay  # noqa: E402
from gradforensics.replay.run import batch_size, interleave  # noqa: E402

nn = torch.nn


def model_and_data(n_batches: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(seed + 1)
    data = {
        "en": [{"x": torch.randn(4, 5, generator=gen), "y": torch.randn(4, 2, generator=gen)} for _ in range(n_batches)],
        "zh": [{"x": torch.randn(6, 5, generator=gen) + 2, "y": torch.randn(6, 2, generator=gen)}
               for _ in range(n_batches)],
    }
    return model, data


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_replay_records_each_batch_gradient_at_a_fixed_checkpoint(tmp_path, suffix, capsys):
    model, data = model_and_data()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = tmp_path / f"r{suffix}"
    store = replay(model, data, loss_fn, path, n_per_source=3, step=1200)
    # oracle: each batch's own gradient, computed from scratch
    order = [("en", 0), ("zh", 0), ("en", 1), ("zh", 1), ("en", 2), ("zh", 2)]
    want, losses = [], []
    for src, j in order:
        model.zero_grad()
        loss = loss_fn(model, data[src][j])
        loss.backward()
        want.append(model[0].weight.grad.clone().numpy())
        losses.append(float(loss.detach()))
    assert store.mode == "replay" and store.n_records == 6 and store.sources == ("en", "zh")
    b = store.batches()
    np.testing.assert_array_equal(b["mixture"], [[1, 0], [0, 1]] * 3)     # round-robin
    np.testing.assert_array_equal(b["n_samples"], [4, 6] * 3)              # from the batch
    np.testing.assert_array_equal(b["step"], [1200] * 6)
    np.testing.assert_allclose(b["loss"], losses, rtol=1e-6)
    np.testing.assert_allclose(store.grad("0.weight").compute(), np.stack(want), rtol=1e-6, atol=1e-8)
    for n, p in model.named_parameters():                                  # no optimizer step
        assert torch.equal(p.detach(), before[n])
    err = capsys.readouterr().err
    assert "6 records x" in err and "free on that disk" in err and "6/6 records" in err


def test_uneven_quota_and_exhausted_source(tmp_path):
    model, data = model_and_data(n_batches=2)
    with pytest.warns(RuntimeWarning, match="source 'zh' ran out after 2 of 4"):
        store = replay(model, data, loss_fn, tmp_path / "u.zarr", n_per_source={"en": 1, "zh": 4},
                       progress=False)
    np.testing.assert_array_equal(store.batches()["mixture"].argmax(1), [0, 1, 1])


def test_size_estimate_refuses_a_capture_that_cannot_fit(tmp_path, monkeypatch):
    import shutil

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10_000, 9_000, 1_000))
    model, data = model_and_data()
    with pytest.raises(SpecError, match=r"would need ~.* but only 1000 B is free; lower n_per_source"):
        replay(model, data, loss_fn, tmp_path / "big.zarr", n_per_source=3, progress=False)
    assert gf.open_store(tmp_path / "big.zarr").n_records == 1      # what was captured stays readable


def test_recorder_options_pass_through(tmp_path):
    model, data = model_and_data()
    store = replay(model, data, loss_fn, tmp_path / "s.zarr", n_per_source=2, progress=False,
                   tensors=["2.weight"], activations=["1"], sketch=16)
    assert store.tensors == ["2.weight"] and not store.grads and store.act_modules == ["1"]
    with pytest.raises(SpecError, match="mode= is set by replay"):
        replay(model, data, loss_fn, tmp_path / "x.zarr", mode="training")


def test_batch_size_and_interleave_helpers():
    assert batch_size({"input_ids": torch.zeros(7, 3)}) == 7
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size(torch.zeros(3)) == 3 and batch_size("text") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(interleave({"a": "xyz", "b": "uvw", "c": "pq"}, 2))
    assert got == [("a", "x"), ("b", "u"), ("c", "p"), ("a", "y"), ("b", "v"), ("c", "q")]
