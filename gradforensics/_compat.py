"""The one place gradforensics may reach into another library's private internals.

Everything else uses public doors only: no ``_``-prefixed attribute or import of numpy,
scipy, zarr, numcodecs, dask, torch or transformers, and no ``zarr.core`` import
(``tests/test_architecture.py``).  An entry here is a small function with a docstring saying
the library version it was checked against, why no public door does, and the condition for
removing it.  The project keeps at most four entries.

The store reads and writes through zarr 3.1's public API alone (checked against zarr
3.1.6: ``zarr.AsyncArray`` built on a metadata dict or a parsed ``Array.metadata``,
``zarr.storage.StorePath``, ``AsyncArray.getitem`` gathered on an ``asyncio.Runner``), so it
holds no entry here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["attn_implementation"]


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a Hugging Face config selects (``"eager"``, ``"sdpa"``, ...); ``None`` if none.

    transformers has a public setter (``PreTrainedModel.set_attn_implementation``, or
    ``attn_implementation=`` when loading) but no public getter: the value is the
    property ``PretrainedConfig._attn_implementation``.  Checked against transformers
    5.24.0.  Remove when transformers reads it through a public name.
    """
    return getattr(config, "_attn_implementation", None)
