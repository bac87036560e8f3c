"""Every example in examples/ runs as shipped (subprocess, fresh temporary directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def run(tmp_path: Path, script: str, *args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_every_example_is_exercised_here():
    assert {p.name for p in EXAMPLES.glob("*.py")} == {
        "instrument_training_loop.py", "replay_per_source.py", "analyze_on_dask_cluster.py", "slurm_jobqueue.py"}


@pytest.mark.slow
def test_slurm_example_prints_its_job_script(tmp_path):
    pytest.importorskip("dask_jobqueue")
    out = run(tmp_path, "slurm_jobqueue.py", "--print-job-script")
    assert "#SBATCH" in out and "--cpus-per-task=8" in out
    assert "OMP_NUM_THREADS=1" in out and "dask_worker" in out


@pytest.mark.slow
def test_dask_cluster_example_runs_analyze_on_a_scheduler_address(tmp_path):
    pytest.importorskip("distributed")
    out = run(tmp_path, "analyze_on_dask_cluster.py", "--out", str(tmp_path / "r"), "--workers", "2")
    assert "scheduler at tcp://" in out and "scheduler: distributed" in out
    doc = json.loads((tmp_path / "r" / "flags.json").read_text())
    assert doc["flags"][0]["kind"] == "conflict" and set(doc["flags"][0]["sources"]) == {"zh", "en"}
    assert (tmp_path / "r" / "report.html").is_file()


@pytest.mark.slow
def test_replay_example_replays_each_source(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = run(tmp_path, "replay_per_source.py", "--out", str(tmp_path / "r"), "--n-per-source", "4",
              "--train-steps", "20")
    assert "12 records from zh, en, code" in out and f"report: {tmp_path / 'r' / 'report.html'}" in out
    doc = json.loads((tmp_path / "r" / "flags.json").read_text())
    assert doc["schema"] == 1 and doc["mode"] == "replay" and doc["n_records"] == 12
    assert isinstance(doc["flags"], list)
    assert all({"kind", "tensor", "severity", "sources"} <= set(f) for f in doc["flags"])
    html = (tmp_path / "r" / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and 'id="verdict"' in html and "</html>" in html
    assert (tmp_path / "r" / "report.md").read_text().strip()


@pytest.mark.slow
def test_instrument_example_runs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import numpy as np

    import gradforensics as gf

    out = run(tmp_path, "instrument_training_loop.py", "--out", str(tmp_path / "r"), "--steps", "4")
    path = tmp_path / "r" / "dump.zarr"
    assert f"{path}: 4 records, sources ['web', 'code'], mode training" in out
    store = gf.open_store(path)
    assert (store.n_records, tuple(store.sources), store.mode) == (4, ("web", "code"), "training")
    assert set(store.grads) == {f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}                    # the two globs, every 2-D weight
    heads = {"q_proj": (4, 4, 16, 64, "q"), "k_proj": (4, 2, 16, 64, "k"), "v_proj": (4, 2, 16, 64, "v"),
             "o_proj": (4, 4, 64, 16, "o")}                                 # per head, GQA from the config
    for m, (*shape, role) in heads.items():
        info = store.grads[f"model.layers.0.self_attn.{m}.weight"]
        assert (tuple(info.shape), info.attrs["role"]) == (tuple(shape), role), m
    g = store.grad("model.layers.0.self_attn.q_proj.weight").compute()
    assert np.isfinite(g).all() and (np.abs(g).reshape(4, -1).max(axis=1) > 0).all()   # a real gradient per record
    b = store.batches()
    assert b["step"].tolist() == [0, 1, 2, 3] and b["n_samples"].tolist() == [8] * 4
    assert b["mixture"].tolist() == [[1, 0], [0, 1], [1, 0], [0, 1]]             # web, code alternate
    assert np.isfinite(b["loss"]).all() and (b["loss"] > 0).all()
    assert list(store.act_modules) == ["model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"]
    assert store.weight_records().tolist() == [0]                               # weights_every=4, 4 records
