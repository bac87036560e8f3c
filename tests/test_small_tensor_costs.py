"""Issue 28, many small tensors (second part), each against an oracle.

* Zarr arrays opened on metadata parsed once read what ``zarr.open_array`` reads, also
  after the store is written again (new data, new shape, same metadata and new chunks);
* the series analyses share one read-only set of series per pass (what ``from_context`` builds);
* saving results carries over what it does not replace.
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


# ------------------------------------------------------------------ Zarr arrays opened on parsed metadata
def _fresh(p, name):
    import zarr

    return np.asarray(zarr.open_array(str(p / name), mode="r")[:])


def test_opened_arrays_read_what_zarr_open_array_reads(tmp_path) -> None:
    handles.clear()
    p = tmp_path / "s.zarr"

    def grads(i, src, rng):
        return {f"t{k}": rng.standard_normal((3, 4)).astype(np.float32) for k in range(5)}

    write_store(p, grads, 10, ("a", "b"))
    store = Store(p)
    for name in store.arrays:
        if name.startswith("grads/"):
            got = np.asarray(handles.open_zarr_array(str(p), name)[:])
            want = _fresh(p, name)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    assert handles.parsed_count() == 1         # five arrays, names and attributes aside one metadata: parsed once


@pytest.mark.parametrize("change", ["data", "shape", "records"])
def test_an_array_after_the_store_is_written_again_reads_the_new_store(tmp_path, change) -> None:
    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    old = Store(p)
    before = old.handle(old.grads["w"])[:]             # a read task of a first pass
    kw = {"data": {}, "shape": {"shape": (5, 2)}, "records": {"n": 12}}[change]
    _store(p, 7.0, overwrite=True, **kw)
    new = Store(p)
    got = new.handle(new.grads["w"])[:]
    np.testing.assert_array_equal(got, _fresh(p, "grads/w"))     # what a fresh open reads now
    assert got.shape == new.grads["w"].shape
    assert not np.array_equal(got[:1], before[:1])
    np.testing.assert_array_equal(got[:, 0, 0], 7.0 * np.arange(1, got.shape[0] + 1, dtype=np.float32))


def test_an_array_follows_chunks_rewritten_under_the_same_metadata(tmp_path) -> None:
    """Same zarr.json, new chunk files: the array reads the chunks on disk (zarr keeps no chunk data)."""
    import zarr

    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    first = np.asarray(handles.open_zarr_array(str(p), "grads/w")[:]).copy()
    zarr.open_array(str(p / "grads" / "w"), mode="r+")[:] = first * 3
    np.testing.assert_array_equal(np.asarray(handles.open_zarr_array(str(p), "grads/w")[:]), first * 3)


def test_unreadable_metadata_goes_to_zarr_and_its_error(tmp_path) -> None:
    handles.clear()
    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    (p / "grads" / "w" / "zarr.json").write_text("{not json")
    with pytest.raises(Exception) as got:
        handles.open_zarr_array(str(p), "grads/w")
    import zarr

    with pytest.raises(type(got.value)):
        zarr.open_array(str(p / "grads" / "w"), mode="r")
    assert handles.parsed_count() == 0


# ------------------------------------------------------------------ series shared by the loss-curve analyses
def test_series_analyses_share_one_read_only_set_of_series(tmp_path) -> None:
    from gradforensics.analysis.contract.model import Context
    from gradforensics.analysis.toolkit.series import from_context, shared_series

    p = tmp_path / "s.zarr"
    _store(p, 1.0, n=40)

    store = Store(p)
    ctx = Context(store=store, meta=store.meta, batches=store.batches(), grams={})
    a, b = shared_series(ctx), shared_series(ctx)
    assert [g.combined for g in a] == [g.combined for g in b] and a[0] is b[0]       # built once
    fresh = from_context(ctx)
    for g, h in zip(a, fresh, strict=True):
        np.testing.assert_array_equal(g.combined.y, h.combined.y)
        assert not g.combined.y.flags.writeable                                      # no analysis can change it
    assert shared_series(ctx, "time") is not a                                      # by axis


# ------------------------------------------------------------------ saving without listing the store again
def test_saving_carries_over_what_it_does_not_replace(tmp_path) -> None:
    from gradforensics.store import results as sr
    from gradforensics.store.inventory import zarr_inventory

    p = tmp_path / "s.zarr"
    _store(p, 1.0)
    sr.write_results(p, documents={"first": {"x": 1}}, arrays={"series/a": np.arange(5.0)})
    listed = zarr_inventory(str(p), only="analysis")          # the root and analysis/ only (what saving lists)
    store = Store(p, check_chunks=False)                      # the whole store, as before
    assert listed.selection.current == store.analysis_selection.current is not None
    want = {n: a for n, a in store.arrays.items() if n.startswith("analysis/")}
    assert sorted(n for n in listed.arrays if n.startswith("analysis/")) == sorted(want)
    for n, a in want.items():
        got = listed.arrays[n]
        assert (tuple(got.shape), tuple(got.chunks), got.dtype, got.attrs) == (a.shape, a.chunks, a.dtype, a.attrs)
    sr.write_results(p, documents={"second": {"y": 2}})
    again = Store(p)
    assert sr.read_document(again, "first") == {"x": 1} and sr.read_document(again, "second") == {"y": 2}
    np.testing.assert_array_equal(sr.read_result(again, "series/a"), np.arange(5.0))
