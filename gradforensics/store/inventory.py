"""What a store holds on disk, read without trusting it: one walk, no allocation.

A store arrives from someone else, so its listing is taken here by gradforensics
itself, before zarr or h5py are asked to read anything: every Zarr ``zarr.json``
is parsed with size limits and type checks, every chunk file is counted and
sized, and anything that could point outside the store (a symbolic link; an
HDF5 external link, external storage or virtual dataset) is refused.  The result
is a list of :class:`StoredArray`, which :mod:`gradforensics.store.reader`
checks against the schema.  A local Zarr directory is listed here; a Zarr store at a
URL by :mod:`gradforensics.store.remote_inventory`, an HDF5 file by
:mod:`gradforensics.store.hdf5_inventory`.  Chunk presence is computed from the files
that exist, never by walking a chunk grid whose size the metadata claims (an inflated
``shape`` would otherwise hang the open or allocate gigabytes).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.errors import CorruptStoreError, NotAStoreError
from gradforensics.store import generations
from gradforensics.store.generations import Selection

__all__ = ["DTYPES", "MAX_CHUNK_BYTES", "MAX_GRID_WALK", "MAX_METADATA_BYTES", "Inventory", "StoredArray",
           "chunk_index", "clear_parsed", "corrupt", "finish", "in_analysis", "is_marker_temporary", "parse_metadata", "refuse_links",
           "tolerate", "zarr_array", "zarr_inventory"]


#: A ``zarr.json`` larger than this is not metadata gradforensics wrote.
MAX_METADATA_BYTES = 16 << 20
#: A decoded chunk larger than this is not a chunk gradforensics wrote (policy chunks are ~8 MiB).
MAX_CHUNK_BYTES = 1 << 30
#: Beyond this many chunks in a grid, a missing chunk is counted, not located.
MAX_GRID_WALK = 1_000_000
#: the temporary a rank writes its progress marker into before renaming it to ``zarr.json``
#: (``ranks/<q>/.zarr.json.<pid>``, :func:`gradforensics.store.ranks.write_marker`); one left by a rank that died
#: is not part of the store: readers ignore it, the next writer removes it
_MARKER_TEMPORARY = re.compile(r"^\.zarr\.json\.\d+$")
DTYPES = frozenset({"float32", "float16", "float64", "uint16", "uint8", "int32", "int64"})


@dataclass
class StoredArray:
    """One array as found on disk (shape and chunks as the metadata claims them)."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    attrs: dict[str, Any]
    nbytes_stored: int = 0
    #: chunk index -> size in bytes of its file (Zarr), or the set of allocated chunks (HDF5)
    chunk_files: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: exact size every chunk file must have (uncompressed Zarr), else None
    chunk_file_bytes: int | None = None
    #: every chunk of the grid is known to be there (HDF5 counted them)
    all_present: bool = False

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * np.dtype(self.dtype).itemsize

    def grid(self, n_rows: int) -> tuple[int, ...]:
        shape = (min(n_rows, self.shape[0]), *self.shape[1:])
        return tuple(-(-s // c) for s, c in zip(shape, self.chunks, strict=True))

    def missing_chunks(self, n_rows: int) -> tuple[int, tuple[int, ...] | None]:
        """(how many chunks of the first *n_rows* rows have no data, the first of them if located)."""
        if self.all_present:
            return 0, None
        grid = self.grid(n_rows)
        expected = math.prod(grid)
        present = sum(1 for idx in self.chunk_files if all(i < g for i, g in zip(idx, grid, strict=False)))
        if present >= expected:
            return 0, None
        if expected > MAX_GRID_WALK:
            return expected - present, None
        first = next(idx for idx in np.ndindex(*grid) if tuple(idx) not in self.chunk_files)
        return expected - present, tuple(int(i) for i in first)

    @property
    def chunk_file_max(self) -> int:
        """The largest chunk file any compressor writes for one chunk: its bytes plus the worst-case expansion
        (blosc adds 16 bytes and stores incompressible data raw; zstd/gzip framing stays within 1/64 + 1 KiB)."""
        return self.chunk_nbytes + self.chunk_nbytes // 64 + 1024

    def chunk_file_expected(self) -> str:
        """What a chunk file's size must be, in words (for the error line)."""
        if self.chunk_file_bytes is not None:
            return str(self.chunk_file_bytes)
        return f"at most {self.chunk_file_max} (a compressed chunk of {self.chunk_nbytes} bytes)"

    def bad_chunk_file(self, n_rows: int) -> tuple[tuple[int, ...], int] | None:
        """A chunk file of the first *n_rows* rows whose size is not what its codecs write.

        Uncompressed: not the exact size.  Compressed: larger than any compressor writes
        (:attr:`chunk_file_max`), so a huge object in place of a chunk is refused from the
        listing, before a byte of it is downloaded.
        """
        grid = self.grid(n_rows)
        for idx, size in self.chunk_files.items():
            wrong = size != self.chunk_file_bytes if self.chunk_file_bytes is not None else size > self.chunk_file_max
            if wrong and all(i < g for i, g in zip(idx, grid, strict=False)):
                return idx, size
        return None


@dataclass(frozen=True)
class Inventory:
    """A store's root attributes and arrays, as listed by gradforensics itself."""

    root_attrs: dict[str, Any]
    #: by logical name: the committed generation's results appear as ``analysis/<key>``
    arrays: dict[str, StoredArray]
    #: which part of ``analysis/`` the arrays come from (:mod:`gradforensics.store.generations`)
    selection: Selection = field(default_factory=lambda: Selection(None))
    #: set when damaged analysis results were ignored
    analysis_note: str | None = None


def is_marker_temporary(rel: str) -> bool:
    """Whether *rel* (a path inside a store) is a rank's unfinished progress marker ``ranks/<q>/.zarr.json.<pid>``."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "ranks" and bool(_MARKER_TEMPORARY.match(parts[2]))


def in_analysis(rel: str) -> bool:
    return rel == generations.GROUP or rel.startswith(generations.GROUP + "/")


def finish(path: str, root_attrs: dict[str, Any], arrays: dict[str, StoredArray], current: str | None,
            damaged: list[str]) -> Inventory:
    visible, sel, note = generations.select(path, arrays, current, damaged)
    return Inventory(root_attrs, visible, sel, note)


def corrupt(path: str, where: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(f"{path}: {where}: {what}; the store's metadata is damaged.")


# ------------------------------------------------------------------ Zarr v3
def zarr_inventory(path: str, only: str | None = None, unlisted: Callable[[str], bool] | None = None) -> Inventory:
    """Every array of the Zarr v3 store at *path*, from its own ``zarr.json`` files.

    With *only* (a top-level group, e.g. ``"analysis"``), the root and that group alone
    are walked: what saving analysis results needs under the writer's lock, without
    listing the thousands of gradient arrays again.  The chunk trees of the arrays whose
    name *unlisted* accepts are not listed (no ``chunk_files``, ``nbytes_stored`` 0, a
    link inside them not seen): a store opened with ``check_chunks=False`` checks none
    of their chunks (``report`` of 2,000 tensors: 0.45 s of listing).
    """
    root = _zarr_root(path)
    arrays: list[StoredArray] = []
    root_attrs: dict[str, Any] = {}
    current: str | None = None
    damaged: list[str] = []
    stack = [""]
    while stack:                    # top-down, as os.walk; one scandir a directory, no stat per entry
        rel = stack.pop()
        here = root / rel if rel else root
        dirs, files, links = _entries(here)
        if links:
            raise CorruptStoreError(
                f"{path}: {'/'.join(filter(None, (rel, links[0])))} is a symbolic link; a store is data and may not "
                "point outside itself. Copy the store with the link resolved (cp -rL) if you trust it."
            )
        if not dirs and "zarr.json" not in (names := [f.name for f in files]) and files and \
                all(is_marker_temporary(f"{rel}/{n}") for n in names):
            continue                # a rank that died writing its first marker: nothing of the store
        try:
            meta = _zarr_node(path, rel, here, [f.name for f in files])
            arr = zarr_array(path, rel, meta) if meta is not None and meta.get("node_type") == "array" else None
        except CorruptStoreError:
            if not in_analysis(rel):
                raise
            damaged.append(rel)         # analysis results are derived data: ignored, never fatal
            continue
        if arr is not None:
            if "c" in dirs and (unlisted is None or not unlisted(rel)):
                _scan_chunks(path, arr, here / "c")
            arrays.append(arr)
            continue                # an array's directory holds only its chunk tree
        if meta is not None and not rel:
            root_attrs = meta.get("attributes") or {}
            if only is not None:
                dirs = [d for d in dirs if d == only]
        elif meta is not None and rel == generations.GROUP:
            current = generations.pointer(meta.get("attributes"))[0]
            sel = Selection(current)     # walk only the generation readers see
            dirs = [d for d in dirs if sel.visible(f"{rel}/{d}")]
        stack.extend(f"{rel}/{d}" if rel else d for d in reversed(dirs))
    return finish(path, root_attrs, {a.name: a for a in arrays}, current, damaged)


def _zarr_root(path: str) -> Path:
    """The directory of the Zarr group at *path*, or :class:`NotAStoreError` (a dangling link, no ``zarr.json``)."""
    root = Path(path)
    if root.is_symlink() and not root.is_dir():
        raise NotAStoreError(f"{path}: a symbolic link to nothing; expected a gradforensics store.")
    if not (root / "zarr.json").is_file():
        raise NotAStoreError(f"{path}: no Zarr v3 group here (zarr.json missing); expected a gradforensics store.")
    return root


def _zarr_node(path: str, rel: str, here: Path, files: list[str]) -> dict[str, Any] | None:
    """The parsed ``zarr.json`` of the directory *here* (None for a root without one), checked as a node."""
    if "zarr.json" not in files:
        if rel:
            raise corrupt(path, f"{rel}/", "the directory has no zarr.json (its metadata was deleted)")
        return None
    meta = _read_json(path, rel, here / "zarr.json")
    node = meta.get("node_type")
    if node not in ("group", "array"):
        raise corrupt(path, rel or "/", f"node_type {node!r} is neither 'group' nor 'array'")
    if node == "array" and not rel:
        raise NotAStoreError(f"{path}: a Zarr array, not a group; expected a gradforensics store.")
    return meta


def refuse_links(path: str) -> None:
    """:class:`CorruptStoreError` if anything inside the Zarr store at *path* is a symbolic link.

    Called before gradforensics writes into an existing store (``analysis/``): zarr
    replaces an array by deleting its directory, which through a link would delete
    and write files outside the store.
    """
    stack = [Path(path)]
    while stack:
        here = stack.pop()
        dirs, _, links = _entries(here)
        if links:
            raise CorruptStoreError(f"{path}: {(here / links[0]).relative_to(path).as_posix()} is a symbolic link; "
                                    "gradforensics never writes through a link inside a store.")
        stack.extend(here / d for d in dirs)


def _entries(here: Path) -> tuple[list[str], list[os.DirEntry[str]], list[str]]:
    """``(directories, files, symbolic links)`` directly inside *here*, sorted by name, from one ``scandir``.

    A link is never followed (nor counted as a directory or a file); the types come with the
    listing, so a store of thousands of arrays costs no ``lstat`` per entry.  A directory that
    cannot be listed gives nothing, as ``os.walk`` skips it.
    """
    dirs: list[str] = []
    files: list[os.DirEntry[str]] = []
    links: list[str] = []
    try:
        with os.scandir(here) as it:
            for e in it:
                if e.is_symlink():
                    links.append(e.name)
                elif e.is_dir(follow_symlinks=False):
                    dirs.append(e.name)
                else:
                    files.append(e)
    except OSError:             # what os.walk does with a directory it cannot list: nothing below it
        return [], [], []
    return sorted(dirs), sorted(files, key=lambda e: e.name), sorted(links)


def _read_json(path: str, rel: str, file: Path) -> dict[str, Any]:
    where = f"{rel}/zarr.json" if rel else "zarr.json"
    st = file.stat()
    if not stat.S_ISREG(st.st_mode):        # a named pipe would block the read until a writer came
        raise corrupt(path, where, "not a regular file (a named pipe, socket or device)")
    size = st.st_size
    if size > MAX_METADATA_BYTES:
        raise corrupt(path, where, f"{size} bytes, more than any metadata gradforensics writes")
    return parse_metadata(path, where, file.read_bytes())


def parse_metadata(path: str, where: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise corrupt(path, where, f"not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise corrupt(path, where, f"a JSON {type(doc).__name__}, not an object")
    if doc.get("zarr_format") != 3:
        raise corrupt(path, where, f"zarr_format {doc.get('zarr_format')!r}; gradforensics reads Zarr v3")
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise corrupt(path, where, "'attributes' is not an object")
    return doc


def _int_list(x: Any, minimum: int) -> tuple[int, ...] | None:
    if not isinstance(x, list) or not all(type(v) is int and v >= minimum for v in x):
        return None
    return tuple(x)


def zarr_array(path: str, rel: str, meta: dict[str, Any]) -> StoredArray:
    where = f"{rel}/zarr.json"
    shape = _int_list(meta.get("shape"), 0)
    if shape is None or not shape:
        raise corrupt(path, where, f"shape {meta.get('shape')!r} is not a list of non-negative integers")
    grid = meta.get("chunk_grid")
    conf = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = _int_list(conf.get("chunk_shape") if isinstance(conf, dict) else None, 1)
    if not isinstance(grid, dict) or grid.get("name") != "regular" or chunks is None or len(chunks) != len(shape):
        raise corrupt(path, where, f"chunk_grid {grid!r} is not a regular grid of {len(shape)} positive sizes")
    dtype = meta.get("data_type")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise corrupt(path, where, f"data_type {dtype!r} is not one gradforensics writes ({sorted(DTYPES)})")
    enc = meta.get("chunk_key_encoding")
    if enc != {"name": "default", "configuration": {"separator": "/"}}:
        raise corrupt(path, where, f"chunk_key_encoding {enc!r} is not the default '/' one gradforensics writes")
    _zarr_parse(path, where, meta)
    arr = StoredArray(rel, shape, chunks, str(dtype), dict(meta.get("attributes") or {}))
    if arr.chunk_nbytes > MAX_CHUNK_BYTES:
        raise corrupt(path, where, f"chunks of {arr.chunk_nbytes} bytes, beyond {MAX_CHUNK_BYTES} "
                                    "(gradforensics writes chunks of a few MiB)")
    arr.chunk_file_bytes = _exact_chunk_bytes(path, where, meta.get("codecs"), arr.chunk_nbytes)
    return arr


def _zarr_parse(path: str, where: str, meta: dict[str, Any]) -> None:
    """Let zarr parse the array metadata now, so its complaints (codec configuration,
    fill value, ...) are one line naming the file, not a traceback at the first read."""
    # hundreds of arrays share their metadata but for the attributes (any JSON object, which zarr
    # keeps as given) and the dimension names (one per tensor: they name it, and zarr checks only
    # their type and number, checked here): each distinct rest is parsed once per process
    rest = {k: v for k, v in meta.items() if k not in ("attributes", "dimension_names")}
    names = meta.get("dimension_names")
    if names is not None:
        if not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names):
            raise corrupt(path, where, f"dimension_names {names!r} is not a list of strings or nulls")
        if isinstance(meta.get("shape"), list) and len(names) != len(meta["shape"]):
            raise corrupt(path, where, f"{len(names)} dimension_names for {len(meta['shape'])} dimensions")
    key = json.dumps(rest, sort_keys=True, default=repr)
    if key in _PARSED:
        return
    try:
        _zarr_metadata(rest)
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as exc:
        raise corrupt(path, where, f"zarr cannot parse it ({type(exc).__name__}: {exc})") from exc
    if len(_PARSED) >= _MAX_PARSED:
        _PARSED.clear()
    _PARSED.add(key)


def _zarr_metadata(meta: Any) -> Any:
    """zarr's parse of the array metadata *meta* (``zarr.AsyncArray``'s, on an empty in-memory store)."""
    import zarr
    from zarr.storage import MemoryStore, StorePath

    return zarr.AsyncArray(meta, StorePath(MemoryStore())).metadata


#: Array metadata (without attributes and dimension names) zarr has parsed without complaint, as canonical JSON.
_PARSED: set[str] = set()
_MAX_PARSED = 4096


def clear_parsed() -> None:
    """Forget which array metadata zarr has parsed (each distinct one is parsed again on its next listing)."""
    _PARSED.clear()


def _exact_chunk_bytes(path: str, where: str, codecs: Any, nbytes: int) -> int | None:
    """The exact chunk file size the codec chain writes, when it is fixed (no compressor)."""
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        raise corrupt(path, where, f"codecs {codecs!r} is not a list of codec objects")
    names = [c.get("name") for c in codecs]
    if names[0] != "bytes":
        raise corrupt(path, where, f"codecs {names!r} do not start with 'bytes' as gradforensics writes them")
    if names == ["bytes"]:
        return nbytes
    if names == ["bytes", "crc32c"]:
        return nbytes + 4
    return None


def _scan_chunks(path: str, arr: StoredArray, cdir: Path) -> None:
    """Chunk files under an array's ``c/``: their indices and sizes (symbolic links refused)."""
    total = 0
    ndim = len(arr.shape)
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        here = cdir.joinpath(*parts)
        dirs, files, links = _entries(here)
        if links:
            rel = (here / links[0]).relative_to(Path(path)).as_posix()
            raise CorruptStoreError(f"{path}: {rel} is a symbolic link; a store is data and may not point "
                                    "outside itself.")
        for f in files:
            idx = chunk_index((*parts, f.name), ndim)
            size = f.stat(follow_symlinks=False).st_size
            total += size
            if idx is not None:
                arr.chunk_files[idx] = size
        stack.extend((*parts, d) for d in reversed(dirs))
    arr.nbytes_stored = total


def tolerate(exc: CorruptStoreError, rel: str, damaged: list[str]) -> None:
    """Damage under ``analysis/`` is noted (the results are derived data); anywhere else it is raised."""
    if not in_analysis(rel):
        raise exc
    damaged.append(rel)


def chunk_index(parts: tuple[str, ...], ndim: int) -> tuple[int, ...] | None:
    if len(parts) != ndim or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)
