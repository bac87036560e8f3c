"""A real dask cluster that loses its workers, or its scheduler, in the middle of ``analyze --scheduler``.

``dask scheduler`` and two ``dask worker --no-nanny`` processes (a SIGKILL ends the
worker itself, no nanny restarts it) are started from the command line as in
``tests/test_cluster_processes.py``.  The pass is paused at the moment it starts
waiting on the cluster (:data:`gradforensics.analysis.toolkit.cluster.on_wait`, a test
hook inert by default) and the workers, or the scheduler, are SIGKILLed there.
Before issue 42 the first waited for ever (no answer after 420 s) and the second
ended in a ``FutureCancelledError`` traceback; now each is one line, exit 2, within
``GRADFORENSICS_NO_WORKERS_S`` (2 s here) plus a poll.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("distributed")

from test_cluster_processes import _dask_cli, _stop, _wait_workers

from gradforensics.analysis.toolkit import cluster
from gradforensics.cli import main
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import free_port


def _start(tmp_path) -> tuple[str, list[subprocess.Popen]]:
    dask = _dask_cli()
    sched_file = str(tmp_path / "scheduler.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([*dask, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()),
                               "--scheduler-file", sched_file, "--no-dashboard"], **quiet)]
    for _ in range(2):
        procs.append(subprocess.Popen([*dask, "worker", "--scheduler-file", sched_file, "--nthreads", "1",
                                       "--no-nanny", "--host", "127.0.0.1", "--no-dashboard",
                                       "--local-directory", str(tmp_path / "workers")], **quiet))
    _wait_workers(sched_file, 2)
    return sched_file, procs


def _analyze_killing(tmp_path, capfd, monkeypatch, victims) -> tuple[int, list[str], float]:
    store = tmp_path / "dump.zarr"
    nonfinite_store(store, n_records=12, records=(4, 7))
    sched_file, procs = _start(tmp_path)
    killed: list[str] = []

    def kill(what: str) -> None:
        if not killed:
            for p in victims(procs):
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
            killed.append(what)

    monkeypatch.setenv("GRADFORENSICS_NO_WORKERS_S", "2")
    monkeypatch.setattr(cluster, "on_wait", kill)
    try:
        t0 = time.monotonic()
        rc = main(["analyze", str(store), "--out", str(tmp_path / "report"), "--scheduler", sched_file,
                   "--only", "nonfinite,noise", "--quiet"])
        took = time.monotonic() - t0
    finally:
        _stop(procs)
    assert killed, "the pass never waited on the cluster"
    return rc, capfd.readouterr().err.strip().splitlines(), took


def test_every_worker_killed_mid_pass_is_one_line_not_a_hang(tmp_path, capfd, monkeypatch):
    rc, lines, took = _analyze_killing(tmp_path, capfd, monkeypatch, lambda procs: procs[1:])
    assert rc == 2 and len(lines) == 1, lines
    assert "no dask worker for" in lines[0] and "while running the Gram pass" in lines[0], lines[0]
    assert "GRADFORENSICS_NO_WORKERS_S=2" in lines[0]
    assert took < 60


def test_the_scheduler_killed_mid_pass_is_one_line_not_a_traceback(tmp_path, capfd, monkeypatch):
    rc, lines, took = _analyze_killing(tmp_path, capfd, monkeypatch, lambda procs: procs[:1])
    assert rc == 2 and len(lines) == 1 and "Traceback" not in "\n".join(lines), lines
    assert "the dask scheduler went away" in lines[0], lines[0]
    assert took < 90
