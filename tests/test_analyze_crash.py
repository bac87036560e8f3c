"""An ``analyze`` killed while it writes its results never leaves a store that a command refuses (issue 25).

A real ``gradforensics analyze`` process is killed by a real SIGKILL (or interrupted
by SIGINT's KeyboardInterrupt) at a chosen backend write of its results: the
first, one in the middle, just before the commit, and between the commit and
the clean-up.  Then ``inspect``, ``report`` and ``analyze`` all work, the results
read are either the last committed ones or the new ones (never a mixture), and
the rerun's flags equal those of an uninterrupted pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _hostile import build_store

from gradforensics.cli import main
from gradforensics.store.reader import Store

pytestmark = pytest.mark.slow       # every case runs `analyze` in a child process (killed, or two at once)

#: Runs analyze with the store's backend writes counted; at write number K of the
#: results (or at the commit / the clean-up) the process kills itself.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from gradforensics.store.hdf5_backend import HDF5Backend
    from gradforensics.store.zarr_backend import ZarrBackend
    mode, where, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    count = {"n": 0}

    def die():
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyboardInterrupt

    def counting(fn):
        def wrapped(self, name, *a, **kw):
            if name.startswith("analysis/"):
                count["n"] += 1
                if where == "write" and count["n"] == k:
                    die()
            return fn(self, name, *a, **kw)
        return wrapped

    def at(fn, point):
        def wrapped(self, *a, **kw):
            if where == point:
                die()
            return fn(self, *a, **kw)
        return wrapped

    for cls in (ZarrBackend, HDF5Backend):
        cls.write_rows = counting(cls.write_rows)
        cls.set_group_attr = at(cls.set_group_attr, "commit")
        cls.delete = at(cls.delete, "cleanup")
    from gradforensics.cli import main
    sys.exit(main(sys.argv[4:]))
""")


def _analyze_child(tmp: Path, store: Path, mode: str, where: str, k: int = 0) -> subprocess.CompletedProcess[str]:
    argv = ["analyze", str(store), "--out", str(tmp / f"out-{mode}-{where}-{k}"), "--quiet"]
    return subprocess.run([sys.executable, "-c", CHILD, mode, where, str(k), *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
                               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, cwd=tmp)


def _flags(out: Path) -> list[tuple[str, str, object, float]]:
    doc = json.loads((out / "flags.json").read_text())
    return [(f["kind"], f["tensor"], f["head"], round(f["severity"], 6)) for f in doc["flags"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An analysed store (first generation committed) and the flags of an uninterrupted pass."""
    root = tmp_path_factory.mktemp("crash-ref")
    out = {}
    for suffix in (".zarr", ".h5"):
        p = build_store(root / f"dump{suffix}", 12, activations=True, sketch=8)
        assert main(["analyze", str(p), "--out", str(root / f"once{suffix}"), "--quiet"]) == 0
        out[suffix] = (p, _flags(root / f"once{suffix}"))
    return out


def _all_verbs_work(tmp: Path, store: Path, want_flags: list[tuple[str, str, object, float]]) -> None:
    assert main(["inspect", str(store)]) == 0
    assert main(["report", str(store), "--out", str(tmp / "after-report")]) == 0
    assert _flags(tmp / "after-report") == want_flags       # the committed results, whole
    assert main(["analyze", str(store), "--out", str(tmp / "after-analyze"), "--quiet"]) == 0
    assert _flags(tmp / "after-analyze") == want_flags
    assert main(["report", str(store), "--out", str(tmp / "after-rerun")]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
@pytest.mark.parametrize("mode, where, k", [("kill", "write", 1), ("kill", "write", 6), ("kill", "commit", 0),
                                            ("kill", "cleanup", 0), ("interrupt", "write", 3),
                                            ("interrupt", "commit", 0)])
def test_killed_analyze_leaves_readable_results(tmp_path: Path, reference, suffix, mode, where, k) -> None:
    base, want = reference[suffix]
    store = tmp_path / f"dump{suffix}"
    (shutil.copytree if suffix == ".zarr" else shutil.copy2)(base, store)
    if where == "cleanup":      # a second committed generation, so the child's commit supersedes one to delete
        assert main(["analyze", str(store), "--out", str(tmp_path / "second"), "--quiet"]) == 0
    res = _analyze_child(tmp_path, store, mode, where, k)
    assert res.returncode == (-9 if mode == "kill" else 130), res.stderr[-2000:]
    if mode == "interrupt":
        assert res.stderr.strip().endswith("interrupted"), res.stderr
    _all_verbs_work(tmp_path, store, want)
    if suffix == ".zarr":                                    # one generation left (+ the one it replaced)
        gens = sorted(p.name for p in (store / "analysis").iterdir() if p.is_dir())
        assert 1 <= len(gens) <= 2 and all(g.startswith("gen-") for g in gens), gens


def test_half_written_results_of_the_old_layout_no_longer_brick_the_store(tmp_path: Path, reference) -> None:
    """A store whose flat analysis/ lost a chunk and a zarr.json (what an interrupted pass of an older
    version left) opens; report says it needs an analysis; analyze repairs it."""
    base, want = reference[".zarr"]
    store = tmp_path / "dump.zarr"
    shutil.copytree(base, store)
    gen = next(p for p in (store / "analysis").iterdir() if p.is_dir())
    for child in gen.iterdir():                              # back to the flat layout of earlier versions
        shutil.move(str(child), store / "analysis" / child.name)
    gen.rmdir()
    meta = json.loads((store / "analysis" / "zarr.json").read_text())
    meta["attributes"] = {}
    (store / "analysis" / "zarr.json").write_text(json.dumps(meta))
    assert Store(store).has("analysis/findings")             # the old layout reads as before
    chunks = sorted(p for p in (store / "analysis").rglob("c") if p.is_dir())
    shutil.rmtree(chunks[0])                                 # a chunk missing (saved Grams are only flagged units')...
    (store / "analysis" / "tables" / "zarr.json").unlink()   # ... and a group's metadata
    st = Store(store)
    assert not any(n.startswith("analysis/") for n in st.arrays) and "damaged" in (st.analysis_note or "")
    assert main(["inspect", str(store)]) == 0
    assert main(["report", str(store), "--out", str(tmp_path / "r")]) == 2     # one line: analyze first
    assert main(["analyze", str(store), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert _flags(tmp_path / "a") == want
    assert sorted(p.name for p in (store / "analysis").iterdir() if p.is_dir())[0].startswith("gen-")
    assert not (store / "analysis" / "gram").exists()        # the flat leftovers were removed


def test_two_analyze_at_once_both_succeed_and_the_store_reads(tmp_path: Path, reference) -> None:
    base, want = reference[".zarr"]
    store = tmp_path / "dump.zarr"
    shutil.copytree(base, store)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    procs = [subprocess.Popen([sys.executable, "-m", "gradforensics", "analyze", str(store), "--out",
                               str(tmp_path / f"o{i}"), "--quiet"], env=env, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    for i in range(2):
        assert _flags(tmp_path / f"o{i}") == want
    _all_verbs_work(tmp_path, store, want)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of a few hundred KiB (root only: CI and these machines run as root)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()

    def mount(kib: int) -> Path:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mnt)], capture_output=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()[:80]})")
        return mnt
    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def _du_kib(p: Path) -> int:
    return sum(f.stat().st_size // 4096 * 4 + 4 for f in p.rglob("*") if f.is_file()) + 4 * len(list(p.rglob("*")))


def test_a_full_disk_during_analyze_is_one_line_and_the_store_still_reads(tmp_path: Path, reference, small_disk,
                                                                          capsys) -> None:
    """The store's disk fills while analyze writes its results: exit 2, one line naming the path; every verb
    then still reads the store (its last committed results), and on a disk with room analyze repairs it."""
    base, want = reference[".zarr"]
    disk = small_disk(2 * _du_kib(base) + 512)
    store = disk / "dump.zarr"
    shutil.copytree(base, store)
    st = os.statvfs(disk)                              # leave 8 KiB: a new generation does not fit
    (disk / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - 8192, 0))
    capsys.readouterr()
    rc = main(["analyze", str(store), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err and str(disk) in err, err
    assert main(["inspect", str(store)]) == 0
    assert main(["report", str(store), "--out", str(tmp_path / "r")]) == 0
    assert _flags(tmp_path / "r") == want
    roomy = tmp_path / "roomy.zarr"
    shutil.copytree(store, roomy)
    assert main(["analyze", str(roomy), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert _flags(tmp_path / "a") == want


def test_a_full_out_directory_is_one_line(tmp_path: Path, reference, small_disk, capsys) -> None:
    base, _ = reference[".zarr"]
    store = tmp_path / "dump.zarr"
    shutil.copytree(base, store)
    out = small_disk(16)
    capsys.readouterr()
    rc = main(["report", str(store), "--out", str(out / "report")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err and str(out) in err, err


@pytest.mark.parametrize("pointer", [{"current": "../../escape"}, {"current": "gen-00000000000000000001-1-abcdef"},
                                     {"current": 7}, "gen-x", None, {"current": "gen-" + "9" * 20 + "-1-zzzzzz"}])
def test_a_hostile_generation_pointer_reads_as_not_analysed(tmp_path: Path, reference, pointer) -> None:
    """The pointer is data from someone else's store: a path, a missing generation or a wrong type selects
    nothing (never a path outside analysis/), and analyze repairs the store."""
    base, want = reference[".zarr"]
    store = tmp_path / "dump.zarr"
    shutil.copytree(base, store)
    meta_path = store / "analysis" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["gradforensics.analysis"] = pointer
    meta_path.write_text(json.dumps(meta))
    st = Store(store)
    assert not any(n.startswith("analysis/") for n in st.arrays)
    assert main(["inspect", str(store)]) == 0
    assert main(["report", str(store), "--out", str(tmp_path / "r")]) == 2
    assert main(["analyze", str(store), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert _flags(tmp_path / "a") == want
    assert all(p.parent == store / "analysis" for p in (store / "analysis").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("mode, where, k", [("kill", "write", 3), ("kill", "commit", 0), ("kill", "cleanup", 0),
                                            ("interrupt", "write", 2)])
def test_killed_analyze_on_object_storage_leaves_readable_results(tmp_path: Path, reference, mode, where, k) -> None:
    """The same on a real S3 server (moto, loopback): the generation is committed by one metadata PUT, so a
    pass killed at any write leaves the committed results readable and the rerun gives the same flags."""
    import s3fs
    from _s3 import BUCKET, moto_server

    base, want = reference[".zarr"]
    with moto_server():
        url = f"s3://{BUCKET}/crash-{mode}-{where}-{k}/dump.zarr"
        s3fs.S3FileSystem().put(str(base), url.removeprefix("s3://"), recursive=True)
        if where == "cleanup":
            assert main(["analyze", url, "--out", str(tmp_path / "second"), "--quiet"]) == 0
        res = _analyze_child(tmp_path, url, mode, where, k)          # type: ignore[arg-type]
        assert res.returncode == (-9 if mode == "kill" else 130), res.stderr[-2000:]
        s3fs.S3FileSystem.clear_instance_cache()                     # the child wrote: no stale listings here
        _all_verbs_work(tmp_path, url, want)                         # type: ignore[arg-type]
        fs = s3fs.S3FileSystem()
        gens = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://") + "/analysis", detail=False)
                      if p.rsplit("/", 1)[-1].startswith("gen-"))
        assert 1 <= len(gens) <= 2, gens


@pytest.mark.parametrize(("writing", "said"), [("analysis results", "its unfinished analysis results are discarded"),
                                               ("records", "its records in flight were lost")])
def test_a_taken_over_lock_says_what_its_holder_was_writing(tmp_path: Path, reference, writing, said) -> None:
    """A stale lock left by a killed analyze is not a capture's: the takeover names what was lost."""
    import socket

    from gradforensics.analysis.engine.run import analyze
    from gradforensics.store.lock import lock_path

    store = tmp_path / "dump.zarr"
    shutil.copytree(reference[".zarr"][0], store)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    Path(lock_path(str(store))).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout),
                                                       "started": 0.0, "lease_s": 900.0, "writing": writing}))
    with pytest.warns(UserWarning, match=f"took over a stale writer lock .*; {said}"):
        analyze(store, only="nonfinite", progress=False)
