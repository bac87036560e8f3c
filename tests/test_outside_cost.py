"""What ``analyze`` spends outside the analyses: reads without zarr's loop, imports it does not need.

The chunk files read straight (:mod:`gradforensics.store.chunkread`) give zarr's bytes (the
oracle) for every codec chain gradforensics writes, and zarr's own value or error everywhere
else; the pass over a store without activations imports neither ``dask.array`` nor
``distributed``, nor h5py to name its version.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from gradforensics.store import chunkread, handles
from gradforensics.store.backends import _zarr_codecs

CHAINS = [("none", False), ("none", True), ("zstd", False), ("zstd", True), ("bitshuffle", True)]


def _array(root: Path, name: str, data: np.ndarray, chunks: tuple[int, ...], compression: str = "zstd",
           checksum: bool = True, shape: tuple[int, ...] | None = None) -> zarr.Array:
    g = zarr.open_group(root, mode="a")
    a = g.create_array(name, shape=shape or data.shape, chunks=chunks, dtype=data.dtype, fill_value=0,
                       config={"write_empty_chunks": True}, **_zarr_codecs(compression, checksum))
    a[: data.shape[0]] = data
    return a


def _direct(root: Path, name: str, sel: tuple[slice, ...]) -> np.ndarray | None:
    meta = handles._metadata(str(root), name)
    assert meta is not None
    return chunkread.read_direct(str(root), name, meta, sel)


def _equal_read(a: np.ndarray, b: np.ndarray) -> bool:
    """What a read gave equals zarr's (the oracle): dtype, shape, layout and bytes (a read computes nothing: exact)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.flags.c_contiguous == b.flags.c_contiguous \
        and a.tobytes() == b.tobytes()


def _random_sel(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for n in shape[: rng.integers(1, len(shape) + 1)]:
        a = int(rng.integers(0, n))
        out.append(slice(a, int(rng.integers(a + 1, n + 1))) if rng.random() < 0.7 else slice(None))
    return tuple(out)


@pytest.mark.parametrize(("compression", "checksum"),                # the default chain quick, the others slow
                         [c if c == ("zstd", True) else pytest.param(*c, marks=pytest.mark.slow) for c in CHAINS])
def test_direct_reads_are_zarrs_bytes(tmp_path: Path, compression: str, checksum: bool) -> None:
    rng = np.random.default_rng(7)
    dtypes = [np.float32, np.float16, np.float64, np.uint16, np.uint8, np.int32, np.int64]
    for k in range(24):
        dtype = dtypes[k % len(dtypes)]
        shape = tuple(int(rng.integers(1, 12)) for _ in range(int(rng.integers(1, 4))))
        chunks = tuple(int(rng.integers(1, n + 3)) for n in shape)
        raw = rng.standard_normal(shape) * 100
        data = raw.astype(dtype)
        if k % 5 == 0 and np.issubdtype(dtype, np.floating):
            data.flat[:: 3] = np.nan                         # NaN and inf are bytes like any other
            data.flat[1:: 7] = np.inf
        name = f"a{k}"
        a = _array(tmp_path, name, data, chunks, compression, checksum)
        for _ in range(6):
            sel = _random_sel(rng, shape)
            got = _direct(tmp_path, name, sel)
            assert got is not None, (shape, chunks, sel)
            assert _equal_read(got, np.asarray(a[sel])), (shape, chunks, sel)


def test_what_is_not_read_here_goes_to_zarr(tmp_path: Path) -> None:
    data = np.arange(40, dtype=np.float32).reshape(8, 5)
    _array(tmp_path, "ok", data, (4, 5))
    assert _equal_read(_direct(tmp_path, "ok", (slice(0, 8),)), data)
    # a chunk missing (zarr gives its fill value), a failed checksum, a truncated chunk: zarr reads them
    _array(tmp_path, "gone", data, (4, 5))
    os.remove(tmp_path / "gone" / "c" / "1" / "0")
    assert _direct(tmp_path, "gone", (slice(0, 8),)) is None
    assert _direct(tmp_path, "gone", (slice(0, 4),)) is not None      # the chunks it needs are there
    for how in ("flip", "cut"):
        _array(tmp_path, how, data, (4, 5))
        f = tmp_path / how / "c" / "0" / "0"
        b = bytearray(f.read_bytes())
        if how == "flip":
            b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b) if how == "flip" else bytes(b[:-9]))
        assert _direct(tmp_path, how, (slice(0, 8),)) is None
    # codecs gradforensics does not write, selections that are not plain slices
    g = zarr.open_group(tmp_path, mode="a")
    g.create_array("gz", shape=(8, 5), chunks=(4, 5), dtype="float32", compressors=[zc.GzipCodec()])[:] = data
    assert _direct(tmp_path, "gz", (slice(0, 8),)) is None
    assert _direct(tmp_path, "ok", (slice(0, 8, 2),)) is None
    assert _direct(tmp_path, "ok", (slice(3, 3),)) is None


def test_read_zarr_many_mixes_both_ways(tmp_path: Path) -> None:
    """Arrays read here and arrays zarr must read, in one call: every value in its place, zarr's where it
    reads (a missing chunk as its fill value), a damaged chunk still zarr's error."""
    rng = np.random.default_rng(3)
    reads, want = [], []
    for k in range(12):
        data = rng.standard_normal((6, 4)).astype(np.float32)
        a = _array(tmp_path, f"m{k}", data, (4, 4), shape=(8, 4))
        if k % 3 == 1:
            os.remove(tmp_path / f"m{k}" / "c" / "1" / "0")
        if k % 4 == 2:
            g = zarr.open_group(tmp_path, mode="a")
            g.create_array(f"m{k}", shape=(8, 4), chunks=(4, 4), dtype="float32", overwrite=True,
                           compressors=[zc.GzipCodec()])[:6] = data
            a = g[f"m{k}"]
        reads.append((str(tmp_path), f"m{k}", (slice(0, 8), slice(0, 4))))
        want.append(np.asarray(a[:8]))
    got = handles.read_zarr_many(reads)
    assert len(got) == len(want) and all(_equal_read(x, y) for x, y in zip(got, want, strict=True))
    f = tmp_path / "m0" / "c" / "0" / "0"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match="checksum"):
        handles.read_zarr_many(reads[:1])


def _store(path: Path, tensors: int = 3, records: int = 16) -> Path:
    import gradforensics as gf

    rng = np.random.default_rng(0)
    with gf.Recorder(path, sources=["a", "b"], mode="training") as rec:
        for i in range(records):
            rec.record(step=i, loss=1.0 + 0.1 * np.sin(i), source="ab"[i % 2], n_samples=4,
                       grads={f"l{j}.weight": rng.standard_normal(8, dtype=np.float32) for j in range(tensors)})
    return path


def test_an_open_without_chunk_checks_lists_no_bulk_chunk_tree(tmp_path: Path) -> None:
    """``check_chunks=False`` (``report``): the same arrays, shapes, chunks and attributes, the small arrays'
    chunks listed and checked as before, the gradients' chunk trees not walked at all."""
    import shutil

    from gradforensics.errors import CorruptChunkError, CorruptStoreError
    from gradforensics.store.reader import Store

    path = _store(tmp_path / "s.zarr")
    full, light = Store(path), Store(path, check_chunks=False)
    assert list(full.arrays) == list(light.arrays)
    for name, a in full.arrays.items():
        b = light.arrays[name]
        assert (a.shape, a.chunks, a.dtype, a.attrs) == (b.shape, b.chunks, b.dtype, b.attrs), name
        assert b.nbytes_stored == (0 if name.startswith("grads/") else a.nbytes_stored), name
    assert all(full.arrays[f"grads/l{j}.weight"].nbytes_stored > 0 for j in range(3))
    # what is not listed is not seen: a link or a missing chunk in a gradient's chunk tree
    for damage in ("link", "missing"):
        p = tmp_path / f"{damage}.zarr"
        shutil.copytree(path, p)
        cdir = p / "grads" / "l1.weight" / "c"
        if damage == "link":
            (cdir / "evil").symlink_to(tmp_path)
        else:
            shutil.rmtree(cdir)
        with pytest.raises(CorruptStoreError if damage == "link" else CorruptChunkError):
            Store(p)
        assert Store(p, check_chunks=False).n_records == 16
    # the small arrays' chunks are still listed and checked without chunk checks
    p = tmp_path / "batch.zarr"
    shutil.copytree(path, p)
    shutil.rmtree(p / "batches" / "loss" / "c")
    with pytest.raises(CorruptChunkError):
        Store(p, check_chunks=False)


@pytest.mark.slow
def test_no_dask_array_nor_distributed_for_a_store_without_activations(tmp_path: Path) -> None:
    """``analyze`` of a gradient store imports neither (1-1.6 and 0.4-0.5 CPU-s), and finds what it found."""
    path = _store(tmp_path / "s.zarr")
    code = textwrap.dedent(f"""
        import sys
        import gradforensics as gf
        f = gf.analyze({str(path)!r}, progress=False)
        print(len(f.results), "dask.array" in sys.modules, "distributed" in sys.modules, "h5py" in sys.modules)
        import h5py
        print(f.header["versions"]["h5py"] == h5py.__version__)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("DASK_SCHEDULER", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    n, da, dist, h5, version = out.stdout.split()
    assert int(n) > 5 and da == "False" and dist == "False"
    assert h5 == "False" and version == "True"          # the header names h5py's version without importing it
