"""A store given by a relative path, analysed on a hand-started cluster (issue 45, item 3).

``dask scheduler`` and a ``dask worker`` are started from a directory of their own (as on
SLURM, where the workers start wherever the job script runs); ``gradforensics analyze
dump.zarr --scheduler FILE`` runs from the store's directory.  The client makes the local
path absolute when it parses it, so the workers open the store the client means and give
the flags a local pass gives.  A worker that cannot find the store says so, naming its
host, instead of calling the store damaged.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from distributed import Client

from gradforensics.cli import main
from gradforensics.errors import NotAStoreError
from gradforensics.store.backends import locate
from gradforensics.store.reader import Store
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import free_port
from tests.test_cluster_processes import _dask_cli, _flags, _stop, _wait_workers


def test_a_local_path_is_made_absolute_when_parsed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locate("dump.zarr").path == str(tmp_path / "dump.zarr")
    assert locate("s3://bucket/dump.zarr").path == "s3://bucket/dump.zarr"      # a URL stays as it is


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A scheduler file of a running ``dask scheduler`` with one ``dask worker``, both started in ``elsewhere/``."""
    dask = _dask_cli()
    tmp_path = tmp_path_factory.mktemp("cluster")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sched_file = str(tmp_path / "scheduler.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}     # this checkout's gradforensics, from elsewhere
    procs = [subprocess.Popen([*dask, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()),
                               "--scheduler-file", sched_file, "--no-dashboard"], env=env, cwd=elsewhere,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen(
            [*dask, "worker", "--scheduler-file", sched_file, "--nthreads", "1", "--nworkers", "1",
             "--host", "127.0.0.1", "--worker-port", str(free_port()), "--nanny-port", str(free_port()),
             "--no-dashboard", "--local-directory", str(elsewhere / "workers")],
            env=env, cwd=elsewhere, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_workers(sched_file, 1)
        yield sched_file
    finally:
        _stop(procs)


def test_a_relative_store_path_reaches_the_workers(tmp_path, monkeypatch, cluster, capsys):
    data = tmp_path / "data"
    data.mkdir()
    truth = nonfinite_store(data / "dump.zarr", n_records=12, records=(4, 7)).truth
    monkeypatch.chdir(data)
    rc = main(["analyze", "dump.zarr", "--out", str(tmp_path / "local"), "--only", "nonfinite,noise", "--quiet"])
    assert rc in (0, 1)
    rc = main(["analyze", "dump.zarr", "--out", str(tmp_path / "cluster"), "--scheduler", cluster,
               "--only", "nonfinite,noise", "--quiet"])
    err = capsys.readouterr().err
    assert rc in (0, 1), err
    assert "damaged" not in err
    assert _flags(tmp_path / "cluster") == _flags(tmp_path / "local")
    assert [f[:3] for f in _flags(tmp_path / "cluster") if f[3] > 0.5] == [("nonfinite", truth["tensor"], None)]


def test_a_worker_that_cannot_find_the_store_says_so(tmp_path, cluster):
    nonfinite_store(tmp_path / "dump.zarr", n_records=12, records=(4, 7))
    store = Store(tmp_path / "dump.zarr", check_chunks=False)
    handle = store.handle(next(iter(store.grads.values())))
    with Client(scheduler_file=cluster, timeout="30s") as client:
        assert client.submit(handle.__getitem__, slice(0, 2), pure=False).result().shape[0] == 2
        (tmp_path / "dump.zarr").rename(tmp_path / "moved.zarr")     # not where the client said it is
        with pytest.raises(NotAStoreError) as info:
            client.submit(handle.__getitem__, slice(0, 2), pure=False).result()
    msg = str(info.value)
    assert msg.startswith(f"a worker on {socket.gethostname()} could not find {tmp_path / 'dump.zarr'}")
    assert "damaged" not in msg
