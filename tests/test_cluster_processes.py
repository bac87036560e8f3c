"""A real dask cluster from the command line: ``dask scheduler`` and two ``dask worker`` processes.

As on SLURM or Kubernetes: the scheduler writes a scheduler file, two worker
processes (separate interpreters that share nothing with the test but the
environment) join it, and ``gradforensics analyze s3://... --scheduler FILE``
runs the pass on them against the S3 server on loopback; the workers open the
store by URL inside each task.  The planted trouble (NaN/Inf in two records of
one tensor) is found and nothing else above 0.5 (the same store on local disk gives
the same flags: ``tests/test_remote_stores.py``).  Every process is stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("distributed")
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from distributed import Client

from gradforensics.analysis.engine.results import read_findings
from gradforensics.cli import main
from gradforensics.store.reader import Store
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import BUCKET, free_port, moto_server


def _dask_cli() -> list[str]:
    """The ``dask`` command the ``distributed`` extra installs (the test needs the real CLI)."""
    exe = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    assert exe, "no `dask` command next to this interpreter: install the `distributed` extra"
    return [exe]


def _wait_workers(scheduler_file: str, n: int, timeout: float = 90.0) -> None:
    from distributed import Client

    deadline = time.monotonic() + timeout
    while not os.path.exists(scheduler_file):
        if time.monotonic() > deadline:
            raise TimeoutError("the dask scheduler wrote no scheduler file")
        time.sleep(0.2)
    with Client(scheduler_file=scheduler_file, timeout="60s") as client:
        client.wait_for_workers(n, timeout=max(deadline - time.monotonic(), 1))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in reversed(procs):
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _flags(out) -> list[tuple]:
    doc = json.loads((out / "flags.json").read_text())
    rows = doc["flags"] if isinstance(doc, dict) else doc
    return sorted((r["kind"], r["tensor"], r.get("head"), round(float(r["severity"]), 9)) for r in rows)


@pytest.mark.slow
def test_analyze_url_on_a_cluster_of_processes_started_from_the_command_line(tmp_path):
    dask = _dask_cli()
    with moto_server():
        url = f"s3://{BUCKET}/cluster/dump.zarr"
        truth = nonfinite_store(url, n_records=12, records=(4, 7)).truth
        sched_file = str(tmp_path / "scheduler.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        common = ["--no-dashboard"]
        procs = [subprocess.Popen([*dask, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()),
                                   "--scheduler-file", sched_file, *common], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            for _ in range(2):
                procs.append(subprocess.Popen(
                    [*dask, "worker", "--scheduler-file", sched_file, "--nthreads", "1", "--nworkers", "1",
                     "--host", "127.0.0.1", "--worker-port", str(free_port()), "--nanny-port", str(free_port()),
                     *common, "--local-directory", str(tmp_path / "workers")],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait_workers(sched_file, 2)
            rc = main(["analyze", url, "--out", str(tmp_path / "cluster"), "--scheduler", sched_file,
                       "--only", "nonfinite,noise", "--quiet"])
            assert rc == 0
            with Client(scheduler_file=sched_file, timeout="30s") as client:   # the reads ran on the workers
                prefixes = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
            saved = read_findings(Store(url, check_chunks=False))
        finally:
            _stop(procs)
        assert all(p.returncode is not None for p in procs)
    # the Gram tasks, which read the store by URL, ran there (tensors of one slab: many a task, `fused-slabs`)
    assert {"gram", "fused-slabs"} & set(prefixes), prefixes
    assert saved.header["scheduler"] == "distributed"
    flags = [f for f in _flags(tmp_path / "cluster") if f[3] > 0.5]
    assert [f[:3] for f in flags] == [("nonfinite", truth["tensor"], None)]   # the planted trouble, nothing else
