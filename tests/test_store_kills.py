"""Writers killed where it hurts, and imports that fail early: every store left behind opens or is gone.

Real processes (``python -m gradforensics import ...``, a Recorder in a child) held still
at a named point by :mod:`gradforensics.store.pause` and killed there with SIGKILL:

* at the creation of a store (issue 42: a kill between writing the root ``zarr.json`` and
  its ``gradforensics`` attribute left a directory ``inspect`` called "not a gradforensics
  store" and that ``--overwrite`` refused for good);
* at record 24 of an import of 60 (issue 42: it kept 0 records, and the HDF5 file did not open);

and imports refused before their first record (a payload in a later checkpoint, a
checkpoint with other tensors, a truncated one): the store they had created is removed,
so the rerun on the fixed source needs no ``--overwrite``.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradforensics.errors import MissingArrayError  # noqa: E402
from gradforensics.store.pause import ENV_AT, ENV_FILE  # noqa: E402
from gradforensics.store.reader import Store  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 6, generator=g), "v": torch.randn(5, 4, generator=g), "b": torch.randn(6, generator=g)}


def _series(d: Path, n: int) -> Path:
    d.mkdir(parents=True)
    for s in range(n):
        torch.save({"model": _weights(s)}, d / f"step_{s}.pt")
    return d


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``gradforensics ARGV`` in a child process."""
    return subprocess.run([sys.executable, "-m", "gradforensics", *argv], capture_output=True, text=True,
                          env=ENV, timeout=300)


def _main(capsys, *argv: str) -> tuple[int, str]:
    """``gradforensics ARGV`` in this process (the reruns: a child costs a torch import): exit code, stderr."""
    from gradforensics.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def _killed_at(point: str, argv: list[str], tmp_path: Path) -> None:
    """Run *argv* (a Python command line) until it pauses at *point*, then SIGKILL it."""
    flag = tmp_path / "paused"
    child = subprocess.Popen(argv, env={**ENV, ENV_AT: point, ENV_FILE: str(flag)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not flag.exists():
        if child.poll() is not None:
            raise AssertionError(f"the child ended before {point}: {child.stderr.read() if child.stderr else ''}")
        assert time.monotonic() < deadline, f"the child never reached {point}"
        time.sleep(0.005)
    assert int(flag.read_text()) == child.pid
    child.send_signal(signal.SIGKILL)
    child.wait()
    if child.stderr:
        child.stderr.close()


def _import(source: Path, out: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "gradforensics", "import", str(source), "--out", str(out), "--quiet", *more]


# ------------------------------------------------------------------ killed at creation
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_import_killed_as_it_creates_the_store(tmp_path, capsys, suffix):
    src = _series(tmp_path / "series", 3)
    out = tmp_path / f"out{suffix}"
    _killed_at("store-created", _import(src, out), tmp_path)
    code, err = _main(capsys, "inspect", str(out))     # the store has its identity and says what it is
    assert code == 2 and err.count("\n") == 1, err
    assert "holds no record" in err and "--overwrite" in err, err
    with pytest.warns(UserWarning, match="stale writer lock"):
        code, err = _main(capsys, "import", str(src), "--out", str(out), "--quiet", "--overwrite")
    assert code == 0, err
    assert Store(out).n_records == 2


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_import_killed_before_the_store_is_in_place(tmp_path, capsys, suffix):
    src = _series(tmp_path / "series", 3)
    out = tmp_path / f"out{suffix}"
    _killed_at("store-creating", _import(src, out), tmp_path)
    assert not out.exists()                       # nothing at the path: the rerun needs no --overwrite
    assert [p.name for p in tmp_path.glob(f".{out.name}.creating-*")]        # what the killed writer left
    with pytest.warns(UserWarning, match="stale writer lock"):
        code, err = _main(capsys, "import", str(src), "--out", str(out), "--quiet")
    assert code == 0, err
    assert Store(out).n_records == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["paused", "series", out.name])   # nothing left over


RECORDER = """
import sys, numpy as np, gradforensics as gf
with gf.Recorder(sys.argv[1], sources=["a"]) as rec:
    rec.record(source="a", grads={"w": np.ones((4, 3), np.float32)})
"""


def test_recorder_killed_as_it_creates_the_store(tmp_path):
    import gradforensics as gf

    out = tmp_path / "rec.zarr"
    _killed_at("store-created", [sys.executable, "-c", RECORDER, str(out)], tmp_path)
    with pytest.raises(MissingArrayError, match="holds no record"):
        Store(out)
    with pytest.warns(UserWarning, match="stale writer lock"), gf.Recorder(out, sources=["a"], overwrite=True) as rec:
        rec.record(source="a", grads={"w": np.ones((4, 3), np.float32)})
    assert Store(out).n_records == 1


def test_an_empty_zarr_group_left_by_an_older_writer_is_replaced_with_overwrite(tmp_path, capsys):
    import zarr

    src = _series(tmp_path / "series", 3)
    out = tmp_path / "out.zarr"
    zarr.open_group(str(out), mode="w", zarr_format=3)    # what a kill left before the identity was written
    code, err = _main(capsys, "import", str(src), "--out", str(out), "--quiet")
    assert code == 2 and "already exists" in err, err
    code, err = _main(capsys, "import", str(src), "--out", str(out), "--quiet", "--overwrite")
    assert code == 0, err
    assert Store(out).n_records == 2


# ------------------------------------------------------------------ killed mid-import
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_import_killed_at_record_24_of_60_keeps_24(tmp_path, capsys, suffix):
    src = _series(tmp_path / "series", 61)
    out = tmp_path / f"out{suffix}"
    _killed_at("import-record:24", _import(src, out), tmp_path)
    code, err = _main(capsys, "inspect", str(out))
    assert code == 0, err
    store = Store(out)
    assert store.n_records == 24
    np.testing.assert_array_equal(store.batches()["step"], np.arange(1, 25))
    w = store.grad("w").compute()
    for i in range(24):
        np.testing.assert_array_equal(w[i], (_weights(i + 1)["w"] - _weights(i)["w"]).numpy())


# ------------------------------------------------------------------ refused before the first record
class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payload(d: Path) -> None:
    (d / "step_1.pt").write_bytes(pickle.dumps(Payload(d.parent / "PWNED"), protocol=2))


def _other_tensors(d: Path) -> None:
    torch.save({"model": {"v": _weights(1)["v"]}}, d / "step_1.pt")


def _truncated(d: Path) -> None:
    raw = (d / "step_1.pt").read_bytes()
    (d / "step_1.pt").write_bytes(raw[: len(raw) // 2])


@pytest.mark.parametrize(("damage", "says", "suffix"), [
    (_payload, "refused to unpickle", ".zarr"),
    (_other_tensors, "tensor w is missing", ".h5"),
    (_truncated, "step_1.pt", ".zarr"),
])
def test_an_import_refused_before_its_first_record_leaves_no_store(tmp_path, capsys, damage, says, suffix):
    src = _series(tmp_path / "series", 3)
    out = tmp_path / f"out{suffix}"
    damage(src)
    refused = _cli("import", str(src), "--out", str(out), "--quiet")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and says in lines[0], refused.stderr
    assert not out.exists()
    assert not (tmp_path / "PWNED").exists()
    torch.save({"model": _weights(1)}, src / "step_1.pt")       # the source fixed: the rerun just works
    code, err = _main(capsys, "import", str(src), "--out", str(out), "--quiet")
    assert code == 0, err
    assert Store(out).n_records == 2


def test_only_provable_staging_leftovers_are_removed(tmp_path):
    from gradforensics.store.staging import clear_staged

    out = tmp_path / "out.zarr"
    ours = tmp_path / ".out.zarr.creating-123"
    ours.mkdir()
    (ours / "zarr.json").write_text("{}")
    (ours / "zarr.0123abcd.partial").write_text("")
    h5 = tmp_path / ".out.zarr.creating-77"
    h5.write_bytes(b"\x89HDF")
    theirs = tmp_path / ".out.zarr.creating-456"       # holds something a staging store never holds
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    other = tmp_path / ".out.zarr.creating-x"            # not a pid
    other.write_text("mine")
    link = tmp_path / ".out.zarr.creating-9"
    link.symlink_to(theirs)
    assert sorted(p.name for p in clear_staged(out)) == [".out.zarr.creating-123", ".out.zarr.creating-77"]
    assert (theirs / "notes.txt").exists() and other.exists() and link.is_symlink()


def test_a_megatron_import_refused_before_its_first_record_leaves_no_store(tmp_path):
    from test_import_megatron import LAYOUTS, reference, write_dump

    lay = LAYOUTS["tp2_pp2"]
    save = tmp_path / "save"
    write_dump(save, lay, {it: reference(lay, it) for it in (1, 2)})
    write_dump(save, lay, {it: reference(lay, it) for it in (1, 2)}, kind="params")
    (save / "params" / "iter_0000001" / "mp_rank_01_001.pth").unlink()     # the first record's weights: a rank lost
    out = tmp_path / "mg.h5"
    refused = _cli("import", str(save), "--format", "megatron", "--gated-mlp", "--out", str(out), "--quiet")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "mp_rank_01_001.pth is missing" in lines[0], refused.stderr
    assert not out.exists()


def test_a_store_holding_zarrs_temporary_file_of_a_killed_commit_is_replaced(tmp_path):
    import gradforensics as gf

    out = tmp_path / "rec.zarr"
    for _ in range(2):
        with gf.Recorder(out, sources=["a"], overwrite=True) as rec:
            rec.record(source="a", grads={"w": np.ones((4, 3), np.float32)})
        # what a kill inside zarr's write of a zarr.json leaves beside it
        (out / "zarr.0123456789abcdef0123456789abcdef.partial").write_text("{")
        (out / "grads" / "w" / "zarr.fedcba9876543210fedcba9876543210.partial").write_text("{")
        assert Store(out).n_records == 1
