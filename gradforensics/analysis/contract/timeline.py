"""The timeline's contract: its table's columns and its ``flags.json`` document (design, "Timeline").

The ``timeline`` analysis (:mod:`gradforensics.analysis.kinds.timeline`) writes one table row per
loss spike (``signal`` = ``loss_spike``) and per series that departed from its own earlier level,
and the test's parameters as the series ``test`` (:data:`TEST_FIELDS`, in order).  The
``flags.json`` ``timeline`` object is built from them here, so the document a report writes and
the one read back from a store are the same:

``{"test": {...}, "spikes": [{"record", "step", "loss", "signals": [...]}], "departures": [...]}``

where each signal is ``{"signal", "label", "tensor", "head", "source", "record", "step",
"alarm_record", "lead_steps", "finding"}``: ``record`` / ``step`` its onset, ``lead_steps`` how many
optimizer steps it moved before the spike (``spikes`` only; null in ``departures``), ``finding`` the
index in ``flags`` of the largest finding about the same tensor (and head), or null.  Both lists are
ordered by onset, then by how far ahead the alarm came.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "NAME", "SPIKE", "TEST_FIELDS", "finding_index", "timeline_document"]

NAME = "timeline"
#: ``signal`` of a loss-spike row.
SPIKE = "loss_spike"
#: The test's parameters, in the order of the ``test`` series.
TEST_FIELDS = ("window", "burn_in", "allowance", "threshold", "limit", "z_clip", "spike_k", "spike_window")
_COUNTS = ("window", "burn_in", "spike_window")
#: The table's columns: a row per spike and per departed series.
COLUMNS = ["tensor", "head", "signal", "label", "source", "record", "step", "alarm_record", "peak", "z_max",
           "spike_record", "spike_step", "lead_steps", "value"]


def _int(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) else None


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return round(f, 6) if math.isfinite(f) else None


def finding_index(tensor: str, head: int | None, flags: Sequence[Any]) -> int | None:
    """Index in *flags* (sorted, as in flags.json) of the first flag about *tensor* and *head* (a whole-tensor
    flag covers every head; a head's flag covers the whole-tensor series), or None."""
    if not tensor:
        return None
    for i, f in enumerate(flags):
        if f.tensor == tensor and (head is None or f.head is None or f.head == head):
            return i
    return None


def _entry(row: dict[str, Any], flags: Sequence[Any], lead: bool) -> dict[str, Any]:
    head = _int(row.get("head"))
    source = row.get("source")
    source = source if isinstance(source, str) and source else None
    raw = row.get("tensor")
    tensor = raw if isinstance(raw, str) else ""
    return {"signal": str(row.get("signal")), "label": str(row.get("label")), "tensor": tensor, "head": head,
            "source": source, "record": _int(row.get("record")), "step": _int(row.get("step")),
            "alarm_record": _int(row.get("alarm_record")),
            "lead_steps": _int(row.get("lead_steps")) if lead else None,
            "finding": finding_index(tensor, head, flags)}


def _usable(row: dict[str, Any], n_records: int | None) -> bool:
    """A row the document can carry: a signal name, and its records (onset, alarm) inside the store; a table
    read back from someone else's store may hold anything, and such a row is left out, never an invalid file."""
    recs = [_int(row.get("record")), _int(row.get("alarm_record"))]
    head = _int(row.get("head")) if row.get("head") is not None else None
    return (isinstance(row.get("signal"), str) and bool(row.get("signal"))
            and all(r is not None and r >= 0 and (n_records is None or r < max(n_records, 1)) for r in recs)
            and (head is None or head >= 0))


def _rows(table: pd.DataFrame, n_records: int | None) -> list[dict[str, Any]]:
    rows = [r for r in table.to_dict("records") if _usable(r, n_records)]
    return sorted(rows, key=lambda r: (_int(r.get("record")) or 0, _int(r.get("alarm_record")) or 0,
                                       str(r.get("label"))))


def timeline_document(result: Any, flags: Sequence[Any], n_records: int | None = None) -> dict[str, Any]:
    """The ``flags.json`` ``timeline`` object from the timeline analysis's *result* (an ``AnalysisResult``) and
    the sorted *flags* (``Flag``: this module names no type of the model, which imports it); rows outside
    *n_records* or without a usable record are left out."""
    test = np.asarray(result.series.get("test", np.zeros(0)), np.float64).ravel()
    doc: dict[str, Any] = {"test": {k: (_int if k in _COUNTS else _num)(test[i]) if i < test.size else None
                                    for i, k in enumerate(TEST_FIELDS)}}
    rows = _rows(result.table, n_records) if len(result.table) else []
    departed = [r for r in rows if r.get("signal") != SPIKE]
    spikes = []
    for s in (r for r in rows if r.get("signal") == SPIKE):
        at = _int(s.get("record"))
        mine = [r for r in departed if _int(r.get("spike_record")) == at]
        spikes.append({"record": at, "step": _int(s.get("step")), "loss": _num(s.get("value")),
                       "signals": [_entry(r, flags, True) for r in mine]})
    doc["spikes"] = spikes
    doc["departures"] = [_entry(r, flags, False) for r in departed]
    return doc
