"""Hostile and damaged stores (issue 10): every verb succeeds or says one line, and never blames training.

Contract (docs: DESIGN.md, "Store safety" and "CLI"): on any damaged or hostile
store, ``inspect``, ``analyze`` and ``report`` exit 0 or exit 2 with exactly one
line on stderr - never a traceback, never a hang, never a big allocation, never
a write outside ``--out`` (and the store's own ``analysis/``), never a finding
that blames training for damage.  The ``Recorder`` refuses to clobber what is
not its own, refuses a second writer, and refuses unsafe names at ``record()``.

Every store is built here from scratch with the public Recorder; see ``_hostile.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _hostile import (
    ACT,
    HEADS,
    MB,
    SOURCES,
    assert_error_line,
    assert_no_nonfinite,
    assert_ok_or_error_line,
    build_store,
    child_command,
    child_env,
    diff,
    dump_json,
    edit_root_meta,
    grads_of,
    load_json,
    lock_path,
    run_cli,
    set_array_attr,
    snapshot,
)

import gradforensics as gf
from gradforensics.errors import GradforensicsError, StoreExistsError, StoreLockedError, UnsafeNameError
from gradforensics.store.reader import Store

BOTH = pytest.mark.parametrize("suffix", [".zarr", ".h5"])
N = 12          # records of the analysed base store
RSS_GROWTH = 300 * MB


def copy_store(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copy2(src, dst)
    return dst


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One analysed store per backend (12 records, a head-split tensor, activations, weights)."""
    base = tmp_path_factory.mktemp("analysed")
    out = {}
    for suffix in (".zarr", ".h5"):
        p = build_store(base / f"base{suffix}", N, activations=True, weights_every=4, sketch=8)
        res = run_cli(["analyze", str(p), "--out", str(base / f"out{suffix}"), "--quiet"], timeout=120)
        assert res.rc == 0, f"the valid base store does not analyse: {res}"
        assert Store(p).has("analysis/findings")
        out[suffix] = p
    return out


def fresh(analysed: dict[str, Path], tmp_path: Path, suffix: str) -> Path:
    """A private copy of the analysed base store."""
    return copy_store(analysed[suffix], tmp_path / f"dump{suffix}")


def verbs(store: Path, tmp_path: Path, which: tuple[str, ...] = ("inspect", "analyze", "report"),
          timeout: float = 30) -> dict[str, Any]:
    """Run each verb on *store* (``--out`` inside *tmp_path*); every result must be 0 or one error line."""
    results = {}
    for verb in which:
        argv = [verb, str(store)]
        if verb != "inspect":
            argv += ["--out", str(tmp_path / f"out-{verb}")]
        if verb == "analyze":
            argv.append("--quiet")
        res = run_cli(argv, timeout=timeout)
        assert_ok_or_error_line(res)
        results[verb] = res
    return results


def read_all(store: Path) -> dict[str, np.ndarray]:
    s = Store(store)
    return {t: s.grad(t).compute(scheduler="sync") for t in s.grads}


# =====================================================================================
# Recorder: never clobber what is not a gradforensics store; overwrite=False by default
# =====================================================================================
def _foreign(tmp_path: Path, suffix: str, kind: str) -> Path:
    """Something at a store-like path that is not a gradforensics store."""
    p = tmp_path / f"mydata{suffix}"
    if suffix == ".zarr":
        p.mkdir()
        (p / "README.txt").write_text("my thesis data, no backup\n")
        if kind == "foreign-store":   # a Zarr group of someone else's, next to the README
            import zarr

            g = zarr.open_group(p, mode="a", zarr_format=3)
            g.create_array("important", shape=(3,), dtype="f4")[:] = [1, 2, 3]
    elif kind == "foreign-store":     # an HDF5 file of someone else's
        import h5py

        with h5py.File(p, "w") as f:
            f["important"] = np.arange(3.0)
            f.attrs["owner"] = "not gradforensics"
    else:
        p.write_text("my thesis data, no backup\n")
    return p


def _content(p: Path) -> dict[str, bytes]:
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


@BOTH
@pytest.mark.parametrize("kind", ["plain", "foreign-store"])
def test_recorder_never_deletes_what_is_not_a_store(tmp_path: Path, suffix: str, kind: str) -> None:
    p = _foreign(tmp_path, suffix, kind)
    before = _content(p)
    with pytest.raises(StoreExistsError, match=re.escape(p.name)):
        gf.Recorder(p, sources=["a"])
    assert _content(p) == before, "a refused Recorder touched the existing data"
    # overwrite=True still refuses: it is not a gradforensics store
    with pytest.raises(GradforensicsError, match=re.escape(p.name)):
        rec = gf.Recorder(p, sources=["a"], overwrite=True, background=False)
        rec.record(source="a", grads={"w": np.ones(3, np.float32)})
        rec.close()
    assert p.exists() and _content(p) == before, "overwrite=True deleted or changed data that is not a store"


@BOTH
def test_overwrite_true_replaces_a_gradforensics_store(tmp_path: Path, suffix: str) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    build_store(p, 3, seed=1, overwrite=True)
    s = Store(p)
    assert s.n_records == 3
    np.testing.assert_array_equal(s.grad("mlp.up").compute(scheduler="sync"),
                                  np.stack([grads_of(i, 1)["mlp.up"] for i in range(3)]))


@BOTH
def test_existing_store_is_refused_by_default(tmp_path: Path, suffix: str) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    before = read_all(p)
    with pytest.raises(StoreExistsError, match=re.escape(p.name)):
        gf.Recorder(p, sources=list(SOURCES))
    after = read_all(p)
    assert Store(p).n_records == 8 and before.keys() == after.keys()
    for t in before:
        np.testing.assert_array_equal(after[t], before[t])


# =====================================================================================
# One writer per store
# =====================================================================================
@BOTH
def test_second_recorder_in_process_is_locked_out(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"dump{suffix}"
    rec = gf.Recorder(p, sources=list(SOURCES), heads=HEADS, background=False, records_per_chunk=1)
    try:
        for i in range(3):
            rec.record(step=i, source=SOURCES[i % 2], grads=grads_of(i))
        lock = lock_path(p)
        assert lock.is_file(), f"no sidecar lock {lock.name} while a Recorder holds the store"
        held = json.loads(lock.read_text())
        assert held.get("host") == socket.gethostname() and held.get("pid") == os.getpid(), held
        with pytest.raises(StoreLockedError, match=re.escape(f"{p} is being written by another process")) as info:
            gf.Recorder(p, sources=list(SOURCES), overwrite=True, background=False)
        msg = str(info.value)
        assert socket.gethostname() in msg and str(os.getpid()) in msg, f"holder not named: {msg!r}"
        for i in range(3, 8):
            rec.record(step=i, source=SOURCES[i % 2], grads=grads_of(i))
    finally:
        rec.close()
    s = Store(p)
    assert s.n_records == 8
    np.testing.assert_array_equal(s.grad("mlp.up").compute(scheduler="sync"),
                                  np.stack([grads_of(i)["mlp.up"] for i in range(8)]))
    assert not lock_path(p).exists(), "close() left the lock behind"
    # released: a new writer takes the store without a stale-lock warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gf.Recorder(p, sources=list(SOURCES), overwrite=True, background=False).close()


def _start_writer(p: Path, min_records: int, stop_on_stdin: bool = True) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen(child_command("slow_writer", str(p), min_records, 0.05, stop_on_stdin),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith("READY"):
        child.kill()
        _, err = child.communicate(timeout=30)
        pytest.fail(f"writer process did not start: {line!r} {err[-2000:]}")
    return child, int(line.split()[1])


@pytest.mark.slow
@BOTH
def test_second_process_is_locked_out(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"dump{suffix}"
    writer, pid = _start_writer(p, min_records=3)
    try:
        other = subprocess.run(child_command("try_open", str(p)), capture_output=True, text=True, timeout=120,
                               env=child_env())
        writer.stdin.write("stop\n")  # type: ignore[union-attr]
        writer.stdin.flush()  # type: ignore[union-attr]
        out, err = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert other.returncode == 3, (f"second writer process was not refused with StoreLockedError: "
                                   f"rc={other.returncode} out={other.stdout!r} err={other.stderr[-1500:]!r}")
    assert str(pid) in other.stdout and socket.gethostname() in other.stdout, other.stdout
    assert writer.returncode == 0, f"the first writer failed: {err[-2000:]}"
    n = int(out.split()[-1])
    s = Store(p)
    assert s.n_records == n >= 3
    np.testing.assert_array_equal(s.grad("mlp.up").compute(scheduler="sync"),
                                  np.stack([grads_of(i)["mlp.up"] for i in range(n)]))
    np.testing.assert_array_equal(s.batches()["step"], np.arange(n))


@pytest.mark.slow
@BOTH
def test_stale_lock_of_killed_writer_is_taken_over_with_warning(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"dump{suffix}"
    writer, pid = _start_writer(p, min_records=2, stop_on_stdin=False)
    os.kill(pid, signal.SIGKILL)
    writer.wait(timeout=60)
    lock = lock_path(p)
    assert lock.is_file(), "a killed writer should leave its sidecar lock behind"
    assert json.loads(lock.read_text()).get("pid") == pid
    with pytest.warns(Warning, match=re.compile("lock", re.IGNORECASE)) as rec_warnings:
        rec = gf.Recorder(p, sources=list(SOURCES), heads=HEADS, overwrite=True, background=False)
    assert any(str(pid) in str(w.message) for w in rec_warnings), [str(w.message) for w in rec_warnings]
    for i in range(3):
        rec.record(step=i, source=SOURCES[i % 2], grads=grads_of(i, 5))
    rec.close()
    s = Store(p)
    assert s.n_records == 3
    np.testing.assert_array_equal(s.grad("mlp.up").compute(scheduler="sync"),
                                  np.stack([grads_of(i, 5)["mlp.up"] for i in range(3)]))
    assert not lock.exists()


# =====================================================================================
# Links: nothing is read or written through a link inside a store
# =====================================================================================
@BOTH
def test_analysis_link_to_outside_is_refused(tmp_path: Path, suffix: str) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel.txt").write_text("do not touch\n")
    if suffix == ".zarr":
        os.symlink(outside, p / "analysis", target_is_directory=True)
    else:   # the HDF5 form of a link out of the store: an external link to another file
        import h5py

        target = outside / "victim.h5"
        with h5py.File(target, "w") as f:
            f["sentinel"] = np.arange(4)
        with h5py.File(p, "r+") as f:
            f["analysis"] = h5py.ExternalLink(str(target), "/")
    before = snapshot(outside)
    sentinel = {f.name: f.read_bytes() for f in outside.iterdir()}
    res = run_cli(["analyze", str(p), "--out", str(tmp_path / "out"), "--quiet"], timeout=60)
    assert_error_line(res)
    assert diff(before, snapshot(outside)) == [], "analyze wrote through the link"
    assert {f.name: f.read_bytes() for f in outside.iterdir()} == sentinel


def _link_inside(p: Path, where: str, outside: Path) -> None:
    """Move *where* (inside the store) to *outside* and leave a link to it in its place."""
    if p.suffix == ".zarr":
        src = p / where
        dst = outside / where.replace("/", "__")
        shutil.move(src, dst)
        os.symlink(dst, src, target_is_directory=dst.is_dir())
    else:
        import h5py

        target = outside / "elsewhere.h5"
        with h5py.File(p, "r+") as f, h5py.File(target, "a") as g:
            f.copy(f[where], g, name="moved")
            del f[where]
            f[where] = h5py.ExternalLink(str(target), "/moved")


@pytest.mark.parametrize(("suffix", "where"), [
    (".zarr", "grads/mlp.up/c"),            # a chunk directory
    (".zarr", "grads/mlp.up/c/1/0/0"),      # one chunk file
    (".zarr", "grads/mlp.up/zarr.json"),    # an array's metadata
    (".zarr", "grads/attn.q"),              # a whole array
    (".zarr", "batches"),                   # a whole group
    (".h5", "grads/mlp.up"),                # HDF5 external link to a dataset in another file
])
def test_link_inside_store_is_refused(tmp_path: Path, suffix: str, where: str) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    outside = tmp_path / "outside"
    outside.mkdir()
    _link_inside(p, where, outside)
    before = snapshot(outside)
    for verb in ("inspect", "analyze"):
        argv = [verb, str(p)] + (["--out", str(tmp_path / "out"), "--quiet"] if verb == "analyze" else [])
        assert_error_line(run_cli(argv, timeout=60))
    assert diff(before, snapshot(outside)) == []


# =====================================================================================
# Inflated shapes: refused at open, at once, without allocating
# =====================================================================================
def _inflate_zarr(p: Path, array: str, shape: list[int] | None, chunks: list[int] | None) -> None:
    meta_path = p / array / "zarr.json"
    doc = load_json(meta_path)
    if shape is not None:
        doc["shape"] = shape
    if chunks is not None:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    dump_json(meta_path, doc)


def _inflate_h5(p: Path, array: str, shape: list[int], chunks: list[int]) -> None:
    """Replace *array* by a sparse dataset of a huge declared shape (HDF5 allows it: unwritten chunks cost nothing).

    The real rows are copied into its corner when the chunks are small, so only the declared shape lies.
    """
    import h5py

    with h5py.File(p, "r+") as f:
        ds = f[array]
        attrs, data = dict(ds.attrs), ds[()]
        del f[array]
        new = f.create_dataset(array, shape=tuple(shape), dtype=data.dtype, chunks=tuple(chunks),
                               maxshape=(None,) * len(shape), fletcher32=True)
        if int(np.prod(chunks)) * data.dtype.itemsize <= MB:
            new[tuple(slice(0, n) for n in data.shape)] = data
        for k, v in attrs.items():
            new.attrs[k] = v


# (backend, array, shape, chunk shape, must be refused); an over-long record axis alone is what a killed
# writer leaves (readers ignore rows past n_records), so it may open, but at once and without allocating.
INFLATED = [
    (".zarr", "grads/mlp.up", [8, 80000, 60000], None, True),
    (".zarr", "grads/mlp.up", [24, 10**9, 10**9], None, True),
    (".zarr", "grads/attn.q", [8, 4, 10**9, 10**9], None, True),
    (".zarr", "grads/mlp.up", None, [4, 80000, 60000], True),
    (".zarr", "grads/mlp.up", None, [10**9, 10**9, 10**9], True),
    (".zarr", "batches/mixture", [8, 10**9], None, True),
    (".zarr", "batches/loss", [10**12], None, False),
    (".h5", "grads/mlp.up", [8, 80000, 60000], [4, 12, 8], True),
    (".h5", "grads/mlp.up", [24, 10**9, 10**9], [4, 12, 8], True),
    (".h5", "grads/mlp.up", [8, 12, 8], [4, 10000, 10000], True),
    (".h5", "batches/loss", [10**12], [4], False),
]


@pytest.mark.parametrize(("suffix", "array", "shape", "chunks", "must_fail"), INFLATED,
                         ids=[f"{s[1:]}-{a}-" + (f"shape={'x'.join(map(str, sh))}" if sh else "") + ("-" if sh and c else "")
                              + (f"chunks={'x'.join(map(str, c))}" if c else "") for s, a, sh, c, _ in INFLATED])
def test_inflated_shape_is_refused_at_once(tmp_path: Path, suffix: str, array: str, shape: list[int] | None,
                                           chunks: list[int] | None, must_fail: bool) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    if suffix == ".zarr":
        _inflate_zarr(p, array, shape, chunks)
    else:
        assert shape is not None and chunks is not None
        _inflate_h5(p, array, shape, chunks)
    for verb in ("inspect", "analyze"):
        argv = [verb, str(p)] + (["--out", str(tmp_path / "out"), "--quiet"] if verb == "analyze" else [])
        res = run_cli(argv, timeout=5 if must_fail or verb == "inspect" else 60)  # "at once": a hang fails here
        if must_fail:
            assert_error_line(res)
        else:
            assert_ok_or_error_line(res)
        assert res.rss_growth < RSS_GROWTH, f"{verb}: peak RSS grew by {res.rss_growth / MB:.0f} MB"


# =====================================================================================
# Damaged chunks: an error naming the tensor and records, never a `nonfinite` finding
# =====================================================================================
def _damage_chunk(p: Path, tensor: str, first_record: int) -> None:
    """Overwrite the middle of the on-disk chunk of *tensor* holding *first_record* with garbage (incl. NaN bits)."""
    rng = np.random.default_rng(7)
    garbage = b"\xff" * 16 + rng.bytes(32) + b"\xff" * 16
    head = () if tensor == "mlp.up" else (2,)             # the head-split tensor: damage the chunk holding head 2
    if p.suffix == ".zarr":
        import zarr

        chunks = zarr.open_array(str(p / "grads" / tensor), mode="r").chunks
        where = (first_record, *head) + (0,) * (len(chunks) - 1 - len(head))
        chunk = p.joinpath("grads", tensor, "c", *(str(i // c) for i, c in zip(where, chunks, strict=True)))
        size = chunk.stat().st_size
        offset = size // 2 - len(garbage) // 2
    else:
        import h5py

        with h5py.File(p, "r") as f:
            ds = f[f"grads/{tensor}"]
            infos = [ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())]
            chunks = ds.chunks
        where = (first_record, *head) + (0,) * (len(chunks) - 1 - len(head))
        want = tuple(i // c * c for i, c in zip(where, chunks, strict=True))
        info = next(i for i in infos if tuple(i.chunk_offset) == want)
        chunk, size = p, info.size
        offset = info.byte_offset + size // 2 - len(garbage) // 2
    assert size > len(garbage)
    with open(chunk, "r+b") as fh:
        fh.seek(offset)
        fh.write(garbage)


@BOTH
@pytest.mark.parametrize("tensor", ["mlp.up", "attn.q"])
def test_damaged_chunk_is_an_error_naming_tensor_and_records(tmp_path: Path, suffix: str, tensor: str) -> None:
    p = build_store(tmp_path / f"dump{suffix}", 8)
    _damage_chunk(p, tensor, first_record=4)
    out = tmp_path / "out"
    res = run_cli(["analyze", str(p), "--out", str(out), "--quiet"], timeout=60)
    assert_no_nonfinite(out)
    line = assert_error_line(res)
    assert tensor in line, f"the damaged tensor is not named: {line!r}"
    assert re.search(r"records?\D{0,4}4\b", line), f"the damaged records (4-7) are not named: {line!r}"


@pytest.mark.parametrize("deleted", ["grads/zarr.json", "grads/mlp.up/zarr.json", "batches/zarr.json"])
def test_deleted_group_or_array_metadata_is_an_error(tmp_path: Path, deleted: str) -> None:
    p = build_store(tmp_path / "dump.zarr", 8)
    (p / deleted).unlink()
    for verb in ("inspect", "analyze"):
        argv = [verb, str(p)] + (["--out", str(tmp_path / "out"), "--quiet"] if verb == "analyze" else [])
        assert_error_line(run_cli(argv, timeout=60))


# =====================================================================================
# float16 storage: overflow is an error at capture, a real inf is kept
# =====================================================================================
@BOTH
def test_float16_overflow_is_refused_at_capture(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"dump{suffix}"
    with pytest.raises(GradforensicsError, match=re.escape("mlp.up")), \
            gf.Recorder(p, sources=list(SOURCES), dtype="float16", records_per_chunk=2) as rec:
        for i in range(4):
            g = grads_of(i)
            if i == 2:
                g["mlp.up"][3, 1] = 1e6       # finite in float32, inf in float16
            rec.record(step=i, source=SOURCES[i % 2], grads=g)


@BOTH
def test_float16_keeps_a_genuine_nonfinite_gradient(tmp_path: Path, suffix: str) -> None:
    """The overflow check must not refuse what training really produced: inf/NaN in, inf/NaN stored."""
    p = tmp_path / f"dump{suffix}"
    with gf.Recorder(p, sources=list(SOURCES), dtype="float16", records_per_chunk=2) as rec:
        for i in range(4):
            g = grads_of(i)
            if i == 2:
                g["mlp.up"][3, 1] = np.inf
                g["mlp.up"][0, 0] = np.nan
            rec.record(step=i, source=SOURCES[i % 2], grads=g)
    got = Store(p).grad("mlp.up").compute(scheduler="sync")
    assert np.isposinf(got[2, 3, 1]) and np.isnan(got[2, 0, 0])
    assert np.isfinite(np.delete(got.reshape(4, -1), [2], axis=0)).all()


# =====================================================================================
# Damaged metadata: one line for every verb
# =====================================================================================
def _meta(key: str, value: Any) -> Callable[[Path], None]:
    return lambda p: edit_root_meta(p, lambda m: m.__setitem__(key, value))


def _root(value: Any) -> Callable[[Path], None]:
    return lambda p: edit_root_meta(p, lambda m: value)


def _heads(value: Any) -> Callable[[Path], None]:
    return lambda p: set_array_attr(p, "grads/attn.q", "heads", value)


def _bad_json(rel: str) -> Callable[[Path], None]:
    def damage(p: Path) -> None:
        f = p / rel
        text = f.read_text()
        f.write_text(text[: len(text) // 2])   # truncated mid-document
    return damage


# name -> (backends, damage, report must refuse too); report may succeed on damage it never reads
DAMAGED: dict[str, tuple[tuple[str, ...], Callable[[Path], None], bool]] = {
    "n_records=-1": ((".zarr", ".h5"), _meta("n_records", -1), True),
    "n_records=3.7": ((".zarr", ".h5"), _meta("n_records", 3.7), True),
    "n_records='12'": ((".zarr", ".h5"), _meta("n_records", "12"), True),
    "n_records=true": ((".zarr", ".h5"), _meta("n_records", True), True),
    "n_records=1e18": ((".zarr", ".h5"), _meta("n_records", 10**18), True),
    "root-attr-list": ((".zarr", ".h5"), _root([1, 2, 3]), True),
    "root-attr-string": ((".zarr", ".h5"), _root("gradforensics"), True),
    "root-zarr.json-invalid": ((".zarr",), _bad_json("zarr.json"), True),
    "array-zarr.json-invalid": ((".zarr",), _bad_json("grads/mlp.up/zarr.json"), False),
    "heads='x'": ((".zarr", ".h5"), _heads("x"), False),
    "heads=-1": ((".zarr", ".h5"), _heads(-1), False),
    "heads=1e12": ((".zarr", ".h5"), _heads(10**12), False),
    "heads=list": ((".zarr", ".h5"), _heads([4, 4]), False),
    "heads=3-vs-axis-4": ((".zarr", ".h5"), _heads(3), False),
    "sources=[]": ((".zarr", ".h5"), _meta("sources", []), True),
    "sources-fewer-than-mixture": ((".zarr", ".h5"), _meta("sources", ["a"]), True),
    "sources-more-than-mixture": ((".zarr", ".h5"), _meta("sources", ["a", "b", "c"]), True),
    "sources-a-string": ((".zarr", ".h5"), _meta("sources", "ab"), True),
    "mode-unknown": ((".zarr", ".h5"), _meta("mode", "bogus"), True),
    "schema=2": ((".zarr", ".h5"), _meta("schema", 2), True),
}
DAMAGED_CASES = [(name, s) for name, (backends, _, _) in DAMAGED.items() for s in backends]
#: One case of each kind of damage runs in the quick lane (``-m "not slow"``), the rest with the full suite.
DAMAGED_QUICK = {"n_records=-1", "root-attr-list", "root-zarr.json-invalid", "array-zarr.json-invalid", "heads='x'",
                 "sources-fewer-than-mixture", "mode-unknown", "schema=2"}


@pytest.mark.parametrize(("case", "suffix"), [
    pytest.param(c, s, id=f"{c}-{s[1:]}", marks=() if c in DAMAGED_QUICK else pytest.mark.slow)
    for c, s in DAMAGED_CASES])
def test_damaged_metadata_is_one_line(analysed: dict[str, Path], tmp_path: Path, case: str, suffix: str) -> None:
    _, damage, report_refuses = DAMAGED[case]
    p = fresh(analysed, tmp_path, suffix)
    damage(p)
    res = verbs(p, tmp_path, ("report", "inspect", "analyze"))
    for verb in ("inspect", "analyze") + (("report",) if report_refuses else ()):
        line = assert_error_line(res[verb])
        if case == "schema=2":
            rest = line.replace(str(p), "")
            assert re.search(r"\b2\b", rest) and re.search(r"\b1\b", rest), f"both versions not named: {line!r}"
    assert_no_nonfinite(tmp_path / "out-analyze")


def _hdf5_live_offsets(p: Path) -> dict[str, int]:
    """Offsets in the middle of chunks that ``analyze`` reads (it reads no ``acts/*/hist``)."""
    import h5py

    out = {}
    with h5py.File(p, "r") as f:
        for name in ("grads/mlp.up", "grads/attn.q", "batches/mixture", "batches/step", f"acts/{ACT}/frac_high"):
            info = f[name].id.get_chunk_info(0)
            out[f"chunk:{name}"] = info.byte_offset + info.size // 2
    return out


HDF5_OFFSETS = ["frac:0.02", "frac:0.1", "frac:0.3", "frac:0.5", "frac:0.7", "frac:0.9", "frac:0.98",
                "chunk:grads/mlp.up", "chunk:grads/attn.q", "chunk:batches/mixture", "chunk:batches/step",
                f"chunk:acts/{ACT}/frac_high"]


@pytest.mark.slow
@pytest.mark.parametrize("where", HDF5_OFFSETS)
def test_random_bytes_in_hdf5_file(analysed: dict[str, Path], tmp_path: Path, where: str) -> None:
    """Garbage at an offset of the file: never a traceback; a hit on live data is an error, never a finding."""
    p = fresh(analysed, tmp_path, ".h5")
    size = p.stat().st_size
    live = _hdf5_live_offsets(p)
    offset = int(size * float(where[5:])) if where.startswith("frac:") else live[where]
    garbage = np.random.default_rng(zlib.crc32(where.encode())).bytes(48)
    with open(p, "r+b") as fh:
        fh.seek(max(0, min(offset - 24, size - len(garbage))))
        fh.write(garbage)
    res = verbs(p, tmp_path, ("report", "inspect", "analyze"))
    assert_no_nonfinite(tmp_path / "out-analyze")
    if where.startswith("chunk:"):          # live data: the checksum must catch it
        assert_error_line(res["analyze"])


# =====================================================================================
# Names: refused at record(), never silently dropped or turned into paths
# =====================================================================================
BAD_NAMES = ["", "zarr.json", "a/b", "..", "a\nb", "\x1b[31m"]
BAD_IDS = ["empty", "zarr.json", "slash", "dotdot", "newline", "ansi-escape"]


@BOTH
@pytest.mark.parametrize("name", BAD_NAMES, ids=BAD_IDS)
@pytest.mark.parametrize("where", ["grads", "activations", "weights"])
def test_unsafe_name_is_refused_at_record(tmp_path: Path, suffix: str, name: str, where: str) -> None:
    p = tmp_path / f"dump{suffix}"
    x = np.ones((4, 3), np.float32)
    kwargs: dict[str, Any] = {"grads": {"ok": x}}
    if where == "grads":
        kwargs["grads"] = {"ok": x, name: x}
    elif where == "activations":
        kwargs["activations"] = {name: x}
    else:
        kwargs["weights"] = {name: x}
    rec = gf.Recorder(p, sources=["a"])
    try:
        with pytest.raises(UnsafeNameError, match=re.escape(f"record(): {where} key {name!r} ")):
            rec.record(source="a", **kwargs)
    finally:
        rec.close()


@BOTH
@pytest.mark.parametrize("name", BAD_NAMES, ids=BAD_IDS)
def test_unsafe_source_name_is_refused(tmp_path: Path, suffix: str, name: str) -> None:
    with pytest.raises(UnsafeNameError, match=re.escape(f"source {name!r} ")):
        rec = gf.Recorder(tmp_path / f"dump{suffix}", sources=[name, "b"], background=False)
        rec.record(source=name, grads={"w": np.ones(3, np.float32)})
        rec.close()
