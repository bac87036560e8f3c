"""Issue 28: a short capture's small arrays are chunked for the records it has, not for 4,096.

A small array (a 32-float tensor: 128 B a record) used to get a chunk of several flushes, up
to 4,096 records, whatever the capture's length: a capture of 32 records stored one chunk of
4,096 (Zarr compresses the fill) and every read decoded 512 KiB for its 4 KiB.  Now, where
the writer knows the records an array will hold (``expected_records``, or a capture that
closes before its first flush), a small array's chunk spans no more flushes than they fill.

The oracle of "meaning unchanged": the same records written with the old layout forced
(``records_per_chunk=64``: no refit at close, small chunks of 4,096) read back the same,
array for array, and give the same Gram matrices.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

from gradforensics.analysis.engine.gram import gram_graph
from gradforensics.recording import Recorder
from gradforensics.store.layout import LayoutPolicy, chunk_shape
from gradforensics.store.reader import Store

SHAPES = {f"l{i}.tiny": (32,) for i in range(6)} | {"l0.bias": (8,), "l0.w": (16, 16)}


def _capture(path, n: int, **kwargs) -> None:
    rng = np.random.default_rng(5)
    with Recorder(path, sources=["a", "b"], background=False, **kwargs) as rec:
        for i in range(n):
            rec.record(step=i, source="ab"[i % 2], loss=1.0 + 0.1 * i, n_samples=4,
                       grads={k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})


def test_chunk_shape_caps_a_small_chunk_at_the_known_records():
    P = LayoutPolicy()
    assert chunk_shape((32,), 4, 32, P) == (4096, 32)                 # records unknown: as before
    assert chunk_shape((32,), 4, 32, P, records=32) == (32, 32)       # one flush of 32
    assert chunk_shape((32,), 4, 50, P, records=100) == (100, 32)     # two flushes of 50
    assert chunk_shape((32,), 4, 50, P, records=101) == (150, 32)     # whole flushes: 3 of 50
    assert chunk_shape((32,), 4, 32, P, records=10 ** 6) == (4096, 32)   # never above the 1 MiB / 4,096 cap
    # a large array's chunk does not depend on the records (one flush of R already)
    assert chunk_shape((4096, 4096), 4, 64, P, records=3) == chunk_shape((4096, 4096), 4, 64, P)
    assert chunk_shape((8, 4, 32), 4, 8, P, head_split=True, records=8) == chunk_shape((8, 4, 32), 4, 8, P,
                                                                                        head_split=True)


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_a_short_capture_chunks_its_small_arrays_for_its_records(tmp_path, suffix):
    new, old = tmp_path / f"new{suffix}", tmp_path / f"old{suffix}"
    n = 32
    _capture(new, n)
    _capture(old, n, records_per_chunk=64)             # the old layout: no refit, small chunks of many flushes
    s_new, s_old = Store(new), Store(old)
    assert s_new.meta.records_per_chunk == n
    for name, info in s_new.arrays.items():
        if name.startswith(("grads/", "batches/")):
            assert info.chunks[0] == n, (name, info.chunks)      # every per-record array: one chunk of its records
    if suffix == ".zarr":       # HDF5's small chunks were one flush (R) already; Zarr's spanned 4,096 records
        assert s_old.arrays["grads/l0.tiny"].chunks[0] == 4096
    assert s_new.arrays.keys() == s_old.arrays.keys()
    for name in set(s_new.arrays) - {"batches/time"}:     # the same values, whatever the chunks (time: the clock)
        np.testing.assert_array_equal(s_new.read(name), s_old.read(name))
    for t in s_new.tensors:
        np.testing.assert_array_equal(s_new.grad(t).compute(), s_old.grad(t).compute())
        (a,), (b,) = dask.compute(gram_graph(s_new, t)), dask.compute(gram_graph(s_old, t))
        for ga, gb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ga.gram, gb.gram)


def test_expected_records_cap_the_small_chunks(tmp_path):
    p = tmp_path / "e.zarr"
    _capture(p, 100, expected_records=100)
    s = Store(p)
    r = s.meta.records_per_chunk
    assert r == 50                                         # 100 records: two flushes of 50 (the least padding)
    assert s.arrays["grads/l0.tiny"].chunks[0] == 100      # two flushes, not 4,096 records
    assert s.n_records == 100
    rng = np.random.default_rng(5)
    want = np.stack([{k: rng.standard_normal(sh).astype(np.float32) for k, sh in SHAPES.items()}["l3.tiny"]
                     for _ in range(100)])
    np.testing.assert_array_equal(s.read("grads/l3.tiny"), want)


def test_more_records_than_expected_are_kept(tmp_path):
    """``expected_records`` is a hint: a capture that runs longer keeps every record (more, smaller chunks)."""
    p = tmp_path / "more.zarr"
    _capture(p, 70, expected_records=20)
    s = Store(p)
    assert s.n_records == 70 and s.arrays["grads/l0.tiny"].chunks[0] == 20
    rng = np.random.default_rng(5)
    want = np.stack([{k: rng.standard_normal(sh).astype(np.float32) for k, sh in SHAPES.items()}["l5.tiny"]
                     for _ in range(70)])
    np.testing.assert_array_equal(s.read("grads/l5.tiny"), want)
