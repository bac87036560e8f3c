"""Where a store lies: a path or an fsspec URL, its backend kind, and its storage options.

A :class:`Location` is parsed once, at each boundary that takes a store from
outside (the CLI verbs, ``gf.Recorder``, ``gf.analyze``, ``gf.compare``,
``gf.open_store``), and then carried - frozen - by everything that opens the
store: :class:`~gradforensics.store.reader.Store`,
:class:`~gradforensics.store.writer.StoreWriter`, the writer lock, results
persistence and the dask read tasks (:class:`~gradforensics.store.backends.ArrayHandle`).
Nothing is remembered per URL in the process: two calls with two sets of
options open the same URL two ways.

The backend kind comes from the backend table
(:data:`gradforensics.store.backends.BACKENDS`, one row per backend with its
suffixes); :func:`gradforensics.store.backends.locate` builds a Location from a
path and checks it against that table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradforensics.store import remote

__all__ = ["Location", "located"]


@dataclass(frozen=True)
class Location:
    """One store's place: ``path`` (a local path, or a URL without trailing ``/``), ``kind``, options.

    ``storage_options`` are the caller's options for the URL's file system
    (empty for a local path); :meth:`fs_options` adds the scheme's defaults.  A
    Location pickles (it holds strings and plain values), so a dask task carries
    it to a worker, which opens the store there.
    """

    path: str
    kind: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def is_url(self) -> bool:
        """Whether the store is at an fsspec URL (``file://`` counts)."""
        return remote.is_url(self.path)

    @property
    def scheme(self) -> str | None:
        return remote.scheme(self.path)

    def fs_options(self) -> dict[str, Any]:
        """The options an open of the URL uses: the scheme's defaults, then :attr:`storage_options`."""
        return remote.options_for(self.path, self.storage_options)

    def options_key(self) -> str:
        """:attr:`storage_options` as a canonical string (a cache key)."""
        return json.dumps(dict(self.storage_options), sort_keys=True, default=repr)

    def __str__(self) -> str:
        return self.path


def located(where: Any, storage_options: Any = None) -> Location:
    """*where* itself: a backend is constructed on a :class:`Location` that
    :func:`gradforensics.store.backends.locate` made (``open_backend`` does), never on a bare path."""
    if not isinstance(where, Location):
        raise TypeError(f"a store backend opens a Location, not {type(where).__name__}: "
                        "use gradforensics.store.backends.open_backend(path)")
    if storage_options and dict(storage_options) != dict(where.storage_options):
        raise TypeError(f"{where.path}: storage_options given twice (in its Location and beside it)")
    return where
