"""Issue 28: a capture shorter than one chunk of records is not stored as padding.

Both formats store an edge chunk at its full size; a writer that closes before its first
flush (fewer than R records, no ``expected_records``) now creates its arrays with chunks of
the records it has.  The oracle of "meaning unchanged" is the same records written with the
old choice forced (``records_per_chunk=64``: chunks of 64 records, the pre-issue layout):
every array, every dask read and every Gram matrix is the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from gradforensics.analysis.engine.gram import gram_graph
from gradforensics.recording import Recorder
from gradforensics.store.reader import Store

HEADS = {"l*.q": 4, "l*.o": {"heads": 4, "axis": 1}}
SHAPES = {f"l{i}.{p}": (64, 64) for i in range(3) for p in ("q", "o", "mlp")}
N = 12


def _on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _capture(path: Path, **kwargs) -> None:
    rng = np.random.default_rng(3)
    with Recorder(path, sources=["a", "b"], heads=HEADS, background=False, **kwargs) as rec:
        for i in range(N):
            rec.record(step=i, source="ab"[i % 2], loss=1.0 + i,
                       grads={k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_short_sketch_store_is_its_data_not_padding(tmp_path, suffix):
    new, old = tmp_path / f"new{suffix}", tmp_path / f"old{suffix}"
    _capture(new, sketch=256)
    _capture(old, sketch=256, records_per_chunk=64)           # the old choice: R = 64 for 12 records
    data = N * sum(4 * 256 * (4 if k.endswith((".q", ".o")) else 1) for k in SHAPES)
    s_new, s_old = Store(new), Store(old)
    assert s_new.meta.records_per_chunk == N and s_old.meta.records_per_chunk == 64
    assert _on_disk(new) < 1.3 * data + (256 << 10)
    if suffix == ".h5":                     # HDF5 stores the padding (Zarr compresses its small chunks' fill)
        assert _on_disk(old) > 4 * data
    assert s_new.arrays.keys() == s_old.arrays.keys()
    for name in set(s_new.arrays) - {"batches/time"}:     # same values, whatever the chunks (time: the clock)
        np.testing.assert_array_equal(s_new.read(name), s_old.read(name))
    assert s_new.tensors == s_old.tensors


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_old_layout_full_store_reads_the_same(tmp_path, suffix):
    import dask

    new, old = tmp_path / f"new{suffix}", tmp_path / f"old{suffix}"
    _capture(new)
    _capture(old, records_per_chunk=64)
    s_new, s_old = Store(new), Store(old)
    assert s_new.grads["l0.q"].chunks[0] == N and s_old.grads["l0.q"].chunks[0] == 64
    assert _on_disk(new) < 0.5 * _on_disk(old)
    for t in s_new.tensors:
        np.testing.assert_array_equal(s_new.grad(t, slab_bytes=1 << 16).compute(), s_old.grad(t).compute())
        (a,), (b,) = dask.compute(gram_graph(s_new, t)), dask.compute(gram_graph(s_old, t))
        assert [(g.tensor, g.head) for g in a] == [(g.tensor, g.head) for g in b]
        for ga, gb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ga.gram, gb.gram)
