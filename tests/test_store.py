"""The store contract, run over every backend: local Zarr, HDF5, and Zarr at an fsspec URL (``memory://``)."""

from gradforensics.testing.store_contract import StoreContract


class TestZarrStore(StoreContract):
    suffix = ".zarr"


class TestHDF5Store(StoreContract):
    suffix = ".h5"


class TestMemoryZarrStore(StoreContract):
    suffix = ".zarr"
    url = "memory://"


def test_write_analysis_accepts_empty_arrays(tmp_path):
    import numpy as np

    import gradforensics as gf
    from gradforensics.store.reader import Store
    from gradforensics.store.results import read_document, write_results

    for suffix in (".zarr", ".h5"):
        p = tmp_path / f"s{suffix}"
        with gf.Recorder(p, sources=["a"]) as rec:
            rec.record(source="a", grads={"w": np.ones(3, np.float32)})
        write_results(p, arrays={"empty": np.zeros((0,), np.float64), "m": np.zeros((0, 3))},
                      documents={"doc": {"x": 1}})
        s = Store(p)
        assert s.read("analysis/empty").shape == (0,) and s.read("analysis/m").shape == (0, 3)
        assert read_document(s, "doc") == {"x": 1}
