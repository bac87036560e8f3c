"""Issue 28: the exact Gram pass over many records plans tasks in proportion to bytes / slab size.

When all records of one on-disk feature chunk exceed ``slab_bytes``, the pass split the
record axis and ran one task per pair of record blocks - tasks grew quadratically in N.
Now a chunk whose records are no larger than the K they feed is read whole
(:func:`slab_chunks`), and a split record axis runs one task per block, pairing it with
every later block (:func:`row_partial`).  Oracles: the task count of the
graph for N and 2N (structural, no timing), and K = X Xᵀ computed directly by NumPy.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

from gradforensics.analysis.engine.gram import gram_graph, slab_chunks
from gradforensics.recording import Recorder
from gradforensics.store.layout import LayoutPolicy
from gradforensics.store.reader import Store

SHAPES = {"l0.q": (8, 64), "l0.mlp": (16, 64)}
SLAB = 32 << 10           # 32 KiB: all records of one on-disk chunk exceed it, the old pass split the records


def _store(path, n: int, nan_at: tuple[int, ...] | None = None) -> Store:
    rng = np.random.default_rng(n)
    # chunks of 32 records on disk (no small-array chunking): N = 256 is 8 record blocks
    with Recorder(path, sources=["a", "b"], heads={"l0.q": 4}, records_per_chunk=32, background=False,
                  layout=LayoutPolicy(small_chunk_bytes=1)) as rec:
        for i in range(n):
            g = {k: (rng.standard_normal(s) * (1 + i % 5)).astype(np.float32) for k, s in SHAPES.items()}
            if nan_at is not None and i in nan_at:
                g["l0.mlp"][3, 5] = np.nan
                g["l0.mlp"][4, 7] = np.inf
            rec.record(step=i, source="ab"[i % 2], loss=1.0, grads=g)
    return Store(path)


def _tasks(store: Store, tensor: str) -> int:
    return len(gram_graph(store, tensor, slab_bytes=SLAB).__dask_graph__())


def test_tasks_grow_linearly_in_records(tmp_path):
    small, big = _store(tmp_path / "n128.zarr", 128), _store(tmp_path / "n256.zarr", 256)
    for tensor in SHAPES:
        a, b = _tasks(small, tensor), _tasks(big, tensor)
        assert b <= 2.2 * a, (tensor, a, b)     # one task per pair of record blocks gave 2.8x (4 -> 8 blocks)
    # all records of an on-disk chunk of 16 x 64 floats (1 MiB at N = 256) exceed the slab and the K they
    # feed (0.5 MiB): the record axis is split in 8 blocks of 32, one task per block pairs it with the later ones
    assert slab_chunks(big, "grads/l0.mlp", SLAB)[0] == (32,) * 8
    assert sum(1 for k in gram_graph(big, "l0.mlp", slab_bytes=SLAB).__dask_graph__() if "chunk" in k) == 8
    # a head-split chunk of 4 heads: all records of it (512 KiB at N = 256) are less than its 4 heads'
    # K (4 x 0.5 MiB): one task reads it whole, the record axis unsplit
    assert slab_chunks(big, "grads/l0.q", SLAB)[:2] == ((256,), (4,))


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_split_record_axis_gives_x_xt(tmp_path, precision):
    store = _store(tmp_path / "s.zarr", 256, nan_at=(17, 200))
    for tensor in SHAPES:
        (res,) = dask.compute(gram_graph(store, tensor, slab_bytes=SLAB, precision=precision))
        (whole,) = dask.compute(gram_graph(store, tensor, precision=precision))     # one slab: all features
        x = store.read(f"grads/{tensor}").astype(np.float64)
        bad = ~np.isfinite(x)
        nf = bad.reshape(len(x), -1).sum(axis=1)
        x[bad] = 0
        units = [(None, x.reshape(len(x), -1))]
        if tensor == "l0.q":
            units += [(h, x[:, h].reshape(len(x), -1)) for h in range(4)]
        assert [(g.tensor, g.head) for g in res] == [(tensor, h) for h, _ in units]
        tol = 1e-12 if precision == "float64" else 1e-5
        for g, w, (h, xu) in zip(res, whole, units, strict=True):
            k = xu @ xu.T
            k[nf > 0, :] = 0
            k[:, nf > 0] = 0
            scale = np.abs(k).max()
            np.testing.assert_allclose(g.gram, k, rtol=0, atol=tol * scale, err_msg=f"{tensor} head {h}")
            np.testing.assert_allclose(g.gram, w.gram, rtol=0, atol=tol * scale)
            if h is None:
                np.testing.assert_array_equal(g.nonfinite, nf)   # each record's non-finite values counted once
