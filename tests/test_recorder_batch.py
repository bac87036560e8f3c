"""``record()`` without ``n_samples`` (issue 45, item 7): the TorchRecorder reads the batch size from the
model's calls (the leading dimension of the first tensor argument, summed over the calls with gradients since
the previous record), and warns once where it saw none; the noise analysis reads ``batches/n_samples``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.store.reader import Store  # noqa: E402


class _KwargsModel(torch.nn.Module):
    """Called the Hugging Face way, with keywords only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.out = torch.nn.Linear(6, 11)

    def forward(self, input_ids=None, labels=None):
        return self.out(self.emb(input_ids)).mean()


def _n_samples(path) -> list[int]:
    return Store(path).batches()["n_samples"].astype(int).tolist()


def test_n_samples_is_the_batch_the_model_took(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # nothing to warn about: every record saw its batch
        with gf.Recorder(tmp_path / "a.zarr", model=model, sources=["a"]) as rec:
            model(torch.randn(7, 5)).pow(2).mean().backward()
            rec.record(step=0, loss=1.0, source="a")
            model.zero_grad()
            for rows in (3, 4, 2):                     # gradient accumulation: micro-batches add up
                model(torch.randn(rows, 5)).pow(2).mean().backward()
            with torch.no_grad():
                model(torch.randn(100, 5))             # an evaluation between steps does not count
            rec.record(step=1, loss=1.0, source="a")
            model.zero_grad()
            model(torch.randn(5, 5)).pow(2).mean().backward()
            rec.record(step=2, loss=1.0, source="a", n_samples=64)   # given: it wins
    assert _n_samples(tmp_path / "a.zarr") == [7, 9, 64]


def test_keyword_inputs_count_too(tmp_path):
    model = _KwargsModel()
    with gf.Recorder(tmp_path / "k.zarr", model=model, sources=["a"]) as rec:
        model(input_ids=torch.randint(11, (6, 8))).backward()
        rec.record(step=0, loss=1.0, source="a")
    assert _n_samples(tmp_path / "k.zarr") == [6]


def test_no_call_seen_warns_once_and_records_one(tmp_path):
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gf.Recorder(tmp_path / "w.zarr", model=model, sources=["a"]) as rec:
            for i in range(3):
                model.weight.grad = torch.ones_like(model.weight)       # a gradient made without calling model
                model.bias.grad = torch.ones_like(model.bias)
                rec.record(step=i, loss=1.0, source="a")
    said = [str(w.message) for w in caught if "n_samples" in str(w.message)]
    assert len(said) == 1 and "pass record(n_samples=BATCH_SIZE)" in said[0], said
    assert _n_samples(tmp_path / "w.zarr") == [1, 1, 1]


def test_the_readme_snippet_shows_n_samples():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    use = readme[readme.index("## Use"):]
    call = re.search(r"rec\.record\((.*?)\)\n", use).group(1)
    assert "n_samples=" in call, call
