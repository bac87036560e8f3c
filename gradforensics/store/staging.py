"""A new local store appears at its path with its identity, in one step.

The writer creates a store under a hidden sibling name (``.dump.zarr.creating-<pid>``), writes
its root metadata there *with* the ``gradforensics`` attribute, and renames it into place
(:func:`publish`): a process killed at any instant leaves either nothing at the store's path
or a store that opens with 0 records, never a bare Zarr group or a half-made HDF5 file that no
command would open or replace (issue 42).  What a writer killed before the rename left under
the hidden name is removed by the next writer of that store (:func:`clear_staged`), which
holds the store's lock, so no other writer can be making it.  (A store at a URL needs no
rename: its root ``zarr.json`` is one PUT that carries the identity.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gradforensics.errors import StoreExistsError
from gradforensics.store.pause import pause_point

__all__ = ["clear_staged", "publish", "staging_path"]

_TAG = ".creating-"


def staging_path(path: str | os.PathLike[str]) -> Path:
    """Where this process makes the store at *path* before it is renamed into place."""
    p = Path(path)
    return p.with_name(f".{p.name}{_TAG}{os.getpid()}")


def publish(staged: Path, path: str | os.PathLike[str]) -> None:
    """Rename *staged* to *path* (which must not exist: the writer cleared it under the lock)."""
    pause_point("store-creating")
    target = Path(path)
    if target.exists() or target.is_symlink():
        _remove(staged)
        raise StoreExistsError(f"{target} appeared while the store was being created; choose another path.")
    os.rename(staged, target)


def clear_staged(path: str | os.PathLike[str]) -> list[Path]:
    """Remove what killed writers of the store at *path* left under a staging name; returns what went.

    Only entries that are provably a staging store go: a regular file (an HDF5 store has only
    its root attributes when it is renamed), or a directory holding nothing but ``zarr.json``
    and zarr's temporary ``*.partial`` files.  The caller holds the store's lock.
    """
    p = Path(path)
    gone: list[Path] = []
    if not p.parent.is_dir():
        return gone
    for entry in p.parent.glob(f".{p.name}{_TAG}*"):
        if entry.name[len(p.name) + 1 + len(_TAG):].isdigit() and _is_staged(entry):
            _remove(entry)
            gone.append(entry)
    return gone


def _is_staged(entry: Path) -> bool:
    if entry.is_symlink():
        return False
    if entry.is_file():
        return True
    return entry.is_dir() and all(c.is_file() and not c.is_symlink() and (c.name == "zarr.json" or c.suffix == ".partial")
                                  for c in entry.iterdir())


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)
