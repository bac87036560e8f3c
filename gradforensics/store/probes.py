"""The ``curvature/`` and ``optim/`` groups: what ``capture --curvature`` measured at the checkpoint.

Small arrays with their meaning in attributes, written once after the records
(:func:`write_probes`, under the store's writer lock) and checked at open
(:func:`~gradforensics.store.probe_schema.check_probe`, called by :mod:`gradforensics.store.validate`):

==========================  ==================  =============================================================
array                       dtype, shape        attrs
==========================  ==================  =============================================================
``curvature/eigenvalues``   float64 ``(R, k)``  ``rows``: ``[{"block", "tensors", "source", "operator"}]``
                                                (``source`` "" = the mixture; ``operator`` ``hessian`` or
                                                ``preconditioned``), ``hyper`` (optimizer, lr, betas, ...),
                                                ``max_iter``, ``tol``, ``blocks`` (tensor / layer)
``curvature/residuals``     float64 ``(R, k)``  ``‖Hx - θx‖`` of each Ritz pair
``curvature/iterations``    int64 ``(R,)``      Lanczos iterations (Hessian-vector products) run
``curvature/converged``     uint8 ``(R,)``      1 when every residual <= tol · |θ_1|
``optim/summary``           float64 ``(T, F)``  ``tensors`` (T names), ``fields`` (F names), ``hyper``,
                                                ``mapping`` (how state indices became names), ``source``
``optim/ratio_hist``        int64 ``(T, B)``    ``edges``: B + 1 log10(g²/v̂) bin edges
==========================  ==================  =============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.store.probe_schema import CURVATURE_ARRAYS, OPTIM_ARRAYS

if TYPE_CHECKING:
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["NO_STABILITY_VERDICT", "CurvatureData", "OptimData", "no_stability_verdict", "read_curvature", "read_optim",
           "write_probes"]

#: What a curvature capture under Adam without its second moments (``exp_avg_sq``) can say: the
#: stability limit of Adam is on the preconditioned Hessian, which needs them; the raw one has none.
NO_STABILITY_VERDICT = "only the raw Hessian was measured; no stability verdict without the optimizer state"


def no_stability_verdict(optimizer: str | None, operators: Any) -> bool:
    """Whether curvature rows of *operators* (``hessian``, ``preconditioned``) under *optimizer* can give no
    stability verdict: Adam without a ``preconditioned`` row (:data:`NO_STABILITY_VERDICT`)."""
    return optimizer == "adam" and "preconditioned" not in set(operators)



@dataclass(frozen=True)
class CurvatureData:
    """``curvature/``: one row per (block, source, operator)."""

    rows: list[dict[str, Any]]
    eigenvalues: np.ndarray
    residuals: np.ndarray
    iterations: np.ndarray
    converged: np.ndarray
    attrs: dict[str, Any]


@dataclass(frozen=True)
class OptimData:
    """``optim/``: one summary row per tensor, and the g²/v̂ histograms."""

    tensors: list[str]
    fields: list[str]
    summary: np.ndarray
    ratio_hist: np.ndarray
    attrs: dict[str, Any]

    def column(self, name: str) -> np.ndarray:
        return self.summary[:, self.fields.index(name)]


def write_probes(where: str | os.PathLike[str] | Location, curvature: CurvatureData | None,
                 optim: OptimData | None) -> None:
    """Write the groups into the (committed) store at *where*, under its writer lock."""
    from gradforensics.store.backends import locate, open_backend
    from gradforensics.store.lock import StoreLock

    loc = locate(where)
    with StoreLock(loc, writing="curvature and optimizer state"):
        b = open_backend(loc, "a")
        try:
            if curvature is not None:
                attrs = {**curvature.attrs, "rows": curvature.rows}
                _put(b, "curvature/eigenvalues", curvature.eigenvalues, attrs)
                _put(b, "curvature/residuals", curvature.residuals, {})
                _put(b, "curvature/iterations", curvature.iterations, {})
                _put(b, "curvature/converged", curvature.converged, {})
            if optim is not None:
                _put(b, "optim/summary", optim.summary, {**optim.attrs, "tensors": optim.tensors,
                                                         "fields": optim.fields})
                _put(b, "optim/ratio_hist", optim.ratio_hist, {"edges": optim.attrs.get("edges", [])})
        finally:
            b.close()


def _put(b: Any, name: str, arr: np.ndarray, attrs: Mapping[str, Any]) -> None:
    arr = np.ascontiguousarray(arr, dtype=CURVATURE_ARRAYS.get(name) or OPTIM_ARRAYS[name])
    b.create(name, arr.shape, arr.dtype.str, tuple(max(int(s), 1) for s in arr.shape), dict(attrs), "none")
    if arr.size:
        b.write_rows(name, 0, arr)


def read_curvature(store: Store) -> CurvatureData | None:
    """The store's ``curvature/`` group (checked at open), or None."""
    if not store.has("curvature/eigenvalues"):
        return None
    a = dict(store.arrays["curvature/eigenvalues"].attrs)
    return CurvatureData(list(a.pop("rows")), store.read("curvature/eigenvalues"),
                         store.read("curvature/residuals"), store.read("curvature/iterations"),
                         store.read("curvature/converged"), a)


def read_optim(store: Store) -> OptimData | None:
    """The store's ``optim/`` group (checked at open), or None."""
    if not store.has("optim/summary"):
        return None
    a = dict(store.arrays["optim/summary"].attrs)
    edges = store.arrays["optim/ratio_hist"].attrs["edges"]
    return OptimData(list(a.pop("tensors")), list(a.pop("fields")), store.read("optim/summary"),
                     store.read("optim/ratio_hist"), {**a, "edges": edges})
