"""Issue 28: the exact Gram pass over many records plans tasks in proportion to bytes / slab size.

When all records of one on-disk feature chunk exceed ``slab_bytes``, the pass used to
split the record axis and run one task per pair of record blocks - tasks grew
quadratically in N.  Now the slab narrows instead (every record x fewer features,
:func:`slab_chunks`), and K is a sum over feature ranges.  Oracles: the task count of the
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
        for s in (small, big):                  # the record axis stays whole: no pairs of record blocks
            chunks = slab_chunks(s, f"grads/{tensor}", SLAB)
            assert chunks[0] == (s.n_records,), chunks
            slab = int(np.prod([max(c) for c in chunks[1:]])) * 4 * s.n_records
            heads = max(chunks[1]) if tensor == "l0.q" else 1
            assert slab <= max(SLAB, 8 * s.n_records ** 2 * heads)     # the slab, or the K it feeds
        a, b = _tasks(small, tensor), _tasks(big, tensor)
        assert b <= 2.2 * a, (tensor, a, b)     # the pairs of record blocks gave 2.8x (4 -> 8 blocks)
    # where all records of a chunk (16 x 64 floats, 1 MiB at N = 256) outgrow both the slab and
    # the K they feed (0.5 MiB), the chunk is cut in feature ranges
    assert len(slab_chunks(big, "grads/l0.mlp", SLAB)[1]) == 2
    # a head-split chunk of 4 heads: all records of it (512 KiB at N = 256) are less than its
    # 4 heads' K (4 x 0.5 MiB): one task reads it whole
    assert slab_chunks(big, "grads/l0.q", SLAB)[1] == (4,)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_narrow_slabs_give_x_xt(tmp_path, precision):
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
