"""What a Zarr store at an fsspec URL holds, from one listing of its keys, read without trusting it.

The checks of :mod:`gradforensics.store.inventory` on a local directory, on object storage.
"""

from __future__ import annotations

from typing import Any

from gradforensics.errors import CorruptStoreError, NotAStoreError
from gradforensics.store import generations
from gradforensics.store.generations import Selection
from gradforensics.store.inventory import (
    MAX_METADATA_BYTES,
    Inventory,
    StoredArray,
    chunk_index,
    corrupt,
    finish,
    is_marker_temporary,
    parse_metadata,
    tolerate,
    zarr_array,
)

__all__ = ["remote_zarr_inventory"]


def remote_zarr_inventory(url: str, storage_options: dict[str, Any] | None = None) -> Inventory:
    """:func:`zarr_inventory` of a Zarr store at an fsspec URL, from one listing of its keys.

    The same checks as on a local directory: every ``zarr.json`` is size-limited
    and parsed strictly, chunk objects are counted and sized from the listing (never
    from the grid the metadata claims), a prefix holding keys but no ``zarr.json``
    is damage, and a key with an empty, ``.`` or ``..`` segment (which could name
    something outside the store once mapped to a path) is refused.
    """
    from gradforensics.store import remote

    fs, root = remote.filesystem(url, storage_options)
    listing = remote.translated(url, lambda: fs.find(root, withdirs=False, detail=True),
                                op="listing the store")
    files: dict[str, int] = {}
    for full, info in listing.items():
        full = str(full)
        if not full.startswith(root + "/"):
            continue
        rel = full[len(root) + 1:]
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise CorruptStoreError(f"{url}: key {rel!r} has an empty, '.' or '..' segment; a store's names stay "
                                    "inside the store.")
        if not is_marker_temporary(rel):       # a dead rank's unfinished marker: not part of the store
            files[rel] = int(info.get("size") or 0)
    if not files:                    # the message of a local path that does not exist
        raise NotAStoreError(f"{url}: no such file or directory (no object under this prefix, zarr.json missing); "
                             "expected a gradforensics store.")
    if "zarr.json" not in files:
        raise NotAStoreError(f"{url}: no Zarr v3 group here (zarr.json missing); expected a gradforensics store.")
    damaged: list[str] = []
    group_json = f"{generations.GROUP}/zarr.json"
    current = None
    group: dict[str, dict[str, Any]] = {}
    if group_json in files:          # the pointer first: the listing is then cut to what readers see
        group = _remote_metadata(url, fs, root, {group_json: files[group_json]}, damaged)
        current = generations.pointer((group.get(generations.GROUP) or {}).get("attributes"))[0]
    sel = Selection(current)
    files = {k: v for k, v in files.items() if sel.visible(k)}
    rest = {k: v for k, v in files.items() if k != group_json}     # the pointer's group is fetched already
    metas = {**_remote_metadata(url, fs, root, rest, damaged), **group}
    return _inventory_of_listing(url, files, metas, current, damaged)


def _remote_metadata(url: str, fs: Any, root: str, files: dict[str, int],
                     damaged: list[str]) -> dict[str, dict[str, Any]]:
    """Every ``zarr.json`` outside an array's chunk tree, size-checked, fetched in one batch, parsed.

    Damage under ``analysis/`` is appended to *damaged* instead of raised.
    """
    from gradforensics.store import remote

    keys = sorted(k for k in files if k == "zarr.json" or k.endswith("/zarr.json"))
    keys = [k for k in keys if "/c/" not in f"/{k}"]
    for k in list(keys):
        if files[k] > MAX_METADATA_BYTES:
            err = corrupt(url, k, f"{files[k]} bytes, more than any metadata gradforensics writes")
            tolerate(err, k, damaged)
            keys.remove(k)
    raw = remote.translated(url, lambda: fs.cat([f"{root}/{k}" for k in keys], on_error="raise"),
                            op="reading the metadata")
    out = {}
    for k in keys:
        node = k.rsplit("zarr.json", 1)[0].rstrip("/")
        try:
            out[node] = parse_metadata(url, k, raw[f"{root}/{k}"])
        except CorruptStoreError as exc:
            tolerate(exc, node, damaged)
    return out


def _inventory_of_listing(url: str, files: dict[str, int], metas: dict[str, dict[str, Any]],
                          current: str | None = None, damaged: list[str] | None = None) -> Inventory:
    """The inventory from a flat listing (relative key -> size) and the parsed metadata by node prefix."""
    damaged = [] if damaged is None else damaged
    arrays: dict[str, StoredArray] = {}
    for rel in sorted(metas):
        if _owner(rel, arrays) is not None:
            continue                     # an array's prefix holds only its chunk tree
        meta = metas[rel]
        node = meta.get("node_type")
        if node == "group":
            continue
        try:
            if node != "array":
                raise corrupt(url, rel or "/", f"node_type {node!r} is neither 'group' nor 'array'")
            if not rel:
                raise NotAStoreError(f"{url}: a Zarr array, not a group; expected a gradforensics store.")
            arrays[rel] = zarr_array(url, rel, meta)
        except CorruptStoreError as exc:
            tolerate(exc, rel, damaged)
    for key, size in files.items():      # every prefix above a key is a node, or inside an array
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            arr = arrays.get(prefix)
            if arr is not None:
                if parts[i] == "c" and len(parts) > i + 1:
                    arr.nbytes_stored += size
                    idx = chunk_index(tuple(parts[i + 1:]), len(arr.shape))
                    if idx is not None:
                        arr.chunk_files[idx] = size
                break
            if prefix not in metas:
                if any(prefix == d or prefix.startswith(d + "/") for d in damaged):
                    break
                tolerate(corrupt(url, f"{prefix}/", "the prefix has no zarr.json (its metadata was deleted)"),
                          prefix, damaged)
                break
    root = metas[""]
    root_attrs = (root.get("attributes") or {}) if root.get("node_type") == "group" else {}
    return finish(url, root_attrs, arrays, current, damaged)


def _owner(rel: str, arrays: dict[str, StoredArray]) -> str | None:
    """The array whose prefix strictly contains *rel*, if any."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if prefix in arrays:
            return prefix
    return None
