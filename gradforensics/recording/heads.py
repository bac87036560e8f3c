"""The user's head spec: ``heads={glob: H | {"heads": H, "axis": A, ...}}``.

:func:`match_heads` finds the entry whose glob matches a tensor name and
:func:`parse_head_spec` turns it into a :class:`~gradforensics.store.heads.HeadSpec`
(the layout itself, and the attributes it is stored with, live in
:mod:`gradforensics.store.heads`).  ``heads="auto"`` for a PyTorch model is
:mod:`gradforensics.recording.autoheads`.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.store.heads import ROLES, HeadSpec

__all__ = ["match_heads", "parse_head_spec"]



def parse_head_spec(name: str, value: Any) -> HeadSpec:
    """``H`` or ``{"heads": H, "axis": A, "role": R, "fused": F, "interleaved": bool}``."""
    if isinstance(value, HeadSpec):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        spec = HeadSpec(int(value))
    elif isinstance(value, dict):
        unknown = set(value) - {"heads", "axis", "role", "fused", "interleaved"}
        if unknown or "heads" not in value:
            raise SpecError(
                f"heads for {name} must be an int or a dict with keys heads, axis, role, fused, interleaved; "
                f"got {value!r}."
            )
        spec = HeadSpec(int(value["heads"]), int(value.get("axis", 0)), value.get("role"),
                        int(value.get("fused", 1)), bool(value.get("interleaved", False)))
    else:
        raise SpecError(f"heads for {name} must be an int or a dict; got {type(value).__name__} {value!r}.")
    if spec.heads < 1 or spec.fused < 1:
        raise SpecError(f"heads for {name}: heads and fused must be >= 1; got {value!r}.")
    if spec.role is not None and spec.role not in ROLES:
        raise SpecError(f"heads for {name}: role must be one of {ROLES}; got {spec.role!r}.")
    return spec


def match_heads(name: str, specs: dict[str, Any]) -> HeadSpec | None:
    """The spec of the first glob in *specs* that matches tensor *name*."""
    for glob, value in specs.items():
        if fnmatch.fnmatchcase(name, glob):
            return parse_head_spec(name, value)
    return None
