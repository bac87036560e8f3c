"""The Zarr v3 backend: a local directory, or a prefix at an fsspec URL (:mod:`gradforensics.store.remote`).

One of the backends of :data:`~gradforensics.store.backends.BACKENDS`; it follows the
:class:`~gradforensics.store.backends.StoreBackend` protocol.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from gradforensics.errors import CorruptStoreError, NotAStoreError
from gradforensics.store import remote
from gradforensics.store.inventory import Inventory, refuse_links, zarr_inventory
from gradforensics.store.layout import dimension_names
from gradforensics.store.location import Location, located
from gradforensics.store.remote_inventory import remote_zarr_inventory
from gradforensics.store.staging import publish, staging_path
from gradforensics.store.url_reads import read_store

__all__ = ["ZarrBackend", "read_url_array"]


def _zarr_codecs(compression: str, checksum: bool) -> dict[str, Any]:
    """Bytes-to-bytes codecs of a new array: the compressor, then the chunk's CRC-32C."""
    import zarr.codecs as zc

    codecs: list[Any] = []
    if compression == "zstd":
        codecs.append(zc.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle"))
    elif compression == "bitshuffle":
        codecs.append(zc.BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"))
    elif compression != "none":
        raise ValueError(compression)
    if checksum:
        codecs.append(zc.Crc32cCodec())
    return {"compressors": codecs or None}


#: zarr's temporary file of a metadata write (``zarr.json`` is written beside, then renamed): what a writer
#: killed during a commit leaves; ours, so ``overwrite=True`` may delete it with the store
_ZARR_TEMP = re.compile(r"^zarr\.[0-9a-f]{32}\.partial$")


class ZarrBackend:
    """Zarr v3 store: a local directory, or a prefix at an fsspec URL (:mod:`gradforensics.store.remote`)."""

    kind: ClassVar[str] = "zarr"
    suffixes: ClassVar[tuple[str, ...]] = (".zarr",)
    description: ClassVar[str] = "a Zarr directory"
    remote_ok: ClassVar[bool] = True
    remote_refusal: ClassVar[str] = ""
    rewrites_chunks: ClassVar[bool] = True

    @classmethod
    def read_array(cls, location: Location, name: str, sel: Any) -> np.ndarray:
        from gradforensics.store.handles import open_zarr_array

        if location.is_url:
            return read_url_array(location.path, name, sel, location.storage_options)
        return np.asarray(open_zarr_array(location.path, name)[sel])     # opened once while its zarr.json holds

    @classmethod
    def not_a_store(cls, path: Path) -> str | None:
        if not path.is_dir():
            return "is not a directory"
        if _unfinished(path):
            return None
        try:
            root = json.loads((path / "zarr.json").read_text())
            if not isinstance(root.get("attributes", {}).get("gradforensics"), dict):
                return "is a Zarr group but not a gradforensics store"
        except (OSError, ValueError, AttributeError):
            return "is not a Zarr group (no readable zarr.json)"
        for top, dirs, files in os.walk(path):
            rel = Path(top).relative_to(path).parts
            for entry in [*dirs, *files]:
                if (Path(top) / entry).is_symlink():
                    return f"holds a symbolic link ({Path(*rel, entry)})"
            for f in files:
                if f != "zarr.json" and "c" not in rel and not _ZARR_TEMP.match(f):
                    return f"holds {Path(*rel, f)}, which no gradforensics store holds"
        return None

    @classmethod
    def create_store(cls, location: Location, attrs: dict[str, Any]) -> ZarrBackend:
        """A new store whose root ``zarr.json`` carries *attrs* from the write that creates it.

        Locally it is made under a staging name and renamed into place
        (:mod:`gradforensics.store.staging`); at a URL the root ``zarr.json`` is one PUT.
        """
        import zarr

        if location.is_url:
            return cls(location, "w", root_attrs=attrs)
        staged = staging_path(location.path)
        zarr.open_group(str(staged), mode="w", zarr_format=3, attributes=attrs)
        publish(staged, location.path)
        return cls(location, "a")

    def __init__(self, where: Location | str | os.PathLike[str], mode: str = "r",
                 storage_options: Mapping[str, Any] | None = None, root_attrs: dict[str, Any] | None = None) -> None:
        self.location = located(where, storage_options)
        self._root_attrs = root_attrs if mode == "w" else None     # written with the group's creation
        self.path = self.location.path
        self.mode = mode
        self.url = self.location.is_url
        self.storage_options = dict(self.location.storage_options)
        if mode == "r" and not self.url and not (Path(self.path) / "zarr.json").is_file():
            raise NotAStoreError(f"{self.path}: no Zarr v3 group here (zarr.json missing); expected a gradforensics store.")
        self.writable = mode != "r"
        self._open: dict[str, Any] = {}   # arrays opened here keep their write config
        if mode == "a" and not self.url:   # object storage has no links; its names are checked by the inventory
            refuse_links(self.path)
        if self.writable:
            self._root  # noqa: B018  (a writer creates or opens the group now)

    @cached_property
    def _root(self) -> Any:
        """The zarr group, opened on first use (a reader lists the store by :meth:`inventory` first)."""
        import zarr

        if self.url:
            store = self._zarr_store = remote.zarr_store(self.path, self.mode == "r", self.storage_options,
                                                         fenced=self.mode != "r")
            return remote.translated(self.path, lambda: zarr.open_group(
                store, mode=self.mode, zarr_format=3, use_consolidated=False,  # type: ignore[arg-type]
                attributes=self._root_attrs), op="opening the store")
        try:
            return zarr.open_group(self.path, mode=self.mode, zarr_format=3, use_consolidated=False,  # type: ignore[arg-type]
                                   attributes=self._root_attrs)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptStoreError(f"{self.path}: zarr cannot open the root group ({type(exc).__name__}: {exc}); "
                                    "the store's metadata is damaged.") from exc

    def fence(self, check: Callable[[], None]) -> None:
        """Make every later write at an ``s3://`` URL conditional, *check* (the writer lock's) asked on a failed one.

        From here on a write of this writer cannot land in a store another writer took
        over (:mod:`gradforensics.store.fenced`); a local store has its lock file instead.
        """
        store = getattr(self, "_zarr_store", None) if self.url else None
        if store is not None and hasattr(type(store), "check"):
            store.check = check

    def inventory(self, unlisted: Callable[[str], bool] | None = None) -> Inventory:
        """Root attributes and every array, from the store's own files, without trusting them.

        Locally the chunk trees of the arrays *unlisted* accepts are not listed; at a URL
        one listing gives every key anyway.
        """
        if self.url:
            return remote_zarr_inventory(self.path, self.storage_options)
        return zarr_inventory(self.path, unlisted=unlisted)

    def _array(self, name: str) -> Any:
        arr = self._open.get(name)
        if arr is None:
            arr = self._root[name]
            if self.writable:
                arr = arr.with_config({"write_empty_chunks": True})
            self._open[name] = arr
        return arr

    # attributes -----------------------------------------------------------
    def root_attrs(self) -> dict[str, Any]:
        return dict(self._root.attrs)

    def set_root_attr(self, key: str, value: dict[str, Any]) -> None:
        self._io(lambda: self._root.attrs.__setitem__(key, value), f"writing the root attribute {key}")

    def attrs(self, name: str) -> dict[str, Any]:
        return dict(self._root[name].attrs)

    def _io(self, fn: Any, op: str | None = None) -> Any:
        """``fn()``; at a URL retried on transient network errors (every write here is idempotent); *op* names it."""
        return remote.translated(self.path, fn, op=op) if self.url else fn()

    # arrays ---------------------------------------------------------------
    def create(self, name: str, shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
               attrs: dict[str, Any], compression: str = "none", checksum: bool = True) -> None:
        from zarr.errors import ContainsArrayError, ContainsGroupError

        def make(overwrite: bool) -> Any:
            return self._root.create_array(
                name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
                attributes=attrs, config={"write_empty_chunks": True}, overwrite=overwrite,
                dimension_names=dimension_names(name, len(shape), attrs),
                **_zarr_codecs(compression, checksum))

        try:     # a new store at a URL: no listing of each prefix first
            self._open[name] = self._io(lambda: make(not (self.url and self.mode == "w")), f"creating {name}")
        except (ContainsArrayError, ContainsGroupError):
            if not self.url:
                raise
            # a node this writer did not make, in the store it created: what a writer fenced out of it left
            # (docs/stores-you-did-not-write.md); the owner replaces it (a fenced store asks its lock first)
            self._open[name] = self._io(lambda: make(True), f"creating {name}")

    def write_rows(self, name: str, start: int, data: np.ndarray) -> None:
        arr = self._array(name)
        stop = start + data.shape[0]
        if arr.shape[0] < stop:
            self._io(lambda: arr.resize((stop, *arr.shape[1:])), f"growing {name}")
        self._io(lambda: arr.__setitem__(slice(start, stop), data), f"writing rows of {name}")

    def truncate(self, name: str, n: int) -> None:
        arr = self._array(name)
        if arr.shape[0] != n:
            self._io(lambda: arr.resize((n, *arr.shape[1:])), f"resizing {name}")

    def names(self) -> list[str]:
        return sorted(_walk_zarr(self._root))

    def info(self, name: str) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
        arr = self._root[name]
        return tuple(arr.shape), str(arr.dtype), tuple(arr.chunks)

    def has(self, name: str) -> bool:
        try:
            self._root[name]
        except KeyError:
            return False
        return True

    def read(self, name: str, sel: tuple[slice, ...] | slice = slice(None)) -> np.ndarray:
        return np.asarray(self._io(lambda: self._root[name][sel], f"reading {name}"))

    # groups (the analysis generations) -------------------------------------
    def group_attrs(self, name: str) -> dict[str, Any]:
        """Attributes of group *name*; ``{}`` if there is none (or it cannot be read)."""
        try:
            return dict(self._io(lambda: self._root[name].attrs, f"reading the attributes of {name}"))
        except (KeyError, ValueError, TypeError, OSError):
            return {}

    def set_group_attr(self, name: str, key: str, value: Any) -> None:
        """One metadata write: zarr replaces ``name/zarr.json`` whole (a rename locally, one PUT at a URL)."""
        group = self._io(lambda: self._root.require_group(name), f"creating {name}")
        self._io(lambda: group.attrs.__setitem__(key, value), f"writing the attribute {key} of {name}")

    def children(self, name: str) -> list[str]:
        """The names of the nodes directly inside group *name* (from the file system, not zarr's metadata)."""
        if self.url:
            fs, root = remote.filesystem(self.path, self.storage_options)
            try:
                entries = self._io(lambda: fs.ls(f"{root}/{name}", detail=True), f"listing {name}")
            except FileNotFoundError:
                return []
            return sorted(str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries
                          if e.get("type") == "directory")
        d = Path(self.path) / name
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.is_symlink()) if d.is_dir() else []

    def delete(self, name: str) -> None:
        """Remove node *name* and everything under it."""
        if self.url and getattr(getattr(self, "_zarr_store", None), "check", None) is not None:
            # a fenced writer: through its store, each object conditional on the ETag its own write got
            self._io(lambda: self._root.__delitem__(name), f"deleting {name}")
        elif self.url:
            fs, root = remote.filesystem(self.path, self.storage_options)
            self._io(lambda: fs.rm(f"{root}/{name}", recursive=True), f"deleting {name}")
        else:
            import shutil

            shutil.rmtree(Path(self.path) / name, ignore_errors=False)
        self._open = {k: v for k, v in self._open.items() if k != name and not k.startswith(name + "/")}

    def flush(self) -> None:
        """Nothing to do: every zarr write above has landed when it returns."""

    def close(self) -> None:
        pass


def _unfinished(path: Path) -> bool:
    """Whether the directory *path* holds nothing to lose: empty, or an empty Zarr group without attributes.

    What a writer killed as it created the store could leave (before the store was created
    under a staging name and renamed, :mod:`gradforensics.store.staging`): ``overwrite``
    replaces it.  zarr's temporary ``*.partial`` files of that one write may be beside it.
    """
    entries = list(path.iterdir())
    if any(e.is_symlink() or not e.is_file() or (e.name != "zarr.json" and not _ZARR_TEMP.match(e.name)) for e in entries):
        return False
    if not (path / "zarr.json").is_file():
        return True
    try:
        root = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(root, dict) and root.get("node_type") == "group" and not root.get("attributes")


def _walk_zarr(group: Any) -> list[str]:
    out = [name for name, _ in group.arrays()]
    for gname, sub in group.groups():
        out += [f"{gname}/{a}" for a in _walk_zarr(sub)]
    return out


def read_url_array(url: str, name: str, sel: Any, storage_options: Mapping[str, Any] | None) -> np.ndarray:
    """``sel`` of array *name* of the Zarr store at *url*: two requests (its metadata, its chunks), retried."""
    import zarr

    def read() -> np.ndarray:
        store = read_store(url, storage_options)
        return np.asarray(zarr.open_array(store, path=name, mode="r")[sel])

    return remote.translated(url, read, op=f"reading {name}")
