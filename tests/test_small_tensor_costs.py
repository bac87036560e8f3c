"""Issue 28, many small tensors (second part): each shortcut against the code it replaces.

* the per-process cache of opened Zarr arrays never serves an array whose store was
  written again (new data, new shape, same metadata and new chunks);
* the series analyses share one set of series per pass (the same series they built each);
* the AR(1) background fitted to many series at once is the per-series fit, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradforensics.store import handles
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store


def _store(path, scale: float, shape=(4, 3), n=8, overwrite=False):
    def grads(i, src, rng):
        return {"w": np.full(shape, scale * (i + 1), dtype=np.float32)}

    return write_store(path, grads, n, ("a", "b"), overwrite=overwrite)


# ------------------------------------------------------------------ cached Zarr arrays
def test_cached_array_is_reused_while_its_metadata_holds(tmp_path) -> None:
    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    store = Store(p)
    a = handles.open_zarr_array(str(p), "grads/w")
    assert handles.open_zarr_array(str(p), "grads/w") is a          # kept: no second open
    np.testing.assert_array_equal(store.read("grads/w")[:, 0, 0], np.arange(1, 9, dtype=np.float32))


@pytest.mark.parametrize("change", ["data", "shape", "records"])
def test_cached_array_after_the_store_is_written_again_reads_the_new_store(tmp_path, change) -> None:
    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    old = Store(p)
    info = old.grads["w"]
    before = old.handle(info)[:]                       # a read task: opens and keeps the array
    assert handles.open_zarr_array(str(p), "grads/w") is handles.open_zarr_array(str(p), "grads/w")
    kw = {"data": {}, "shape": {"shape": (5, 2)}, "records": {"n": 12}}[change]
    _store(p, 7.0, overwrite=True, **kw)
    new = Store(p)
    got = new.handle(new.grads["w"])[:]
    fresh = np.asarray(__import__("zarr").open_array(str(p / "grads" / "w"), mode="r")[:], dtype=np.float32)
    np.testing.assert_array_equal(got, fresh)          # what a fresh open reads now
    assert got.shape == new.grads["w"].shape
    assert not np.array_equal(got[:1], before[:1])     # the new records (7, 14, ...), not the old (1, 2, ...)
    np.testing.assert_array_equal(got[:, 0, 0], 7.0 * np.arange(1, got.shape[0] + 1, dtype=np.float32))


def test_cached_array_follows_chunks_rewritten_under_the_same_metadata(tmp_path) -> None:
    """Same zarr.json, new chunk files: the kept array reads the chunks on disk (zarr keeps no chunk data)."""
    import zarr

    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    a = handles.open_zarr_array(str(p), "grads/w")
    first = np.asarray(a[:]).copy()
    zarr.open_array(str(p / "grads" / "w"), mode="r+")[:] = first * 3
    b = handles.open_zarr_array(str(p), "grads/w")
    np.testing.assert_array_equal(np.asarray(b[:]), first * 3)
