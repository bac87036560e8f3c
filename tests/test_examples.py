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
    assert "12 records from zh, en, code" in out and "report:" in out
    assert (tmp_path / "r" / "report.html").is_file() and (tmp_path / "r" / "flags.json").is_file()


def test_instrument_example_runs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run(tmp_path, "instrument_training_loop.py", "--out", str(tmp_path / "r"), "--steps", "4")
    assert (tmp_path / "r" / "dump.zarr").is_dir()
