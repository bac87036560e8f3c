"""Parse the analysis results a store holds, strictly: ``analysis/findings``, ``tables/<name>``, ``series/<name>``.

``gradforensics analyze`` persists its :class:`~gradforensics.analysis.engine.model.Findings`
in the store so ``gradforensics report`` can re-render them.  A store may come
from someone else, so these documents are checked once, here, at the boundary
(design, "Store safety"): analysis names must be lower-case identifiers (they
become ``tables/<name>.csv``), every flag field has its type and range, tables
are rectangular with string column names and scalar cells, and the series blobs
are plain, uncompressed ``.npz`` images whose arrays hold the bytes their
headers declare.  Anything else is a :class:`~gradforensics.errors.CorruptStoreError`
naming the store, the document and what is wrong - never a ``KeyError`` or
``TypeError`` traceback.  Names are not otherwise restricted here: they are
data, and every output escapes them (:mod:`gradforensics._text`).
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CorruptStoreError, UnsafeNameError
from gradforensics.store.names import check_analysis_name

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.analysis.engine.model import Flag
    from gradforensics.store.reader import Store

__all__ = ["FLAG_FIELDS", "parse_flag", "parse_series", "parse_table", "read_findings"]

#: Fields of a flag (the flags.json contract); every one is required.
FLAG_FIELDS = ("kind", "tensor", "head", "sources", "severity", "records", "evidence", "summary")
#: Deepest nesting of lists and objects accepted in a header or an evidence object.
MAX_DEPTH = 16
MODES = ("training", "replay")
_NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def _bad(where: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(f"{where}: {what}.")


def _show(value: Any, limit: int = 60) -> str:
    """``repr`` of *value*, shortened: one line, control characters escaped."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in items)
    return False


def _str_list(value: Any, where: str, key: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise _bad(where, f"{key} must be a list of strings; got {_show(value)}")
    return list(value)


# ------------------------------------------------------------------ flags
def parse_flag(d: Any, where: str = "flag") -> Flag:
    """A :class:`~gradforensics.analysis.engine.model.Flag` from its ``to_dict`` form, every field checked.

    Raises
    ------
    CorruptStoreError
        A field is missing, unknown, of the wrong type or out of range; the
        message starts with *where*.
    """
    from gradforensics.analysis.engine.model import FLAG_KINDS, Flag

    if not isinstance(d, Mapping):
        raise _bad(where, f"a flag must be an object; got {type(d).__name__}")
    missing = [k for k in FLAG_FIELDS if k not in d]
    unknown = sorted(str(k) for k in d if k not in FLAG_FIELDS)
    if missing or unknown:
        raise _bad(where, f"missing field(s) {missing}, unknown field(s) {_show(unknown)}; a flag has {list(FLAG_FIELDS)}")
    if d["kind"] not in FLAG_KINDS:
        raise _bad(where, f"kind must be one of {', '.join(FLAG_KINDS)}; got {_show(d['kind'])}")
    if not isinstance(d["tensor"], str) or not d["tensor"]:
        raise _bad(where, f"tensor must be a non-empty string; got {_show(d['tensor'])}")
    head = d["head"]
    if head is not None and not (_is_int(head) and head >= 0):
        raise _bad(where, f"head must be null or a non-negative integer; got {_show(head)}")
    sev = d["severity"]
    if not (_is_number(sev) and math.isfinite(sev) and 0.0 <= sev <= 1.0):
        raise _bad(where, f"severity must be a finite number in [0, 1]; got {_show(sev)}")
    rec = d["records"]
    if not (isinstance(rec, (list, tuple)) and len(rec) == 2 and all(_is_int(r) for r in rec)
            and 0 <= rec[0] <= rec[1]):
        raise _bad(where, f"records must be two integers [since, last] with 0 <= since <= last; got {_show(rec)}")
    sources = _str_list(d["sources"], where, "sources")
    if len(set(sources)) != len(sources):
        raise _bad(where, f"sources repeat a name: {_show(sources)}")
    if not isinstance(d["evidence"], Mapping) or not all(isinstance(k, str) for k in d["evidence"]):
        raise _bad(where, f"evidence must be an object; got {_show(d['evidence'])}")
    if _too_deep(dict(d["evidence"])):
        raise _bad(where, f"evidence is nested deeper than {MAX_DEPTH} levels")
    if not isinstance(d["summary"], str):
        raise _bad(where, f"summary must be a string; got {_show(d['summary'])}")
    return Flag(kind=d["kind"], tensor=d["tensor"], head=head, sources=tuple(sources), severity=float(sev),
                records=(rec[0], rec[1]), evidence=dict(d["evidence"]), summary=d["summary"])


# ------------------------------------------------------------------ documents
def _document(store: Store, key: str) -> Any:
    try:
        return store.read_document(key)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise _bad(f"{store.path}: analysis/{key}", f"is not a JSON document ({type(exc).__name__}: "
                   f"{_show(str(exc), 120)}); the stored analysis results are damaged, "
                   "run `gradforensics analyze` again") from exc


def parse_table(doc: Any, where: str) -> pd.DataFrame:
    """An analysis table from its stored ``{"columns": [...], "data": [[...], ...]}`` form."""
    import pandas as pd

    if not isinstance(doc, dict) or "columns" not in doc or "data" not in doc:
        raise _bad(where, "a table must be an object with 'columns' and 'data'")
    columns = _str_list(doc["columns"], where, "columns")
    if len(set(columns)) != len(columns):
        raise _bad(where, f"columns repeat a name: {_show(columns)}")
    data = doc["data"]
    if not isinstance(data, list):
        raise _bad(where, f"data must be a list of rows; got {type(data).__name__}")
    head = columns.index("head") if "head" in columns else None
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(columns):
            raise _bad(where, f"row {i} must be a list of {len(columns)} cells; got {_show(row)}")
        if not all(c is None or isinstance(c, (str, int, float)) for c in row):
            raise _bad(where, f"row {i} holds a cell that is not a string, number or null: {_show(row)}")
        h = None if head is None else row[head]
        if h is not None and not (_is_number(h) and math.isfinite(h) and h >= 0 and h == int(h)):
            raise _bad(where, f"row {i}: head must be null or a non-negative integer; got {_show(h)}")
    return pd.DataFrame(data, columns=columns)


def parse_series(raw: Any, where: str = "series") -> dict[str, np.ndarray]:
    """The series of one analysis from its stored ``.npz`` image (see ``pack_series``).

    The image must be what ``pack_series`` writes: a zip of uncompressed ``.npy``
    members (no pickle), ``__keys__`` a 1-D string array and ``s0``...``s{n-1}``
    one array per key, each holding the bytes its header declares - so neither
    a decompression bomb nor an inflated shape can make the reader allocate
    more than the store holds.
    """
    arr = np.asarray(raw)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise _bad(where, f"must be a 1-D uint8 array (an .npz image); got {arr.dtype} {arr.shape}")
    blob = arr.tobytes()
    try:
        if blob[:4] not in _NPZ_MAGIC:
            raise ValueError("not a zip archive")
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            for info in zf.infolist():
                _check_member(zf, info)
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            keys = z["__keys__"]
            if keys.ndim != 1 or (keys.size and keys.dtype.kind != "U"):
                raise ValueError(f"__keys__ is a {keys.dtype} array of shape {keys.shape}, not a list of names")
            if sorted(z.files) != sorted(["__keys__", *(f"s{i}" for i in range(keys.size))]):
                raise ValueError(f"members {sorted(z.files)[:8]} do not match the {keys.size} keys")
            return {str(k): z[f"s{i}"] for i, k in enumerate(keys)}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise _bad(where, f"is not a series image gradforensics wrote ({type(exc).__name__}: "
                   f"{_show(str(exc), 120)})") from exc


def _check_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """One ``.npy`` member: stored, not compressed; no objects; no more data declared than held."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"member {info.filename!r} is compressed; gradforensics stores series uncompressed")
    with zf.open(info) as fp:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"member {info.filename!r} has .npy version {version}")
    if dtype.hasobject:
        raise ValueError(f"member {info.filename!r} holds Python objects")
    if math.prod(shape) * dtype.itemsize > info.file_size:
        raise ValueError(f"member {info.filename!r} declares shape {shape} of {dtype}, more than its "
                         f"{info.file_size} bytes")


# ------------------------------------------------------------------ findings
def _findings_doc(doc: Any, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise _bad(where, f"must be an object; got {type(doc).__name__}")
    missing = [k for k in ("store", "n_records", "mode", "sources", "header", "flags", "analyses") if k not in doc]
    if missing:
        raise _bad(where, f"missing field(s) {missing}")
    if not isinstance(doc["store"], str):
        raise _bad(where, f"store must be a string; got {_show(doc['store'])}")
    if not (_is_int(doc["n_records"]) and doc["n_records"] >= 0):
        raise _bad(where, f"n_records must be a non-negative integer; got {_show(doc['n_records'])}")
    if doc["mode"] not in MODES:
        raise _bad(where, f"mode must be one of {', '.join(MODES)}; got {_show(doc['mode'])}")
    if not isinstance(doc["header"], dict) or _too_deep(doc["header"]):
        raise _bad(where, f"header must be an object nested at most {MAX_DEPTH} levels deep")
    if not isinstance(doc["flags"], list):
        raise _bad(where, f"flags must be a list; got {type(doc['flags']).__name__}")
    if not isinstance(doc["analyses"], list):
        raise _bad(where, f"analyses must be a list; got {type(doc['analyses']).__name__}")
    for i, name in enumerate(doc["analyses"]):
        try:
            check_analysis_name(name, f"{where}: analyses[{i}]")
        except UnsafeNameError as exc:
            raise CorruptStoreError(str(exc)) from exc
    if len(set(doc["analyses"])) != len(doc["analyses"]):
        raise _bad(where, f"analyses repeat a name: {_show(doc['analyses'])}")
    return doc


def read_findings(store: Store) -> dict[str, Any]:
    """The keyword arguments of :class:`~gradforensics.analysis.engine.model.Findings` stored in *store*.

    Raises
    ------
    CorruptStoreError
        A stored document is not JSON or not what ``analyze`` writes (named).
    MissingArrayError
        A table or series the findings name is absent.
    """
    from gradforensics.analysis.engine.model import AnalysisResult

    where = f"{store.path}: analysis/findings"
    doc = _findings_doc(_document(store, "findings"), where)
    n = doc["n_records"]
    flags = []
    for i, d in enumerate(doc["flags"]):
        flag = parse_flag(d, f"{where}: flags[{i}]")
        if flag.records[1] >= max(n, 1):
            raise _bad(f"{where}: flags[{i}]", f"records {list(flag.records)} are not inside the store's {n} records")
        flags.append(flag)
    results = {}
    for name in doc["analyses"]:
        table = parse_table(_document(store, f"tables/{name}"), f"{store.path}: analysis/tables/{name}")
        series = parse_series(store.read(f"analysis/series/{name}"), f"{store.path}: analysis/series/{name}")
        results[name] = AnalysisResult(table=table, series=series)
    return {"store": doc["store"], "n_records": n, "mode": doc["mode"],
            "sources": tuple(_str_list(doc["sources"], where, "sources")), "header": doc["header"],
            "results": results, "flags": flags}

