"""The store: schema v1 in a Zarr v3 directory or an HDF5 file (see docs/store-schema.md)."""

from gradforensics.store.layout import LayoutPolicy
from gradforensics.store.reader import ArrayInfo, Store, open_store
from gradforensics.store.schema import SCHEMA_VERSION, StoreMeta
from gradforensics.store.writer import Row, StoreWriter

__all__ = ["SCHEMA_VERSION", "ArrayInfo", "LayoutPolicy", "Row", "Store", "StoreMeta", "StoreWriter", "open_store"]
