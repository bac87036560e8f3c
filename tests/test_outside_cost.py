"""What ``analyze`` spends outside the analyses: reads gathered into one event-loop run, imports it does not need.

Many arrays read through zarr's public ``AsyncArray`` in one run
(:func:`gradforensics.store.handles.read_zarr_many`) give what ``zarr.open_array(...)[sel]``
gives, for every codec chain gradforensics writes (a missing chunk as its fill value, a
damaged chunk zarr's checksum error); the pass over a store without activations imports
neither ``dask.array`` nor ``distributed``.
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

from gradforensics.store import handles

#: ``(compressors)`` of each codec chain gradforensics writes, and a foreign one (gzip)
CHAINS = {
    "raw": [],
    "crc": [zc.Crc32cCodec()],
    "zstd": [zc.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")],
    "zstd-crc": [zc.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle"), zc.Crc32cCodec()],
    "bitshuffle-crc": [zc.BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"), zc.Crc32cCodec()],
    "gzip": [zc.GzipCodec()],
}


def _array(root: Path, name: str, data: np.ndarray, chunks: tuple[int, ...], chain: str,
           shape: tuple[int, ...] | None = None) -> zarr.Array:
    g = zarr.open_group(root, mode="a")
    a = g.create_array(name, shape=shape or data.shape, chunks=chunks, dtype=data.dtype, fill_value=0,
                       config={"write_empty_chunks": True}, compressors=CHAINS[chain] or None, overwrite=True)
    a[: data.shape[0]] = data
    return a


def _assert_zarrs(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Each read is zarr's own (same dtype and shape, every value, NaN where zarr has NaN: exact, lossless codecs)."""
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _random_sel(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for n in shape[: rng.integers(1, len(shape) + 1)]:
        a = int(rng.integers(0, n))
        out.append(slice(a, int(rng.integers(a + 1, n + 1))) if rng.random() < 0.7 else slice(None))
    return tuple(out)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_read_zarr_many_reads_what_zarr_open_array_reads(tmp_path: Path, chain: str) -> None:
    """Every dtype gradforensics stores, random shapes, chunks and slices, NaN and inf: the same bytes."""
    rng = np.random.default_rng(7)
    dtypes = [np.float32, np.float16, np.float64, np.uint16, np.uint8, np.int32, np.int64]
    reads, want = [], []
    for k in range(24):
        dtype = dtypes[k % len(dtypes)]
        shape = tuple(int(rng.integers(1, 12)) for _ in range(int(rng.integers(1, 4))))
        chunks = tuple(int(rng.integers(1, n + 3)) for n in shape)
        data = (rng.standard_normal(shape) * 100).astype(dtype)
        if k % 5 == 0 and np.issubdtype(dtype, np.floating):
            data.flat[:: 3] = np.nan
            data.flat[1:: 7] = np.inf
        _array(tmp_path, f"a{k}", data, chunks, chain)
        for _ in range(3):
            sel = _random_sel(rng, shape)
            reads.append((str(tmp_path), f"a{k}", sel))
            want.append(np.asarray(zarr.open_array(str(tmp_path / f"a{k}"), mode="r")[sel]))
    got = handles.read_zarr_many(reads)
    _assert_zarrs(got, want)


def test_read_zarr_many_gives_fill_values_and_zarrs_checksum_error(tmp_path: Path) -> None:
    """A missing chunk reads as zarr's fill value; a damaged chunk raises zarr's checksum error."""
    rng = np.random.default_rng(3)
    reads, want = [], []
    for k in range(12):
        data = rng.standard_normal((6, 4)).astype(np.float32)
        a = _array(tmp_path, f"m{k}", data, (4, 4), "gzip" if k % 4 == 2 else "zstd-crc", shape=(8, 4))
        if k % 3 == 1:
            os.remove(tmp_path / f"m{k}" / "c" / "1" / "0")
        reads.append((str(tmp_path), f"m{k}", (slice(0, 8), slice(0, 4))))
        want.append(np.asarray(a[:8]))
    got = handles.read_zarr_many(reads)
    _assert_zarrs(got, want)
    assert not got[1][4:].any()                              # the missing chunk: zarr's fill value
    f = tmp_path / "m0" / "c" / "0" / "0"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match="checksum"):
        handles.read_zarr_many(reads[:1])


def test_read_zarr_many_inside_a_running_event_loop(tmp_path: Path) -> None:
    """Called from a coroutine (a notebook's loop), the reads go through ``zarr.Array`` one by one, same values."""
    import asyncio

    data = np.arange(40, dtype=np.float32).reshape(8, 5)
    _array(tmp_path, "x", data, (4, 5), "zstd-crc")

    async def inside() -> list[np.ndarray]:
        return handles.read_zarr_many([(str(tmp_path), "x", (slice(2, 7),))])

    np.testing.assert_array_equal(asyncio.run(inside())[0], data[2:7])


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
