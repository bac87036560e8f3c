"""The store contract, run over both backends."""

from gradforensics.testing.store_contract import StoreContract


class TestZarrStore(StoreContract):
    suffix = ".zarr"


class TestHDF5Store(StoreContract):
    suffix = ".h5"
