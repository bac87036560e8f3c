"""The store: schema v1 in a Zarr v3 directory or an HDF5 file (see docs/store-schema.md).

Importing the package is cheap (the command line reads :mod:`~gradforensics.store.names`
and :mod:`~gradforensics.store.remote` to build its parsers): the public names below,
and numpy with them, load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradforensics.store.layout import LayoutPolicy
    from gradforensics.store.reader import ArrayInfo, Store, open_store
    from gradforensics.store.schema import SCHEMA_VERSION, StoreMeta
    from gradforensics.store.writer import Row, StoreWriter

#: public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "LayoutPolicy": "gradforensics.store.layout",
    "ArrayInfo": "gradforensics.store.reader", "Store": "gradforensics.store.reader",
    "open_store": "gradforensics.store.reader",
    "SCHEMA_VERSION": "gradforensics.store.schema", "StoreMeta": "gradforensics.store.schema",
    "Row": "gradforensics.store.writer", "StoreWriter": "gradforensics.store.writer",
}

__all__ = ["SCHEMA_VERSION", "ArrayInfo", "LayoutPolicy", "Row", "Store", "StoreMeta", "StoreWriter", "open_store"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'gradforensics.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
