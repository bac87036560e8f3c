"""Store schema v1: the names, dtypes and root attributes every store carries.

This module is the single place that knows the schema.  ``parse_root_attrs``
validates the root attributes once, when a store is opened; everything after
trusts the parsed :class:`StoreMeta`.  See ``docs/store-schema.md``.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from gradforensics.errors import NotAStoreError, SchemaVersionError, SpecError

SCHEMA_VERSION = 1
ROOT_ATTR = "gradforensics"

Mode = Literal["training", "replay"]
MODES: tuple[str, ...] = ("training", "replay")

#: Per-record metadata arrays under ``batches/`` (name -> numpy dtype).  ``mixture``
#: is (N, S); every other one is (N,).
BATCH_FIELDS: dict[str, str] = {
    "step": "int64",
    "loss": "float32",
    "mixture": "float32",
    "n_samples": "int32",
    "rank": "int32",
    "lr": "float32",
    "time": "float64",
}

#: Per-record activation statistics under ``acts/<module>/``.
ACT_FIELDS: tuple[str, ...] = ("hist", "frac_low", "frac_high", "mean", "std")

#: How a gradient array is encoded on disk.  The reader always yields float32.
ENCODINGS: tuple[str, ...] = ("float32", "float16", "bfloat16-as-uint16")


@dataclass(frozen=True)
class StoreMeta:
    """The parsed root attributes of a store (validated once, at open)."""

    sources: tuple[str, ...]
    mode: str = "training"
    n_records: int = 0
    n_weights: int = 0
    framework: str = "numpy"
    model: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    records_per_chunk: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def to_attrs(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "created": self.created,
            "framework": self.framework,
            "model": dict(self.model),
            "sources": list(self.sources),
            "mode": self.mode,
            "n_records": int(self.n_records),
            "n_weights": int(self.n_weights),
            "records_per_chunk": int(self.records_per_chunk),
            "extra": dict(self.extra),
        }

    def committed(self, n_records: int, n_weights: int) -> StoreMeta:
        return replace(self, n_records=n_records, n_weights=n_weights)


def new_meta(
    sources: list[str] | tuple[str, ...],
    mode: str,
    framework: str = "numpy",
    model: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> StoreMeta:
    """Validate the user's choices and build the metadata of a new store."""
    srcs = tuple(str(s) for s in sources)
    if not srcs:
        raise SpecError("sources must name at least one data source, e.g. sources=['en']; got none.")
    if len(set(srcs)) != len(srcs):
        dup = sorted({s for s in srcs if srcs.count(s) > 1})
        raise SpecError(f"sources must be distinct; {dup} given more than once.")
    if mode not in MODES:
        raise SpecError(f"mode must be one of {MODES}; got {mode!r}.")
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return StoreMeta(
        sources=srcs, mode=mode, framework=framework, model=dict(model or {}),
        created=created, extra=dict(extra or {}),
    )


def parse_root_attrs(path: str, attrs: dict[str, Any] | None) -> StoreMeta:
    """Parse and validate the ``gradforensics`` root attribute of the store at *path*."""
    if not attrs:
        raise NotAStoreError(
            f"{path}: not a gradforensics store (no '{ROOT_ATTR}' root attribute); "
            "expected a store written by gf.Recorder."
        )
    schema = attrs.get("schema")
    if schema != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path} has schema {schema}; this gradforensics reads schema {SCHEMA_VERSION}. "
            "Upgrade gradforensics, or re-capture."
        )
    try:
        return StoreMeta(
            sources=tuple(attrs["sources"]),
            mode=str(attrs.get("mode", "training")),
            n_records=int(attrs.get("n_records", 0)),
            n_weights=int(attrs.get("n_weights", 0)),
            framework=str(attrs.get("framework", "")),
            model=dict(attrs.get("model", {})),
            created=str(attrs.get("created", "")),
            records_per_chunk=int(attrs.get("records_per_chunk", 1)),
            extra=dict(attrs.get("extra", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise NotAStoreError(
            f"{path}: root attribute '{ROOT_ATTR}' is malformed ({exc!r}); expected schema-1 fields."
        ) from exc


def grad_path(tensor: str) -> str:
    return f"grads/{tensor}"


def sketch_path(tensor: str) -> str:
    return f"sketch/{tensor}"


def weight_path(tensor: str) -> str:
    return f"weights/{tensor}"


def act_path(module: str, stat: str) -> str:
    return f"acts/{module}/{stat}"


def batch_path(name: str) -> str:
    return f"batches/{name}"


def decode_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out
