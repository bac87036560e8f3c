"""Analysis results in a store: :class:`Findings` and Gram matrices to documents and back.

``gradforensics analyze`` saves its :class:`~gradforensics.analysis.contract.model.Findings`
and Gram matrices in the store's ``analysis/`` group (raw layout:
:mod:`gradforensics.store.results`) so ``gradforensics report`` can re-render
them without reading a gradient:

* ``findings`` - store, records, mode, sources, header, flags and the analyses run;
* ``tables/<name>`` - each analysis's table, ``{"columns": [...], "data": [[...], ...]}``;
* ``series/<name>`` - each analysis's series, packed into one ``.npz`` image
  (:func:`~gradforensics.analysis.engine.seriesimage.pack_series`);
* the Gram matrices of every tensor and head, with the ``gram_index`` document.

A store may come from someone else, so what is read back is checked once, here,
at the boundary (design, "Store safety"): analysis names must be lower-case
identifiers (they become ``tables/<name>.csv``), every flag field has its type and
range, tables are rectangular with string column names and scalar cells, and the
series blobs are plain, uncompressed ``.npz`` images whose arrays hold the bytes
their headers declare (:func:`~gradforensics.analysis.engine.seriesimage.parse_series`).  Anything else is a :class:`~gradforensics.errors.CorruptStoreError`
naming the store, the document and what is wrong - never a ``KeyError`` or
``TypeError`` traceback.  Names are not otherwise restricted here: they are data,
and every output escapes them (:mod:`gradforensics._text`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import AnalysisResult, Findings, Flag, NotJudged
from gradforensics.analysis.contract.registry import flag_kinds, records_map_kinds
from gradforensics.analysis.engine.seriesimage import pack_series, parse_series
from gradforensics.errors import CorruptStoreError, UnsafeNameError
from gradforensics.store.names import check_analysis_name
from gradforensics.store.results import GramArrays, read_document, read_grams, read_result, write_results

if TYPE_CHECKING:
    import pandas as pd

    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["FLAG_FIELDS", "findings_documents", "grams_to_save", "load_grams", "parse_flag", "parse_table", "read_findings",
           "save_grams", "save_results"]

#: Fields of a flag (the flags.json contract); every one is required.
FLAG_FIELDS = ("kind", "tensor", "head", "sources", "severity", "records", "evidence", "summary")
#: Deepest nesting of lists and objects accepted in a header or an evidence object.
MAX_DEPTH = 16
MODES = ("training", "replay")


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
def parse_flag(d: Any, where: str = "flag", kinds: Sequence[str] | None = None) -> Flag:
    """A :class:`~gradforensics.analysis.contract.model.Flag` from its ``to_dict`` form, every field checked.

    The inverse of :meth:`Flag.to_dict <gradforensics.analysis.contract.model.Flag.to_dict>`.

    *kinds*: :func:`~gradforensics.analysis.contract.registry.flag_kinds`, when the caller has it
    already (one lookup for thousands of flags).

    Raises
    ------
    CorruptStoreError
        A field is missing, unknown, of the wrong type or out of range; the
        message starts with *where*.
    """
    if not isinstance(d, Mapping):
        raise _bad(where, f"a flag must be an object; got {type(d).__name__}")
    missing = [k for k in FLAG_FIELDS if k not in d]
    unknown = sorted(str(k) for k in d if k not in FLAG_FIELDS)
    if missing or unknown:
        raise _bad(where, f"missing field(s) {missing}, unknown field(s) {_show(unknown)}; a flag has {list(FLAG_FIELDS)}")
    kinds = flag_kinds() if kinds is None else kinds
    if d["kind"] not in kinds:
        raise _bad(where, f"kind must be one of {', '.join(kinds)}; got {_show(d['kind'])}")
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
    if any(isinstance(v, (dict, list)) for v in d["evidence"].values()) and _too_deep(dict(d["evidence"])):
        raise _bad(where, f"evidence is nested deeper than {MAX_DEPTH} levels")
    if not isinstance(d["summary"], str):
        raise _bad(where, f"summary must be a string; got {_show(d['summary'])}")
    return Flag(kind=d["kind"], tensor=d["tensor"], head=head, sources=tuple(sources), severity=float(sev),
                records=(rec[0], rec[1]), evidence=dict(d["evidence"]), summary=d["summary"])


# ------------------------------------------------------------------ documents
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
    plain = _plain_rows(data, len(columns))
    for i, row in enumerate(data):
        if not plain:                   # the checks row by row: the first row that fails is named
            if not isinstance(row, list) or len(row) != len(columns):
                raise _bad(where, f"row {i} must be a list of {len(columns)} cells; got {_show(row)}")
            if not all(c is None or isinstance(c, (str, int, float)) for c in row):
                raise _bad(where, f"row {i} holds a cell that is not a string, number or null: {_show(row)}")
        elif head is None:
            break
        h = None if head is None else row[head]
        if h is not None and not (_is_number(h) and math.isfinite(h) and h >= 0 and h == int(h)):
            raise _bad(where, f"row {i}: head must be null or a non-negative integer; got {_show(h)}")
    table = pd.DataFrame(data, columns=columns)
    for c in table.columns[table.isna().all().to_numpy()]:
        if table[c].dtype.kind == "O":
            table[c] = table[c].astype(float)       # a column of NaN only (stored as nulls) reads back as NaN, not None
    return table


def _plain_rows(data: list[Any], n_columns: int) -> bool:
    """Whether every row of *data* is a list of *n_columns* cells, each None, a string or a number.

    The row-by-row checks of :func:`parse_table`, all rows at once (the cells' types collected
    in one pass): a table of 6,000 rows holds 400,000 cells.  False sends the table through
    the checks row by row, which name the first row that fails.
    """
    if not all(map(isinstance, data, itertools.repeat(list))) or any(len(r) != n_columns for r in data):
        return False
    kinds = set(map(type, itertools.chain.from_iterable(data)))
    return all(t is type(None) or issubclass(t, (str, int, float)) for t in kinds)


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


def read_findings(store: Store) -> Findings:
    """The :class:`~gradforensics.analysis.contract.model.Findings` that ``analyze`` saved in *store*, checked.

    Raises
    ------
    CorruptStoreError
        A stored document is not JSON or not what ``analyze`` writes (named).
    MissingArrayError
        A table or series the findings name is absent.
    """
    where = f"{store.path}: analysis/findings"
    doc = _findings_doc(read_document(store, "findings"), where)
    n = doc["n_records"]
    flags = []
    kinds = flag_kinds()
    for i, d in enumerate(doc["flags"]):
        flag = parse_flag(d, f"{where}: flags[{i}]", kinds)
        if flag.records[1] >= max(n, 1):
            raise _bad(f"{where}: flags[{i}]", f"records {list(flag.records)} are not inside the store's {n} records")
        flags.append(flag)
    not_judged = _not_judged(doc.get("not_judged", []), doc["analyses"], f"{where}: not_judged")
    results = {}
    for name in doc["analyses"]:
        table = parse_table(read_document(store, f"tables/{name}"), f"{store.path}: analysis/tables/{name}")
        series = parse_series(read_result(store, f"series/{name}"), f"{store.path}: analysis/series/{name}")
        results[name] = AnalysisResult(table=table, series=series, not_judged=not_judged.get(name, []))
    return Findings(store=doc["store"], n_records=n, mode=doc["mode"],
                    sources=tuple(_str_list(doc["sources"], where, "sources")), header=doc["header"],
                    results=results, flags=flags, not_judged=[x for name in doc["analyses"]
                                                              for x in not_judged.get(name, [])])


def _not_judged(entries: Any, analyses: list[str], where: str) -> dict[str, list[NotJudged]]:
    """The saved ``not_judged`` entries (``{analysis, kind, reason, needed}``) by analysis; findings saved
    before they existed have none."""
    if not isinstance(entries, list):
        raise _bad(where, f"must be a list; got {type(entries).__name__}")
    out: dict[str, list[NotJudged]] = {}
    for i, e in enumerate(entries):
        keys = ("analysis", "kind", "reason", "needed")
        if not (isinstance(e, dict) and set(e) == set(keys) and all(isinstance(e[k], str) and e[k] for k in keys)
                and e["analysis"] in analyses):
            raise _bad(f"{where}[{i}]", f"must be an object of non-empty strings {list(keys)}, its analysis one of "
                                        f"the saved analyses; got {_show(e)}")
        out.setdefault(e["analysis"], []).append(NotJudged(e["kind"], e["reason"], e["needed"]))
    return out


def findings_documents(findings: Findings) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, documents)`` that hold *findings* under ``analysis/`` (what :func:`read_findings` reads)."""
    arrays: dict[str, np.ndarray] = {}
    docs: dict[str, Any] = {
        "findings": {"store": findings.store, "n_records": findings.n_records, "mode": findings.mode,
                     "sources": list(findings.sources), "header": findings.header,
                     "flags": [f.to_dict() for f in findings.flags], "analyses": sorted(findings.results),
                     "not_judged": [{"analysis": name, **n.to_dict()} for name in sorted(findings.results)
                                    for n in findings.results[name].not_judged]},
    }
    for name, res in findings.results.items():
        docs[f"tables/{name}"] = json.loads(res.table.to_json(orient="split", index=False))
        arrays[f"series/{name}"] = pack_series(res.series)
    return arrays, docs


# ------------------------------------------------------------------ grams
class _Column(Sequence[np.ndarray]):
    """``grams[key].<field>`` for *keys*, taken one at a time (a spilled pass streams from disk, holding few).

    With *release*, taking a batch (a slice) first releases the keys of the batch taken
    before it: the writer takes the next batch only once the last one is written.
    """

    def __init__(self, grams: Mapping[tuple[str, int | None], GramResult], keys: list[tuple[str, int | None]],
                 field: str, release: Callable[[list[tuple[str, int | None]]], None] | None = None) -> None:
        self._grams, self._keys, self._field = grams, keys, field
        self._release = release
        self._taken: list[tuple[str, int | None]] = []

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            if self._release is not None:
                done, self._taken = self._taken, [self._keys[j] for j in range(*i.indices(len(self)))]
                self._release(done)
            return [self[j] for j in range(*i.indices(len(self)))]
        return getattr(self._grams[self._keys[i]], self._field)


def gram_arrays(grams: Mapping[tuple[str, int | None], GramResult], n_records: int,
                release: Callable[[list[tuple[str, int | None]]], None] | None = None) -> GramArrays:
    """The Gram matrices of a pass, in the order and with the index entries they are saved with.

    ``k`` reads ``grams`` when it is taken, so saving a spilled pass streams its
    matrices (:mod:`gradforensics.analysis.engine.spill`); the non-finite counts are
    taken with the index.  With *release* (a spilled pass's
    :meth:`~gradforensics.analysis.engine.spill.SpilledGrams.release`), each batch of
    ``k`` the writer has written is released when it takes the next one.
    """
    keys = sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    index, nonfinite = [], []
    for i, key in enumerate(keys):
        g = grams[key]
        index.append({"i": i, "tensor": g.tensor, "head": g.head, "n_features": g.n_features,
                      "from_sketch": g.from_sketch})
        nonfinite.append(g.nonfinite)
    return GramArrays(n_records=int(n_records), index=index, k=_Column(grams, keys, "gram", release),
                      nonfinite=nonfinite)


class _Only(Mapping[tuple[str, int | None], GramResult]):
    """*grams* restricted to *keys* (in *grams*' order), each still read when it is taken."""

    def __init__(self, grams: Mapping[tuple[str, int | None], GramResult], keys: Iterable[tuple[str, int | None]]) -> None:
        wanted = set(keys)
        self._grams, self._keys = grams, [k for k in grams if k in wanted]
        self._set = set(self._keys)

    def __getitem__(self, key: tuple[str, int | None]) -> GramResult:
        if key not in self._set:
            raise KeyError(key)
        return self._grams[key]

    def __iter__(self) -> Iterator[tuple[str, int | None]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def grams_to_save(grams: Mapping[tuple[str, int | None], GramResult], findings: Findings,
                  which: str = "flagged") -> Mapping[tuple[str, int | None], GramResult]:
    """The Gram matrices a save keeps (engine option ``save_grams``): *which* ``"all"``, ``"none"``, or
    ``"flagged"``: the units of *findings*' flags of the kinds the report's records map is drawn for
    (its only reader: :func:`gradforensics.reporting.recordsmap.unit_gram`), in *grams*' order."""
    if which == "all":
        return grams
    if which == "none":
        return {}
    kinds = set(records_map_kinds())
    return _Only(grams, {(f.tensor, f.head) for f in findings.flags if f.kind in kinds})


def save_results(path: str | os.PathLike[str] | Location, findings: Findings | None = None,
                 grams: Mapping[tuple[str, int | None], GramResult] | None = None, *, n_records: int = 0,
                 empty_grams: bool = False,
                 release: Callable[[list[tuple[str, int | None]]], None] | None = None) -> None:
    """Save *findings* and/or the Gram matrices *grams* (over *n_records* records) in the store at *path*.

    One write under the store's writer lock (:func:`gradforensics.store.results.write_results`);
    a :class:`~gradforensics.store.reader.Store` opened before does not see them.  With
    *empty_grams* (the long-history regime: no per-record K exists) an empty Gram index
    replaces any saved before, so :func:`load_grams` returns ``{}``.  *release*: see
    :func:`gram_arrays` (a spilled pass frees each file once its matrix is in the store).
    """
    arrays, docs = findings_documents(findings) if findings is not None else ({}, {})
    if empty_grams:
        saved: GramArrays | None = GramArrays(n_records=0)
    else:
        saved = gram_arrays(grams, n_records, release) if grams is not None else None
    write_results(path, arrays=arrays, documents=docs, grams=saved)


def save_grams(store: Store, grams: Mapping[tuple[str, int | None], GramResult]) -> None:
    """Save the Gram matrices *grams* of *store*'s records in it (what :func:`load_grams` reads)."""
    write_results(store.location, grams=gram_arrays(grams, store.n_records))


def _gram_entry(e: Any, m: int, where: str) -> tuple[int, str, int | None, int, bool]:
    if not (isinstance(e, dict) and {"i", "tensor", "head", "n_features", "from_sketch"} <= set(e)):
        raise _bad(where, f"an entry must be an object with i, tensor, head, n_features, from_sketch; got {_show(e)}")
    i, tensor, head, nf, sk = e["i"], e["tensor"], e["head"], e["n_features"], e["from_sketch"]
    if not (_is_int(i) and 0 <= i < m and isinstance(tensor, str) and (head is None or (_is_int(head) and head >= 0))
            and _is_int(nf) and nf >= 0 and isinstance(sk, bool)):
        raise _bad(where, f"bad entry {_show(e)} for {m} saved matrices")
    return i, tensor, head, nf, sk


def load_grams(store: Store) -> dict[tuple[str, int | None], GramResult]:
    """The Gram matrices a previous ``analyze`` saved in *store* (no gradient is read).

    ``{}`` after a pass in the long-history regime (above ``N₀`` records no
    per-record K is formed; the findings header's ``regime`` says so).

    Raises
    ------
    MissingArrayError
        None were saved.
    CorruptStoreError
        The index does not describe the saved matrices.
    """
    index, k, nf = read_grams(store)
    where = f"{store.path}: analysis/gram_index"
    if not index:
        return {}
    if not isinstance(index, list) or k is None or nf is None:
        raise _bad(where, f"must be a list of entries; got {type(index).__name__}")
    m = int(k.shape[0])
    if k.ndim != 3 or k.shape[1] != k.shape[2] or nf.shape != k.shape[:2]:
        raise _bad(where, f"saved matrices of shapes {k.shape} and {nf.shape} are not M Gram matrices and counts")
    out: dict[tuple[str, int | None], GramResult] = {}
    for e in index:
        i, tensor, head, n_features, from_sketch = _gram_entry(e, m, where)
        out[(tensor, head)] = GramResult(tensor, head, k[i], nf[i], n_features, from_sketch)
    return out
