"""A store's Location: parsed once from the backend table, carried by every open, never remembered per URL."""

from __future__ import annotations

import inspect
import os
import pickle

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.errors import NotAStoreError, SpecError
from gradforensics.store import remote
from gradforensics.store.backends import (
    BACKENDS,
    STORE_SUFFIXES,
    StoreBackend,
    backend_kind,
    locate,
    open_backend,
)
from gradforensics.store.location import Location
from gradforensics.store.reader import Store


@pytest.mark.parametrize(("path", "kind"), [("d.zarr", "zarr"), ("D.ZARR", "zarr"), ("f.h5", "hdf5"),
                                            ("f.hdf5", "hdf5"), ("s3://b/d.zarr/", "zarr"),
                                            ("memory://x/d.zarr", "zarr")])
def test_kind_from_the_table(path, kind):
    loc = locate(path)
    assert loc.kind == kind == backend_kind(path)
    assert loc.path == (path.rstrip("/") if "://" in path else os.path.abspath(path))   # a local path: absolute


def test_unknown_suffix_names_every_backend_suffix():
    with pytest.raises(NotAStoreError, match=r"unknown store suffix '\.npz'; expected a Zarr directory '\*\.zarr' "
                                             r"or an HDF5 file '\*\.h5' / '\*\.hdf5'"):
        locate("run.npz")
    assert set(STORE_SUFFIXES) == {".zarr", ".h5", ".hdf5"}


def test_hdf5_at_a_url_is_refused_by_its_backend_row():
    with pytest.raises(NotAStoreError, match=r"s3://b/d\.h5: HDF5 stores are local files only"):
        locate("s3://b/d.h5")


def test_options_stay_with_urls_and_are_not_given_twice():
    assert locate("d.zarr", {"anon": True}).storage_options == {}
    loc = locate("s3://b/d.zarr", {"anon": True})
    assert loc.storage_options == {"anon": True} and loc.fs_options()["anon"] is True
    assert "config_kwargs" in loc.fs_options()              # the scheme's defaults under the caller's options
    assert locate(loc) is loc and locate(loc, {"anon": True}) is loc
    with pytest.raises(SpecError, match="storage_options given twice"):
        locate(loc, {"anon": False})
    assert pickle.loads(pickle.dumps(loc)) == loc


def test_every_backend_follows_the_protocol():
    wanted = {name for name, _ in inspect.getmembers(StoreBackend, inspect.isfunction) if not name.startswith("_")}
    assert {"create", "write_rows", "read", "inventory", "set_group_attr", "delete", "close"} <= wanted
    for b in BACKENDS:
        missing = {m for m in wanted if not callable(getattr(b, m, None))}
        assert not missing, f"{b.__name__} lacks {sorted(missing)}"
        assert b.kind and b.suffixes and all(s.startswith(".") and s == s.lower() for s in b.suffixes)
        assert b.remote_ok or b.remote_refusal
    kinds = [b.kind for b in BACKENDS]
    assert len(set(kinds)) == len(kinds) and len(set(STORE_SUFFIXES)) == len(STORE_SUFFIXES)


def test_no_process_global_options():
    """Options given for one open of a URL are not used by the next open of that URL."""
    assert not hasattr(remote, "register") and not hasattr(remote, "_REGISTERED")
    url = "memory://location-test/one.zarr"
    opts = {"skip_instance_cache": True}
    with gf.Recorder(url, sources=["a"], storage_options=opts, overwrite=True) as rec:
        rec.record(source="a", grads={"w": np.arange(6, dtype=np.float32)})
        assert rec.location.storage_options == opts
    first = Store(url, storage_options=opts)
    second = Store(url)
    assert first.location.storage_options == opts and second.location.storage_options == {}
    handle = first.handle(first.grads["w"])
    assert handle.location == first.location                 # a dask task opens the store with the options
    moved = pickle.loads(pickle.dumps(handle))
    np.testing.assert_array_equal(moved[:, :], np.arange(6, dtype=np.float32)[None])
    assert second.handle(second.grads["w"]).location.storage_options == {}


def test_every_open_takes_a_location(tmp_path):
    loc = locate(tmp_path / "l.zarr")
    with gf.Recorder(loc, sources=["a"]) as rec:
        rec.record(source="a", grads={"w": np.ones(3, np.float32)})
    assert isinstance(Store(loc).location, Location) and Store(loc).location == loc
    b = open_backend(loc, "r")
    try:
        assert b.location == loc and b.root_attrs()
    finally:
        b.close()
    findings = gf.analyze(loc, only="nonfinite", progress=False)
    assert findings.store == loc.path


def test_a_new_backend_is_one_class_and_one_table_row(tmp_path, monkeypatch):
    """Nothing but the table knows the backends: a new kind (here a Zarr layout under its own suffix) is
    written, validated, analysed and re-read with no other edit."""
    from gradforensics.store import backends
    from gradforensics.store.zarr_backend import ZarrBackend

    class RunDir(ZarrBackend):
        kind = "rundir"
        suffixes = (".gfrun",)
        description = "a run directory"

    monkeypatch.setattr(backends, "BACKENDS", (*backends.BACKENDS, RunDir))
    p = tmp_path / "night.gfrun"
    rng = np.random.default_rng(0)
    with gf.Recorder(p, sources=["a", "b"]) as rec:
        for i in range(6):
            g = rng.standard_normal((4, 3)).astype(np.float32)
            if i == 3:
                g[0, 0] = np.nan
            rec.record(step=i, loss=1.0, source="ab"[i % 2], grads={"w": g})
    store = Store(p)
    assert store.kind == "rundir" and store.n_records == 6
    findings = gf.analyze(p, only="nonfinite", progress=False)
    assert [(f.kind, f.tensor) for f in findings.flags] == [("nonfinite", "w")]
    from gradforensics.analysis.engine.results import read_findings

    assert [f.kind for f in read_findings(Store(p)).flags] == ["nonfinite"]     # results written back
    with pytest.raises(NotAStoreError, match=r"expected a Zarr directory '\*\.zarr' or an HDF5 file '\*\.h5' / "
                                             r"'\*\.hdf5' or a run directory '\*\.gfrun'"):
        locate("night.npz")
