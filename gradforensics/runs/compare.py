"""``gf.compare(before, after, out_dir)``: did the fix work?  Two stores of one model, finding by finding.

For the team that applied a fix (re-weighted a source, lowered the LR) and
captured again (design, "Comparing runs"): each store's stored findings are
read, or - for a store ``analyze`` has not run on - computed on the fly by the
engine and saved in it as ``analyze`` does; then every finding gets a status
(:mod:`gradforensics.reporting.comparison`) and the outputs are written
(:mod:`gradforensics.reporting.compare_render`).

Two stores of different models are refused before any gradient is read: the
tensor names and shapes must match (:func:`check_same_model`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CompareWarning, ModelMismatchError

if TYPE_CHECKING:
    from dask.distributed import Client

    from gradforensics.analysis.contract.model import Findings
    from gradforensics.reporting.comparison import Comparison
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["check_same_model", "compare", "findings_of", "tensor_shapes"]


def tensor_shapes(store: Store) -> dict[str, tuple[int, ...] | None]:
    """Each gradient tensor of *store* and its shape (None where only a sketch without its shape is kept)."""
    out: dict[str, tuple[int, ...] | None] = {}
    for t in store.tensors:
        info = store.grads.get(t) or store.sketches[t]
        shape = info.attrs.get("shape")
        if isinstance(shape, list) and all(isinstance(s, int) for s in shape):
            out[t] = tuple(shape)
        else:
            out[t] = info.shape[1:] if t in store.grads and "heads" not in info.attrs else None
    return out


def check_same_model(before: Store, after: Store) -> None:
    """Refuse two stores whose tensors differ, naming the first tensor (in sorted order) that does.

    Raises
    ------
    ModelMismatchError
        A tensor is in one store only, or has another shape in the other.
    """
    a, b = tensor_shapes(before), tensor_shapes(after)
    for t in sorted(set(a) | set(b)):
        if t not in b:
            what = f"is in {before.path} but not in {after.path}"
        elif t not in a:
            what = f"is in {after.path} but not in {before.path}"
        elif a[t] is not None and b[t] is not None and a[t] != b[t]:
            what = f"has shape {a[t]} in {before.path} but {b[t]} in {after.path}"
        else:
            continue
        raise ModelMismatchError(f"{before.path} and {after.path} hold different models: tensor {t!r} {what}; "
                                 "compare needs two captures of one model (the same tensor names and shapes).")


def findings_of(store: Store, client: Client | None = None, progress: bool = True) -> Findings:
    """The findings stored in *store*, or - if ``analyze`` has not run on it - a pass now (results saved)."""
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.analysis.engine.run import analyze
    from gradforensics.store.results import has_result

    if has_result(store, "findings"):
        return read_findings(store)
    return analyze(store.location, client=client, progress=progress)


def _version(findings: Findings) -> str | None:
    versions = findings.header.get("versions")
    v = versions.get("gradforensics") if isinstance(versions, dict) else None
    return v if isinstance(v, str) else None


def differences(before: Findings, after: Findings, labels: tuple[str, str]) -> list[str]:
    """What makes two runs' findings not like for like, one sentence each (empty when they are)."""
    notes = []
    va, vb = _version(before), _version(after)
    if va and vb and va != vb:
        notes.append(f"the findings of {labels[0]} were made by gradforensics {va}, those of {labels[1]} by {vb}: "
                     "a severity may differ by version, not by the fix; re-analyse both with one version.")
    sa, sb = set(before.sources), set(after.sources)
    if sa != sb:
        notes.append(f"the runs' data sources differ ({', '.join(sorted(sa)) or 'none'} before, "
                     f"{', '.join(sorted(sb)) or 'none'} after): a finding naming a source of only one run shows "
                     "as resolved on one side and new on the other.")
    return notes


def compare(before: str | os.PathLike[str] | Location, after: str | os.PathLike[str] | Location, out_dir: str | os.PathLike[str], *,
            client: Client | None = None, progress: bool = True,
            storage_options: Mapping[str, Any] | None = None) -> Comparison:
    """Compare two runs of one model and write the comparison into *out_dir*.

    Parameters
    ----------
    before, after
        Stores (``*.zarr`` / ``*.h5``, or Zarr stores at fsspec URLs) captured before and after a fix.  A store
        that holds no analysis results is analysed first, and the results are
        saved in it as ``gf.analyze`` does.
    out_dir
        Directory for ``report.html``, ``report.md``, ``compare.json``,
        ``tables/compare.csv`` and ``figures/compare-NN-<kind>.png``.
    client
        A ``dask.distributed.Client`` for the on-the-fly passes (default: threads).
    progress
        Show the progress bar of an on-the-fly pass.
    storage_options
        For stores at fsspec URLs (``s3://bucket/dump.zarr``): options of their file
        system (default: the environment); on-the-fly results are written back there.

    Returns
    -------
    Comparison
        The rows (kind, tensor, head, sources, severities, status) and the
        written paths (``.paths``: ``"html"``, ``"markdown"``, ``"json"``,
        ``"csv"``, ``"figures/<stem>"``).

    Raises
    ------
    ModelMismatchError
        The stores hold different models (checked before anything is read or written).

    Warns
    -----
    CompareWarning
        The findings come from different gradforensics versions, or the runs have
        different data sources (:func:`differences`).
    NotAStoreError, CorruptStoreError, EmptyStoreError
        As for ``gf.analyze``.

    Notes
    -----
    The status rule (0.5 = a finding; worse = +0.2) is in
    :mod:`gradforensics.reporting.comparison`.
    """
    from gradforensics.reporting.compare_render import write
    from gradforensics.reporting.comparison import compare_findings
    from gradforensics.store.reader import Store

    stores = (Store(before, check_chunks=False, storage_options=storage_options),
              Store(after, check_chunks=False, storage_options=storage_options))
    check_same_model(*stores)
    found = [findings_of(s, client, progress) for s in stores]
    labels = (stores[0].path, stores[1].path)
    for note in differences(found[0], found[1], labels):
        warnings.warn(note, CompareWarning, stacklevel=2)
    comparison = compare_findings(found[0], found[1], labels)
    write(comparison, out_dir)
    return comparison
