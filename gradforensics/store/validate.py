"""Check every stored array against the schema, once, at open.

After :mod:`gradforensics.store.inventory` has listed what is on disk without
trusting it, :func:`check_arrays` checks what the schema says of each array:
its name, its length against the committed record count, its dtype and
encoding, and the attributes the analyses read (``heads``, ``k``, ``edges``, ...).
Each problem is one :class:`~gradforensics.errors.CorruptStoreError` line naming
the array and what was expected; everything after trusts the arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gradforensics.errors import CorruptChunkError, CorruptStoreError, MissingArrayError, SpecError
from gradforensics.store.inventory import StoredArray
from gradforensics.store.names import name_problem
from gradforensics.store.probe_schema import PROBE_GROUPS, check_probe
from gradforensics.store.schema import (
    ACT_FIELDS,
    ATTN_FIELDS,
    BATCH_FIELDS,
    LOGIT_FIELDS,
    MODEL_AUX_LOSS,
    ROUTER_FIELDS,
    StoreMeta,
)

__all__ = ["BULK_GROUPS", "REQUIRED_BATCHES", "check_arrays", "check_ranks", "chunks_checked", "rows_of"]


REQUIRED_BATCHES = ("step", "loss", "mixture", "n_samples")
#: Arrays holding bulk gradient data: their chunks are checked only when the pass reads them.
BULK_GROUPS = ("grads", "sketch", "weights")
_ENCODING_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16-as-uint16": "uint16"}
_SKETCH_METHODS = ("countsketch", "gaussian")
_GROUPS = ("batches", "grads", "sketch", "weights", "acts", "analysis", "attn", "logits", "optim_live", "router")


def rows_of(name: str, meta: StoreMeta) -> int | None:
    """The committed length of array *name*, or None when it is not per record."""
    if name.startswith("weights/"):
        return meta.n_weights
    if name.startswith(("analysis/",)) or "/" not in name or name.split("/", 1)[0] not in _GROUPS:
        return None
    return meta.n_records


def check_arrays(path: str, meta: StoreMeta, arrays: dict[str, StoredArray], check_chunks: bool) -> None:
    """Every schema check of the store at *path*; raises on the first problem."""
    if meta.n_records == 0 and meta.n_weights == 0 and not any(n.startswith("batches/") for n in arrays):
        raise MissingArrayError(f"{path}: holds no record (its writer stopped before its first one); write it "
                                "again, replacing it (--overwrite, overwrite=True).")
    for f in REQUIRED_BATCHES:
        if f"batches/{f}" not in arrays:
            raise MissingArrayError(f"{path}: required array batches/{f} is missing; the store is incomplete.")
    for name, arr in arrays.items():
        _check_name(path, name)
        want = rows_of(name, meta)
        if want is not None and arr.shape[0] < want:
            raise CorruptChunkError(f"{path}: {name} holds {arr.shape[0]} rows; the store commits {want}.")
        _check_kind(path, name, arr, meta)
        if name.split("/", 1)[0] in PROBE_GROUPS:
            check_probe(path, name, arr, arrays)
        if chunks_checked(name, check_chunks):
            _check_chunks(path, name, arr, arr.shape[0] if want is None else want)


def chunks_checked(name: str, check_chunks: bool) -> bool:
    """Whether the chunks of array *name* are checked (and so listed) at open: all with *check_chunks*,
    else all but the bulk arrays' (gradients, sketches, weights: ``report`` reads none of them)."""
    return check_chunks or name.split("/", 1)[0] not in BULK_GROUPS or name == "weights/_record"


def _check_name(path: str, name: str) -> None:
    problem = name_problem(name, allow_slash=True)
    if problem:
        raise CorruptStoreError(f"{path}: array name {name!r} {problem}; refused.")


def _check_chunks(path: str, name: str, arr: StoredArray, n_rows: int) -> None:
    if not n_rows:
        return
    bad = arr.bad_chunk_file(n_rows)
    if bad is not None:
        idx, size = bad
        raise CorruptChunkError(f"{path}: {name}: chunk {'.'.join(map(str, idx))} has {size} bytes, not "
                                f"{arr.chunk_file_expected()} ({_records(arr, idx[0], n_rows)} affected).")
    n_missing, first = arr.missing_chunks(n_rows)
    if n_missing:
        where = f"chunk {'.'.join(map(str, first))} is missing on disk ({_records(arr, first[0], n_rows)} affected; " \
            if first is not None else "chunks are missing on disk ("
        raise CorruptChunkError(f"{path}: {name}: {where}{n_missing} chunk(s) missing of "
                                f"{math.prod(arr.grid(n_rows))}).")


def _records(arr: StoredArray, chunk_row: int, n_rows: int) -> str:
    r0 = chunk_row * arr.chunks[0]
    return f"records {r0}-{min(r0 + arr.chunks[0], n_rows) - 1}"


# ------------------------------------------------------------- per kind
def _check_kind(path: str, name: str, arr: StoredArray, meta: StoreMeta) -> None:
    group, _, key = name.partition("/")
    if group == "batches" and key in BATCH_FIELDS:
        _batches(path, name, arr, meta)
    elif group in ("grads", "sketch") or (group == "weights" and key != "_record"):
        _gradient(path, name, arr, sketch=group == "sketch", per_record=group != "weights")
    elif group == "acts":
        _acts(path, name, arr)
    elif group == "attn":
        _attn(path, name, arr)
    elif group == "logits":
        _logits(path, name, arr)
    elif group == "optim_live":
        _optim_live(path, name, arr)
    elif group == "router":
        _router(path, name, arr)
    elif name == "weights/_record" and (arr.dtype != "int64" or len(arr.shape) != 1):
        raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}", "int64 (M,)")


def _bad(path: str, name: str, got: str, want: str) -> CorruptStoreError:
    return CorruptStoreError(f"{path}: {name} has {got}; expected {want}. The store's metadata is damaged.")


def _batches(path: str, name: str, arr: StoredArray, meta: StoreMeta) -> None:
    key = name.split("/", 1)[1]
    want_dtype = BATCH_FIELDS[key]
    want_shape = (len(meta.sources),) if key == "mixture" else ()
    if arr.dtype != want_dtype or arr.shape[1:] != want_shape:
        raise _bad(path, name, f"dtype {arr.dtype} and rows of shape {arr.shape[1:]}",
                   f"{want_dtype} rows of shape {want_shape}" + (f" (one column per source {list(meta.sources)})"
                                                                   if key == "mixture" else ""))


def _gradient(path: str, name: str, arr: StoredArray, sketch: bool, per_record: bool) -> None:
    a = arr.attrs
    enc = a.get("encoding", "float32")
    if not isinstance(enc, str) or enc not in _ENCODING_DTYPE or _ENCODING_DTYPE[enc] != arr.dtype:
        raise _bad(path, name, f"encoding {enc!r} with dtype {arr.dtype}",
                   "one of " + ", ".join(f"{e} as {d}" for e, d in _ENCODING_DTYPE.items()))
    row = arr.shape[1:]
    heads = a.get("heads")
    stray = sorted(k for k in ("split_axis", "fused", "heads_per_part", "head_labels") if k in a)
    if heads is None and stray:
        raise _bad(path, name, f"head attributes {stray} without 'heads'", "'heads' with them, or neither")
    if heads is not None:     # the writer sets it only on a head-split array
        if not _is_int(heads, 1) or len(row) < 2 or row[0] != heads:
            raise _bad(path, name, f"heads={heads!r} with rows of shape {row}", "heads = the length of the head axis")
        _head_attrs(path, name, a, heads)
    experts = a.get("experts")
    if experts is not None and (heads is not None or not _is_int(experts, 1) or len(row) < 2 or row[0] != experts):
        raise _bad(path, name, f"experts={experts!r} with rows of shape {row}" + (" and heads" if heads else ""),
                   "experts = the length of the expert axis (the first of a row), without heads")
    if sketch:
        k, seed, method = a.get("k"), a.get("seed", 0), a.get("method", "countsketch")
        if (not _is_int(k, 1) or not row or row[-1] != k or not _is_int(seed, None)
                or not isinstance(method, str) or method not in _SKETCH_METHODS):
            raise _bad(path, name, f"k={k!r}, seed={seed!r}, method={method!r} for rows {row}",
                       f"integer k equal to the last axis, an integer seed, a method in {_SKETCH_METHODS}")
    elif per_record and "shape" in a:
        orig = a["shape"]
        whole = heads is None        # a row of a tensor that is not split is the tensor itself
        if (not isinstance(orig, list) or not all(_is_int(s, 0) for s in orig)
                or (tuple(orig) != row if whole else math.prod(orig) != math.prod(row))):
            raise _bad(path, name, f"attribute shape={orig!r} for rows of shape {row}",
                       "the tensor's shape" + (" (the row shape: no heads attribute)" if whole else
                                               ", with as many elements as a row"))


def _parts_total(text: str) -> int | None:
    """The head count of a ``parts`` attribute (``"q8k2v2"`` -> 12); ``None`` if it does not parse."""
    from gradforensics.store.heads import parse_parts

    try:
        return sum(n for _, n in parse_parts(text))
    except SpecError:
        return None


def _head_attrs(path: str, name: str, a: dict[str, Any], heads: int) -> None:
    checks: dict[str, Callable[[Any], bool]] = {
        "split_axis": lambda v: _is_int(v, None) and -8 <= v < 8,
        "role": lambda v: isinstance(v, str) and name_problem(v) in (None, "is empty"),
        "fused": lambda v: _is_int(v, 1) and heads % v == 0,
        "heads_per_part": lambda v: _is_int(v, 1) and heads % v == 0,
        "interleaved": lambda v: isinstance(v, bool),
        "parts": lambda v: isinstance(v, str) and _parts_total(v) == heads,
        "head_labels": lambda v: isinstance(v, list) and len(v) == heads and all(isinstance(s, str) for s in v),
    }
    for key, ok in checks.items():
        if key in a and not ok(a[key]):
            raise _bad(path, name, f"attribute {key}={a[key]!r}", f"a valid {key} for {heads} heads")


def _acts(path: str, name: str, arr: StoredArray) -> None:
    parts = name.split("/")
    if len(parts) != 3 or parts[2] not in ACT_FIELDS:
        raise _bad(path, name, "an unknown name", f"acts/<module>/<stat>, stat one of {ACT_FIELDS}")
    if parts[2] in ("dead", "saturated"):
        if len(arr.shape) != 2 or arr.dtype != "uint8":
            raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}", "uint8 (0 or 1) of shape (N, units)")
        return
    if len(arr.shape) != 2 or arr.dtype not in ("float32", "float64", "int64", "int32"):
        raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}", "numbers of shape (N, units or bins)")
    if parts[2] != "hist":
        return
    a = arr.attrs
    for key in ("units", "unit_axis"):
        if key in a and not _is_int(a[key], 1 if key == "units" else 0):
            raise _bad(path, name, f"attribute {key}={a[key]!r}", "a non-negative int" if key == "unit_axis"
                       else "a positive int (the units of the module's statistics)")
    edges = a.get("edges")
    if not (isinstance(edges, list) and len(edges) == arr.shape[1] + 1 and all(_is_number(e) for e in edges)):
        raise _bad(path, name, f"edges={_short(edges)}", f"{arr.shape[1] + 1} numbers (the bin edges)")
    for key in ("scale", "low", "high", "low_fraction", "high_fraction"):
        if key in a and not _is_number(a[key]):
            raise _bad(path, name, f"attribute {key}={a[key]!r}", "a number")
    b = a.get("bounds")
    if b is not None and not (isinstance(b, list) and len(b) == 2 and all(_is_number(x) for x in b)
                              and all(map(math.isfinite, b))):
        raise _bad(path, name, f"bounds={b!r}", "null or two finite numbers")


def _attn(path: str, name: str, arr: StoredArray) -> None:
    parts = name.split("/")
    if len(parts) != 3 or parts[2] not in ATTN_FIELDS:
        raise _bad(path, name, "an unknown name", f"attn/<module>/<stat>, stat one of {ATTN_FIELDS}")
    heads = arr.attrs.get("heads")
    if len(arr.shape) != 2 or arr.dtype != "float32" or heads != arr.shape[1]:
        raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape} heads={heads!r}",
                   "float32 of shape (N, H) with attribute heads = H")


def _logits(path: str, name: str, arr: StoredArray) -> None:
    parts = name.split("/")
    if len(parts) != 3 or parts[2] not in LOGIT_FIELDS:
        raise _bad(path, name, "an unknown name", f"logits/<module>/<stat>, stat one of {LOGIT_FIELDS}")
    if len(arr.shape) != 1 or arr.dtype != "float32":
        raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}", "float32 of shape (N,)")


def _router(path: str, name: str, arr: StoredArray) -> None:
    parts = name.split("/")
    if name == MODEL_AUX_LOSS:
        parts = [*parts, name]
    elif len(parts) != 3 or parts[2] not in ROUTER_FIELDS:
        raise _bad(path, name, "an unknown name",
                   f"{MODEL_AUX_LOSS} or router/<module>/<stat>, stat one of {ROUTER_FIELDS}")
    if parts[2] == "load":
        e, k = arr.attrs.get("experts"), arr.attrs.get("top_k", 1)
        if len(arr.shape) != 2 or arr.dtype != "float32" or e != arr.shape[1] or not _is_int(k, 1) or k > e:
            raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape} experts={e!r} top_k={k!r}",
                       "float32 of shape (N, E) with attribute experts = E and top_k in 1..E")
    elif len(arr.shape) != 1 or arr.dtype != "float32":
        raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}", "float32 of shape (N,)")


def _optim_live(path: str, name: str, arr: StoredArray) -> None:
    a = arr.attrs
    if name == "optim_live/summary":
        tensors, fields = a.get("tensors"), a.get("fields")
        if (arr.dtype != "float64" or len(arr.shape) != 3 or not isinstance(tensors, list)
                or not isinstance(fields, list) or arr.shape[1:] != (len(tensors), len(fields))):
            raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape} with {_short(tensors)} x {_short(fields)}",
                       "float64 (N, T, F) with attributes tensors (T names) and fields (F names)")
        return
    stat = name.rpartition("/")[2]
    if stat == "row_ratio" and arr.dtype == "float32" and len(arr.shape) == 3 and arr.shape[2] == 4:
        return
    if stat == "stale" and arr.dtype == "uint8" and len(arr.shape) == 2:
        return
    raise _bad(path, name, f"dtype {arr.dtype} shape {arr.shape}",
               "optim_live/summary, optim_live/<tensor>/row_ratio float32 (N, R, 4) or "
               "optim_live/<tensor>/stale uint8 (N, R)")


def check_ranks(path: str, ranks: Any, world: int | None) -> None:
    """``batches/rank`` holds ranks ``>= 0``, and below *world* (the root ``ranks.world_size``) when given.

    Raises one :class:`CorruptStoreError` line naming the first bad record.
    """
    import numpy as np

    r = np.asarray(ranks)
    if r.size == 0:
        return
    hi = world if isinstance(world, int) else None
    bad = np.flatnonzero((r < 0) | (r >= hi if hi is not None else False))
    if bad.size:
        i = int(bad[0])
        want = f"a rank in 0..{hi - 1} (the store's ranks field says world_size {hi})" if hi is not None \
            else "a rank >= 0"
        raise CorruptStoreError(f"{path}: batches/rank is {int(r[i])} at record {i} ({bad.size} record(s) "
                                f"out of range); expected {want}. The store's metadata is damaged.")


def _is_int(v: Any, minimum: int | None) -> bool:
    return type(v) is int and (minimum is None or v >= minimum)


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) < 60 else r[:57] + "..."
