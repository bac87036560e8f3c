"""The one place gradforensics may reach into another library's private internals.

Everything else uses public doors only: no ``_``-prefixed attribute or import of numpy,
scipy, zarr, numcodecs, dask, torch or transformers, and no ``zarr.core`` import.  An entry
here is a small function with a docstring saying the library version it was checked
against, why no public door does, and the condition for removing it.  The project keeps
at most four entries.

The store reads and writes through zarr 3.1's public API alone (checked against zarr
3.1.6: ``zarr.AsyncArray`` built on a metadata dict or a parsed ``Array.metadata``,
``zarr.storage.StorePath``, ``AsyncArray.getitem`` gathered on an ``asyncio.Runner``), so it
holds no entry here.
"""

from __future__ import annotations

__all__: list[str] = []
