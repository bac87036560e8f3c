"""A write the machine refuses (issue 42): one line naming the store and the records it keeps.

The refusals are real, made by the kernel in the real write path (zarr's chunk writes):

* a full disk: a 1 MiB ``tmpfs`` mounted in a user and mount namespace of its own
  (``unshare -rm``, no privilege needed where user namespaces are enabled; skipped where
  they are not), the writer run inside it, so ``write()`` fails with ``ENOSPC``
  (``capture --force`` on it: tests/test_capture_cli.py);
* a file-size limit: ``RLIMIT_FSIZE`` set in the writer's process (``SIGXFSZ`` ignored),
  so a chunk file past the limit fails with ``EFBIG``; it runs everywhere.

No hook fakes the error: what zarr raises on a full disk is what the writer turns into
its line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_RECORD = """
import json, sys
import numpy as np
import gradforensics as gf
from gradforensics.store.reader import open_store
path, n = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:                                  # a file-size limit, not a full disk
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
out = {}
try:
    with gf.Recorder(path, sources=["a"], records_per_chunk=4) as rec:
        for i in range(n):
            g = np.random.default_rng(i).random((64, 256), dtype=np.float32)
            g[0, 0] = i                                    # which record it is, read back below
            rec.record(loss=1.0, source="a", grads={"w": g})
except Exception as exc:
    out = {"type": type(exc).__name__, "gf": isinstance(exc, gf.errors.GradforensicsError),
           "oserror": isinstance(exc, OSError), "line": str(exc)}
try:
    store = open_store(path)
    out["kept"] = store.n_records
    out["values"] = [float(v) for v in store.grad("w")[:, 0, 0].compute()]
except gf.errors.NotAStoreError:
    out["kept"] = None
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _namespaces_work(mnt: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def _on_a_full_disk(mnt: Path, size: str, *argv: str) -> subprocess.CompletedProcess:
    """Run *argv* with a *size* tmpfs mounted at *mnt*, in namespaces of its own (gone when it exits)."""
    mnt.mkdir(exist_ok=True)
    if not _namespaces_work(mnt):
        pytest.skip("no user and mount namespaces here (unshare -rm): no tmpfs to fill")
    cmd = " ".join(f"'{a}'" for a in argv)
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && {cmd}"],
                          capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.parametrize("suffix", ["zarr", "h5"])
def test_a_full_disk_is_one_error_naming_the_store_and_what_it_keeps(tmp_path, suffix):
    """HDF5 before issue 42's last fix: the refused write left the file damaged ("address of object past end of
    allocation": it no longer opened) and the process segfaulted at exit.  Now an HDF5 write first checks the
    room it needs (with 1 MiB for the metadata its close writes) and is refused before a byte is written."""
    mnt = tmp_path / "disk"
    path = f"{mnt}/dump.{suffix}"
    r = _on_a_full_disk(mnt, "4m", sys.executable, "-c", _RECORD, path, "200")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "WriteRefusedError" and out["gf"] and out["oserror"], out
    kept = out["kept"]
    assert kept and kept % 4 == 0 and out["values"] == list(range(kept))      # whole flushes, in order
    assert out["line"] == (f"{path}: writing records {kept}-{kept + 3} failed: the machine refused a write (No "
                           f"space left on device); it keeps the {kept} records committed before it. Free space "
                           "on its disk (or choose another path) and record again."), out["line"]
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("suffix", ["zarr", "h5"])
def test_a_file_size_limit_is_one_error_and_leaves_no_empty_store(tmp_path, suffix):
    """HDF5 before: h5py's ``RuntimeError: Can't decrement id ref count (... File too large)``, not a
    gradforensics error."""
    path = tmp_path / f"dump.{suffix}"
    r = subprocess.run([sys.executable, "-c", _RECORD, str(path), "12", str(32 * 1024)], capture_output=True,
                       text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "WriteRefusedError", out
    assert out["line"] == (f"{path}: writing records 0-3 failed: the machine refused a write (File too large); "
                           "no record was committed before it. Free space on its disk (or choose another path) "
                           "and record again."), out["line"]
    assert out["kept"] is None and not path.exists()          # the failed `with` removed its empty store
    assert not Path(f"{path}.lock").exists()


def test_an_hdf5_store_under_a_file_size_limit_keeps_its_committed_records(tmp_path):
    """A limit reached after some flushes: the refused flush is said in one line, the file opens with the flushes
    committed before it (before: h5py's RuntimeError and nothing kept)."""
    path = tmp_path / "dump.h5"
    r = subprocess.run([sys.executable, "-c", _RECORD, str(path), "200", str(2_000_000)], capture_output=True,
                       text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "WriteRefusedError", out
    kept = out["kept"]
    assert kept and kept % 4 == 0 and out["values"] == list(range(kept)), out
    assert out["line"].endswith(f"the machine refused a write (File too large); it keeps the {kept} records "
                                "committed before it. Free space on its disk (or choose another path) and record "
                                "again."), out["line"]
    assert "Traceback" not in r.stderr, r.stderr
