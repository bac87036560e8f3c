"""``flags.json``: the machine-readable findings, and the JSON Schema they follow.

The document is exactly ``Findings.flags_json()`` (design contract).
:func:`flags_schema` (also :data:`FLAGS_SCHEMA`) is a JSON Schema (draft 2020-12)
of it; its ``kind`` enum is every kind a registered analysis emits
(:func:`gradforensics.analysis.contract.registry.flag_kinds`), read when asked, so
an analysis added with :func:`~gradforensics.analysis.register` is valid too.
:func:`validate` checks a document against the schema with a small built-in
validator (no extra dependency; it implements the keywords the schema uses,
``oneOf`` included, and the test suite cross-checks it with the ``jsonschema``
package) plus what a
schema cannot say: flags sorted by severity, descending, and record ranges
inside the store.  ``python -m gradforensics.reporting.flagsjson`` prints the schema.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.analysis.contract.registry import flag_kinds
from gradforensics.errors import FlagsSchemaError

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings

__all__ = ["errors", "flag_schema", "flags_schema", "validate", "write"]


#: One flag; :func:`flag_schema` adds the ``kind`` enum of the registered analyses.
_FLAG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "tensor", "head", "sources", "severity", "records", "evidence", "summary"],
    "properties": {
        "tensor": {"type": "string", "minLength": 1,
                   "description": "parameter name, activation module or series (batches/loss)"},
        "head": {"type": ["integer", "null"], "minimum": 0,
                 "description": "attention head (an expert of a mixture-of-experts unit: evidence.expert); null = whole tensor"},
        "sources": {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                    "description": "data sources implicated; empty when none is"},
        "severity": {"type": "number", "minimum": 0, "maximum": 1, "description": "comparable across kinds"},
        "records": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2,
                    "description": "inclusive record range [since, last] the finding covers"},
        "evidence": {"type": "object", "description": "the numbers behind the flag (kind-specific keys)"},
        "summary": {"type": "string", "description": "one sentence a person can act on"},
    },
}

#: The analysis regime of the pass (optional: findings saved before it existed have none).
_REGIME_SCHEMA: dict[str, Any] = {
    "description": "how the pass compared records: every pair (exact, at most n0 records) or, above n0, "
                   "window means and a band of lags (long-history)",
    "oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "n0"],
         "properties": {"name": {"const": "exact"},
                        "n0": {"type": "integer", "minimum": 0, "description": "most records the exact regime takes"}}},
        {"type": "object", "additionalProperties": False, "required": ["name", "n0", "window", "windows", "band"],
         "properties": {"name": {"const": "long-history"},
                        "n0": {"type": "integer", "minimum": 0, "description": "most records the exact regime takes"},
                        "window": {"type": "integer", "minimum": 1, "description": "records per window W"},
                        "windows": {"type": "integer", "minimum": 1, "description": "number of windows"},
                        "band": {"type": "integer", "minimum": 0, "description": "lags L of the banded Gram"}}},
    ],
}

#: The baseline each finding was judged against (optional: ``analyze --baseline STORE`` only).
_BASELINE_SCHEMA: dict[str, Any] = {
    "description": "the earlier healthy window or run of the same model each finding was judged against "
                   "(analyze --baseline): a finding it shows as strongly is context, below 0.5",
    "type": "object", "additionalProperties": False, "required": ["store", "n_records", "reused", "context"],
    "properties": {
        "store": {"type": "string", "description": "the baseline store"},
        "n_records": {"type": "integer", "minimum": 0, "description": "its records"},
        "reused": {"type": "boolean", "description": "its saved analysis results were used (else a fresh pass)"},
        "context": {"type": "integer", "minimum": 0,
                    "description": "findings (>= 0.5 before) the baseline showed as strongly, now context"},
    },
}

#: What the analyses could not judge (optional: findings saved before it existed have none).
_NOT_JUDGED_SCHEMA: dict[str, Any] = {
    "type": "array",
    "description": "the kinds of flag that could not have fired on this store, why, and what would be needed: "
                   "no flag of such a kind is not an all-clear",
    "items": {
        "type": "object", "additionalProperties": False, "required": ["kind", "reason", "needed"],
        "properties": {
            "kind": {"type": "string", "minLength": 1, "description": "the kind of flag that could not fire"},
            "reason": {"type": "string", "minLength": 1,
                       "description": "what the store holds too little of (records per source, history length)"},
            "needed": {"type": "string", "minLength": 1, "description": "what would let the analysis judge"},
        },
    },
}

_INT_OR_NULL: dict[str, Any] = {"type": ["integer", "null"], "minimum": 0}
#: One signal of the timeline: where it departed from its own level, and its lead before the spike.
_SIGNAL_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["signal", "label", "tensor", "head", "source", "record", "step", "alarm_record", "lead_steps",
                 "finding"],
    "properties": {
        "signal": {"type": "string", "minLength": 1,
                   "description": "loss, grad_norm, attn_max_logit, attn_entropy, logz, dead_share, kurtosis, "
                                  "update_ratio, ratio_max, stale_share, router_max_share, loss_scale, "
                                  "logged_grad_norm"},
        "label": {"type": "string", "description": "the series in words"},
        "tensor": {"type": "string", "description": "tensor, module or '' (the loss, the run's logs)"},
        "head": {**_INT_OR_NULL, "description": "attention head; null = whole tensor"},
        "source": {"type": ["string", "null"], "description": "data source of a per-source loss"},
        "record": {"type": "integer", "minimum": 0, "description": "onset: where the departure began"},
        "step": {"type": ["integer", "null"], "description": "optimizer step of the onset"},
        "alarm_record": {"type": "integer", "minimum": 0, "description": "where the test was sure"},
        "lead_steps": {"type": ["integer", "null"], "description": "spike step minus onset step (spikes only)"},
        "finding": {**_INT_OR_NULL, "description": "index in flags of the largest finding on the same tensor/head"},
    },
}

#: What moved first (optional: present when the timeline analysis ran; design, "Timeline").
_TIMELINE_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["test", "spikes", "departures"],
    "properties": {
        "test": {"type": "object", "description": "the departure test's and the spike rule's parameters"},
        "spikes": {"type": "array", "description": "loss spikes (mean + k sigma of the trailing window)",
                   "items": {"type": "object", "additionalProperties": False,
                             "required": ["record", "step", "loss", "signals"],
                             "properties": {"record": {"type": "integer", "minimum": 0},
                                            "step": {"type": ["integer", "null"]},
                                            "loss": {"type": ["number", "null"]},
                                            "signals": {"type": "array", "items": _SIGNAL_SCHEMA,
                                                        "description": "departed before the spike, by onset"}}}},
        "departures": {"type": "array", "items": _SIGNAL_SCHEMA,
                       "description": "every series that left its own earlier level, by onset"},
    },
}

#: The document; :func:`flags_schema` adds the flag schema.
_FLAGS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "gradforensics/flags.schema.json",
    "title": "gradforensics flags.json, schema 1",
    "type": "object",
    "additionalProperties": False,
    "required": ["schema", "store", "n_records", "mode", "flags"],
    "properties": {
        "schema": {"const": 1},
        "store": {"type": "string"},
        "n_records": {"type": "integer", "minimum": 0, "description": "every record, non-finite ones included"},
        "mode": {"enum": ["training", "replay"]},
        "regime": _REGIME_SCHEMA,
        "baseline": _BASELINE_SCHEMA,
        "flags": {"type": "array", "description": "sorted by severity, descending"},
        "not_judged": _NOT_JUDGED_SCHEMA,
        "timeline": _TIMELINE_SCHEMA,
    },
}


def flag_schema() -> dict[str, Any]:
    """The JSON Schema of one flag; ``kind`` is among the registered analyses' kinds (a fresh copy)."""
    schema = copy.deepcopy(_FLAG_SCHEMA)
    schema["properties"] = {"kind": {"enum": list(flag_kinds()), "description": "what kind of trouble"},
                            **schema["properties"]}
    return schema


def flags_schema() -> dict[str, Any]:
    """The JSON Schema of a ``flags.json`` document, for the analyses registered now (a fresh copy)."""
    schema = copy.deepcopy(_FLAGS_SCHEMA)
    schema["properties"]["flags"]["items"] = flag_schema()
    return schema


def __getattr__(name: str) -> Any:
    """``FLAG_SCHEMA`` and ``FLAGS_SCHEMA``: the schemas for the analyses registered when read."""
    if name == "FLAGS_SCHEMA":
        return flags_schema()
    if name == "FLAG_SCHEMA":
        return flag_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "null": type(None),
    "integer": int, "number": (int, float), "boolean": bool,
}


def _is(value: Any, t: str) -> bool:
    if t in ("integer", "number") and isinstance(value, bool):
        return False
    if t == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[t])


def _errors(doc: Any, schema: dict[str, Any], where: str) -> Iterator[str]:
    """The keywords :data:`FLAGS_SCHEMA` uses, checked the way JSON Schema defines them."""
    if "const" in schema and doc != schema["const"]:
        yield f"{where}: expected {schema['const']!r}, got {doc!r}"
    if "enum" in schema and doc not in schema["enum"]:
        yield f"{where}: expected one of {schema['enum']}, got {doc!r}"
    if "oneOf" in schema:
        tries = [list(_errors(doc, sub, where)) for sub in schema["oneOf"]]
        n_ok = sum(not t for t in tries)
        if n_ok == 0:
            yield from min(tries, key=len)
        elif n_ok > 1:
            yield f"{where}: matches {n_ok} of the allowed forms, expected exactly one"
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(doc, t) for t in types):
            yield f"{where}: expected {' or '.join(types)}, got {type(doc).__name__} {doc!r}"
            return
    if _is(doc, "number"):
        if "minimum" in schema and doc < schema["minimum"]:
            yield f"{where}: {doc!r} is below the minimum {schema['minimum']}"
        if "maximum" in schema and doc > schema["maximum"]:
            yield f"{where}: {doc!r} is above the maximum {schema['maximum']}"
    if isinstance(doc, str) and len(doc) < schema.get("minLength", 0):
        yield f"{where}: empty string"
    if isinstance(doc, dict):
        for key in schema.get("required", ()):
            if key not in doc:
                yield f"{where}: missing required key {key!r}"
        props = schema.get("properties", {})
        for key, value in doc.items():
            if key in props:
                yield from _errors(value, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties", True) is False:
                yield f"{where}: unexpected key {key!r}"
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0) or len(doc) > schema.get("maxItems", len(doc)):
            yield f"{where}: expected {schema.get('minItems')}-{schema.get('maxItems')} items, got {len(doc)}"
        if schema.get("uniqueItems") and len({json.dumps(x, sort_keys=True) for x in doc}) != len(doc):
            yield f"{where}: items are not unique"
        if "items" in schema:
            for i, item in enumerate(doc):
                yield from _errors(item, schema["items"], f"{where}[{i}]")


_FIELDS = frozenset(_FLAG_SCHEMA["required"]) | {"kind"}


def _plainly_valid(f: Any, kinds: frozenset[str]) -> bool:
    """Whether flag *f* meets :func:`flag_schema` by a direct check, at most as lenient as the schema.

    A flag this accepts the schema accepts; one it does not is checked keyword by keyword
    (:func:`_errors`), which says what is wrong - so a document of thousands of flags is
    checked at a few microseconds a flag, with the same result and the same messages.
    """
    if type(f) is not dict or f.keys() != _FIELDS:
        return False
    kind, tensor, head, sources, sev, rec = (f["kind"], f["tensor"], f["head"], f["sources"], f["severity"],
                                             f["records"])
    return (type(kind) is str and kind in kinds and type(tensor) is str and tensor != ""
            and (head is None or (type(head) is int and head >= 0))
            and type(sources) is list and all(type(x) is str for x in sources) and len(set(sources)) == len(sources)
            and type(sev) in (int, float) and 0 <= sev <= 1
            and type(rec) is list and len(rec) == 2 and all(type(r) is int and r >= 0 for r in rec)
            and type(f["evidence"]) is dict and type(f["summary"]) is str)


def errors(doc: Any) -> list[str]:
    """Every way *doc* departs from the flags.json contract (empty list = valid)."""
    schema = flags_schema()
    flags = doc.get("flags") if isinstance(doc, dict) else None
    if isinstance(flags, list):
        kinds = frozenset(k for k in schema["properties"]["flags"]["items"]["properties"]["kind"]["enum"]
                          if isinstance(k, str))
        if all(_plainly_valid(f, kinds) for f in flags):     # every flag valid: the rest of the document alone
            del schema["properties"]["flags"]["items"]
    out = list(_errors(doc, schema, "flags.json"))
    if out:
        return out
    sev = [f["severity"] for f in doc["flags"]]
    if any(a < b for a, b in itertools.pairwise(sev)):
        out.append("flags.json.flags: not sorted by severity, descending")
    for i, f in enumerate(doc["flags"]):
        a, b = f["records"]
        if a > b or b >= max(doc["n_records"], 1):
            out.append(f"flags.json.flags[{i}].records: [{a}, {b}] is not a range inside the "
                       f"{doc['n_records']} records")
    if "timeline" in doc:
        out += _timeline_errors(doc["timeline"], doc["n_records"], len(doc["flags"]))
    return out


def _timeline_errors(t: dict[str, Any], n_records: int, n_flags: int) -> list[str]:
    """What the schema cannot say of ``timeline``: records inside the store, findings inside ``flags``, each
    list ordered by onset."""
    out = []
    lists = [("departures", t["departures"])] + [(f"spikes[{i}].signals", s["signals"])
                                                 for i, s in enumerate(t["spikes"])]
    for i, s in enumerate(t["spikes"]):
        if s["record"] >= max(n_records, 1):
            out.append(f"flags.json.timeline.spikes[{i}].record: {s['record']} is not inside the {n_records} records")
    for where, items in lists:
        for j, e in enumerate(items):
            if max(e["record"], e["alarm_record"]) >= max(n_records, 1):
                out.append(f"flags.json.timeline.{where}[{j}]: record {e['record']} / alarm {e['alarm_record']} "
                           f"not inside the {n_records} records")
            if e["finding"] is not None and e["finding"] >= n_flags:
                out.append(f"flags.json.timeline.{where}[{j}].finding: {e['finding']} is not a flag index")
        if any(a["record"] > b["record"] for a, b in itertools.pairwise(items)):
            out.append(f"flags.json.timeline.{where}: not ordered by onset")
    return out


def validate(doc: Any) -> None:
    """Raise :class:`FlagsSchemaError` naming the first problems if *doc* is not a valid flags.json."""
    errs = errors(doc)
    if errs:
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise FlagsSchemaError("; ".join(errs[:3]) + more)


def write(findings: Findings, path: str | os.PathLike[str]) -> Path:
    """Validate ``findings.flags_json()`` and write it to *path*."""
    doc = findings.flags_json()
    validate(doc)
    p = Path(path)
    p.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return p


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(flags_schema(), indent=2))
