"""Schema of the ``curvature/`` and ``optim/`` groups (:mod:`gradforensics.store.probes`), checked once at open.

:func:`check_probe` is called by :mod:`gradforensics.store.validate` for every array of
the two groups; each problem is one :class:`~gradforensics.errors.CorruptStoreError`
line naming the array, what it holds and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CorruptStoreError

if TYPE_CHECKING:
    from gradforensics.store.inventory import StoredArray

__all__ = ["CURVATURE_ARRAYS", "OPTIM_ARRAYS", "PROBE_GROUPS", "check_probe"]

PROBE_GROUPS = ("curvature", "optim")
CURVATURE_ARRAYS = {"curvature/eigenvalues": "float64", "curvature/residuals": "float64",
                    "curvature/iterations": "int64", "curvature/converged": "uint8"}
OPTIM_ARRAYS = {"optim/summary": "float64", "optim/ratio_hist": "int64"}
_ROW_KEYS = ("block", "tensors", "source", "operator")
_OPERATORS = ("hessian", "preconditioned")


# ------------------------------------------------------------------ validation at open
def _bad(path: str, name: str, got: str, want: str) -> CorruptStoreError:
    return CorruptStoreError(f"{path}: {name} has {got}; expected {want}. The store's {name.split('/')[0]}/ "
                             "group is damaged; capture again with --curvature.")


def check_probe(path: str, name: str, arr: StoredArray, arrays: Mapping[str, StoredArray]) -> None:
    """Schema checks of one ``curvature/`` or ``optim/`` array (*arrays*: the whole store's, for the siblings)."""
    want = CURVATURE_ARRAYS.get(name) or OPTIM_ARRAYS.get(name)
    if want is None:
        raise _bad(path, name, "an unknown name", f"one of {', '.join([*CURVATURE_ARRAYS, *OPTIM_ARRAYS])}")
    if arr.dtype != want:
        raise _bad(path, name, f"dtype {arr.dtype}", want)
    group = CURVATURE_ARRAYS if name in CURVATURE_ARRAYS else OPTIM_ARRAYS
    for sibling in group:
        if sibling not in arrays:
            raise _bad(path, name, f"no sibling {sibling}", f"all of {', '.join(group)}")
    if name == "curvature/eigenvalues":
        _check_curvature(path, name, arr, arrays)
    elif name == "optim/summary":
        _check_optim(path, name, arr, arrays)


def _check_curvature(path: str, name: str, arr: StoredArray, arrays: Mapping[str, StoredArray]) -> None:
    rows = arr.attrs.get("rows")
    if len(arr.shape) != 2 or not isinstance(rows, list) or len(rows) != arr.shape[0]:
        raise _bad(path, name, f"shape {arr.shape} with {_count(rows)} rows in attrs", "(R, k) and R rows")
    for row in rows:
        if not (isinstance(row, dict) and all(k in row for k in _ROW_KEYS) and isinstance(row["block"], str)
                and isinstance(row["source"], str) and row["operator"] in _OPERATORS
                and isinstance(row["tensors"], list)):
            raise _bad(path, name, f"a row {str(row)[:80]}", f"keys {', '.join(_ROW_KEYS)}, operator hessian or "
                       "preconditioned")
    if not isinstance(arr.attrs.get("hyper"), dict):
        raise _bad(path, name, "no hyper attr", "the optimizer's hyper-parameters")
    _same_rows(path, arr, arrays, ("curvature/residuals", "curvature/iterations", "curvature/converged"))


def _check_optim(path: str, name: str, arr: StoredArray, arrays: Mapping[str, StoredArray]) -> None:
    tensors, fields = arr.attrs.get("tensors"), arr.attrs.get("fields")
    if (len(arr.shape) != 2 or not isinstance(tensors, list) or not isinstance(fields, list)
            or arr.shape != (len(tensors), len(fields))):
        raise _bad(path, name, f"shape {arr.shape} with {_count(tensors)} tensors x {_count(fields)} fields",
                   "(tensors, fields)")
    hist = arrays["optim/ratio_hist"]
    edges = hist.attrs.get("edges")
    if len(hist.shape) != 2 or not isinstance(edges, list) or hist.shape[1] + 1 != len(edges):
        raise _bad(path, "optim/ratio_hist", f"shape {hist.shape} with {_count(edges)} edges", "(T, B), B+1 edges")
    _same_rows(path, arr, arrays, ("optim/ratio_hist",))


def _same_rows(path: str, arr: StoredArray, arrays: Mapping[str, StoredArray], names: Sequence[str]) -> None:
    for other in names:
        if arrays[other].shape[0] != arr.shape[0]:
            raise _bad(path, other, f"{arrays[other].shape[0]} rows", f"{arr.shape[0]}, as its group's")


def _count(x: Any) -> str:
    return str(len(x)) if isinstance(x, list) else "no"
