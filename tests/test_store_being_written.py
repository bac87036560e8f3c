"""A store being written (issue 27): inspect and analyze name its live writer and the records committed so far.

A real writer: a child process holds a Recorder open on the store, prints ``ready``
once K records are committed, and sleeps.  Killed (SIGKILL), it leaves a stale lock
that no reader may take for a live writer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.cli import main
from gradforensics.errors import EmptyStoreError
from gradforensics.store.lock import current_writer, lock_path

_CHILD = """
import sys, time
import numpy as np
from gradforensics.recording import Recorder
path, k, per_chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rec = Recorder(path, sources=["a", "b"], records_per_chunk=per_chunk)
for i in range(k):
    rec.record(step=i, loss=1.0 / (i + 1), n_samples=4, lr=0.1, source="ab"[i % 2],
               grads={"w": np.random.default_rng(i).normal(size=(4, 3)).astype(np.float32)})
rec.drain()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def writer(tmp_path):
    """Start a child writing ``K`` records (chunks of ``per_chunk``) into a store; yield (path, process)."""
    procs: list[subprocess.Popen] = []

    def start(name: str, k: int, per_chunk: int):
        path = str(tmp_path / name)
        p = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(k), str(per_chunk)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", p.communicate()
        return path, p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _kill(p: subprocess.Popen) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


@pytest.mark.slow
def test_inspect_and_analyze_name_the_live_writer(writer, capsys, tmp_path):
    # local Zarr only: an HDF5 file being written is locked by h5py itself (a reader cannot open it)
    path, p = writer("dump.zarr", k=10, per_chunk=4)
    store = gf.Store(path)
    committed = store.n_records
    assert committed == 8                       # two full chunks committed, two records in flight
    assert store.writer is not None and store.writer.pid == p.pid

    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("being written by host ") and f"pid {p.pid}, since " in out[0]
    assert out[0].endswith(f"; {committed} records committed so far")
    assert sum("being written" in line for line in out) == 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a note in the header, not a Python warning
        findings = gf.analyze(path)
    partial = findings.header["partial"]
    assert f"pid {p.pid}," in partial["writer"] and partial["n_records"] == committed == findings.n_records
    assert os.path.exists(lock_path(path))       # the lock is read, never taken or changed

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["analyze", path, "--out", str(tmp_path / "rep"), "--quiet"]) in (0, 1, 2)
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if line.startswith("note: ")]
    assert notes == [f"note: the store is being written by {partial['writer']}; analysed the {committed} "
                     "records committed so far (results not saved in the store)"]

    _kill(p)                                     # a stale lock: no live writer any more
    assert os.path.exists(lock_path(path))
    assert current_writer(path) is None and gf.Store(path).writer is None
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "being written" not in out
    with pytest.warns(UserWarning, match="took over a stale writer lock"):   # saving its results takes it over
        findings = gf.analyze(path)
    assert "partial" not in findings.header


def test_zero_committed_records_names_the_writer(writer, capsys, tmp_path):
    path, p = writer("empty.zarr", k=2, per_chunk=64)
    assert gf.Store(path).n_records == 0
    with pytest.raises(EmptyStoreError, match=f"it is being written by host .*, pid {p.pid}, since "):
        gf.analyze(path)
    assert main(["analyze", path, "--out", str(tmp_path / "rep")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "holds no complete record yet: it is being written by host " in err[0]
    assert err[0].endswith("; try again when records are committed.")

    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("being written by ") and out[0].endswith("; 0 records committed so far")
    assert "sources: -" in out
    assert "nan" not in "\n".join(out)

    _kill(p)
    with pytest.raises(EmptyStoreError, match="holds no complete record; nothing to analyze"):
        gf.analyze(path)


# ------------------------------------------------------------------ a failed first record blocks no retry
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_a_recorder_that_fails_before_its_first_record_leaves_no_store(tmp_path, suffix):
    path = tmp_path / f"s{suffix}"
    with pytest.raises(TypeError), gf.Recorder(path, sources=["a"], background=False) as rec:
        rec.record(step=0, source="a", loss=1.0, grads={"w": np.ones((3, 2), np.float32)}, bogus=1)
    assert not path.exists()                                  # nothing committed: nothing left to block the retry
    with gf.Recorder(path, sources=["a"], background=False) as rec:       # the retry, without overwrite=
        rec.record(step=0, source="a", loss=1.0, grads={"w": np.ones((3, 2), np.float32)})
    assert gf.open_store(path).n_records == 1


def test_a_recorder_that_fails_after_a_record_keeps_what_it_committed(tmp_path):
    path = tmp_path / "s.zarr"
    with pytest.raises(RuntimeError, match="the loop broke"), gf.Recorder(path, sources=["a"], background=False) as rec:
        rec.record(step=0, source="a", loss=1.0, grads={"w": np.ones((3, 2), np.float32)})
        raise RuntimeError("the loop broke")
    assert gf.open_store(path).n_records == 1


def test_an_hdf5_store_being_written_is_said_to_be_written_not_to_be_no_hdf5_file(writer, capsys, tmp_path):
    """Issue 42: HDF5 locks the file it writes; readers said "not an HDF5 file (unable to lock file)"."""
    from gradforensics.errors import StoreLockedError

    path, p = writer("dump.h5", k=6, per_chunk=4)
    for argv in (["inspect", path], ["analyze", path, "--out", str(tmp_path / "rep"), "--quiet"]):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert f"{path}: being written by another process (host " in lines[0] and f"pid {p.pid}, since " in lines[0]
        assert "not an HDF5 file" not in lines[0] and "unable to lock" not in lines[0], lines[0]
    with pytest.raises(StoreLockedError, match="being written by another process"):
        gf.Store(path)
    _kill(p)                                   # the writer gone, HDF5's lock goes with it: the file opens
    assert gf.Store(path).n_records == 4
