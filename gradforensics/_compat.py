"""The private reaches into other libraries that have no public door yet: one function each.

Each entry names the library version it was checked against and when it can go.
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
