"""Generations of ``analysis/``: results that a killed pass cannot leave half written.

``analyze`` never writes over the results a reader may be reading.  Each write of
results makes a new *generation*, ``analysis/gen-<time>-<pid>-<random>/``, holds
everything of that write (and what it carries over from the last one), and is
*committed* by one small metadata write at the end: the ``analysis`` group's
attribute ``gradforensics.analysis = {"current": <generation>, "previous": ...}``.
On a local Zarr directory zarr writes metadata to a temporary file and renames it;
on object storage a PUT replaces the object whole: either way a reader sees the old
pointer or the new one, never a torn one.

Readers (:mod:`gradforensics.store.inventory`) see only the current generation,
under the logical names ``analysis/<key>``: an unfinished generation is invisible,
damage anywhere else under ``analysis/`` is ignored, and damage inside the current
one drops the results as a whole (the store then reads as "not analysed yet" and
``analyze`` writes them anew).  A store written before generations existed keeps its
results directly under ``analysis/`` (no pointer); they are read as they are.

The next write removes every other generation but the one it replaced (a reader that
opened it a moment ago can still finish) and, after the first commit, the flat
results of the old layout.

HDF5 has no atomic rename and the file's own metadata is written by the HDF5
library when it flushes: the generation and its pointer work the same way there,
and a pass killed with SIGKILL at the tested points (``tests/test_analyze_crash.py``)
left a file that reads, but HDF5 itself promises no consistency after a writer dies
mid-flush.  Zarr is the backend to trust with that.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ATTR", "GROUP", "Selection", "is_generation", "new_generation", "pointer", "select"]

GROUP = "analysis"
#: Attribute of the ``analysis`` group naming the committed generation.
ATTR = "gradforensics.analysis"
_NAME = re.compile(r"gen-[0-9]{20}-[0-9]{1,10}-[0-9a-f]{6}")


def new_generation() -> str:
    """A fresh generation name; later names sort after earlier ones."""
    return f"gen-{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(3)}"


def is_generation(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def pointer(attrs: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """``(current, previous)`` from the ``analysis`` group's attributes; ``None`` where absent or not a name."""
    doc = (attrs or {}).get(ATTR) if isinstance(attrs, Mapping) else None
    if not isinstance(doc, Mapping):
        return None, None
    cur, prev = doc.get("current"), doc.get("previous")
    return (cur if isinstance(cur, str) and is_generation(cur) else None,
            prev if isinstance(prev, str) and is_generation(prev) else None)


class Selection:
    """Which part of ``analysis/`` readers see: the committed generation, or the old flat layout."""

    def __init__(self, current: str | None) -> None:
        self.current = current
        self.prefix = f"{GROUP}/{current}" if current else GROUP

    def visible(self, rel: str) -> bool:
        """Whether the store path *rel* (a node or a key) is part of what readers see."""
        if rel != GROUP and not rel.startswith(GROUP + "/"):
            return True
        if rel in (GROUP, f"{GROUP}/zarr.json"):
            return True                      # the group itself (its pointer)
        child = rel.split("/", 2)[1]
        if self.current:
            return child == self.current
        return not child.startswith("gen-")

    def logical(self, name: str) -> str:
        """``analysis/<generation>/<key>`` -> ``analysis/<key>``; anything else unchanged."""
        if self.current and name.startswith(self.prefix + "/"):
            return f"{GROUP}/{name[len(self.prefix) + 1:]}"
        return name

    def physical(self, name: str) -> str:
        """``analysis/<key>`` -> where it lies on disk."""
        if self.current and name.startswith(GROUP + "/"):
            return f"{self.prefix}/{name[len(GROUP) + 1:]}"
        return name


def select(path: str, arrays: Mapping[str, Any], current: str | None,
           damaged: Iterable[str]) -> tuple[dict[str, Any], Selection, str | None]:
    """The arrays readers see, renamed to logical names, and a note when results were dropped.

    *arrays* are the store's arrays by physical name (only visible ones need be
    there); *damaged* the store paths under ``analysis/`` whose metadata could not
    be read.  Damage inside what readers would see drops every result (a partial
    set of results is never read): the store reads as not analysed yet.
    """
    sel = Selection(current)
    bad = [d for d in damaged if sel.visible(d)]
    out: dict[str, Any] = {}
    for name, arr in arrays.items():
        if name.startswith(GROUP + "/"):
            if bad or not sel.visible(name):
                continue
            arr.name = sel.logical(name)
        out[arr.name] = arr
    note = None
    if bad:
        note = (f"{path}: the stored analysis results are damaged ({bad[0]}) and were ignored; "
                "`gradforensics analyze` writes them anew.")
    return out, sel, note
