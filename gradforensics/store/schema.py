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

from gradforensics.errors import CorruptStoreError, NotAStoreError, SchemaVersionError, SpecError
from gradforensics.store.names import check_name, name_problem

__all__ = [
    "ACT_FIELDS",
    "ATTN_FIELDS",
    "BATCH_FIELDS",
    "ENCODINGS",
    "LOGIT_FIELDS",
    "MODEL_AUX_LOSS",
    "MODES",
    "ROOT_ATTR",
    "ROUTER_FIELDS",
    "SCHEMA_VERSION",
    "Mode",
    "StoreMeta",
    "act_path",
    "attn_path",
    "batch_path",
    "committed_prefix",
    "decode_bf16",
    "encode_bf16",
    "grad_path",
    "new_meta",
    "parse_root_attrs",
    "router_path",
    "sketch_path",
    "weight_path",
]


SCHEMA_VERSION = 1
ROOT_ATTR = "gradforensics"

Mode = Literal["training", "replay"]
MODES: tuple[str, ...] = ("training", "replay")

#: Per-record metadata arrays under ``batches/`` (name -> numpy dtype).  ``mixture``
#: is (N, S); every other one is (N,).  ``skipped`` (1: a loss scaler skipped the step),
#: ``loss_scale`` and ``logged_grad_norm`` (the norm the run itself logged) come only
#: from an import given the run's logs (:mod:`gradforensics.runlog`).
BATCH_FIELDS: dict[str, str] = {
    "step": "int64",
    "loss": "float32",
    "mixture": "float32",
    "n_samples": "int32",
    "rank": "int32",
    "lr": "float32",
    "time": "float64",
    # written by an import given the run's own logs (--logs), absent otherwise
    "skipped": "uint8",
    "loss_scale": "float32",
    "logged_grad_norm": "float32",
}

#: Per-record activation statistics under ``acts/<module>/``.
#: ``kurtosis`` is ``(N, 1)``: the module's excess kurtosis over all its outputs of the record.
ACT_FIELDS: tuple[str, ...] = ("hist", "frac_low", "frac_high", "mean", "std", "dead", "saturated", "kurtosis")

#: Per-record, per-head attention statistics under ``attn/<module>/``, float32 ``(N, H)``.
ATTN_FIELDS: tuple[str, ...] = ("max_logit", "entropy_mean", "entropy_min", "onehot_frac")

#: Per-record output-logit statistics under ``logits/<module>/``, float32 ``(N,)``
#: (``row_norm_ratio`` NaN off the weight snapshots; :mod:`gradforensics.recording.logits`).
LOGIT_FIELDS: tuple[str, ...] = ("logz_mean", "logz_max", "logit_max", "logit_mean", "row_norm_ratio")

#: Per-record router statistics of a mixture-of-experts layer under ``router/<router module>/``:
#: ``load`` float32 ``(N, E)`` (attribute ``experts = E``), the others float32 ``(N,)``
#: (:mod:`gradforensics.recording.experts`; ``aux_loss`` the layer's load-balancing loss,
#: absent from stores written before it).
ROUTER_FIELDS: tuple[str, ...] = ("load", "max_share", "entropy", "logit_z", "aux_loss")

#: The auxiliary load-balancing loss the model itself reports (a Hugging Face MoE model's
#: ``output.aux_loss``), float32 ``(N,)``: the mean over the record's forwards.
MODEL_AUX_LOSS = "router/aux_loss"

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
    #: Multi-rank capture only: ``{"world_size": R, "completed": [ranks that closed], "records": [per rank]}``.
    ranks: dict[str, Any] = field(default_factory=dict)
    #: The run's number formats: ``{"parameters": "float32", "master": "float32"}`` (empty: not recorded).
    dtypes: dict[str, str] = field(default_factory=dict)

    def to_attrs(self) -> dict[str, Any]:
        ranks = {"ranks": dict(self.ranks)} if self.ranks else {}
        ranks.update({"dtypes": dict(self.dtypes)} if self.dtypes else {})
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
            **ranks,
        }

    def committed(self, n_records: int, n_weights: int) -> StoreMeta:
        return replace(self, n_records=n_records, n_weights=n_weights)


def new_meta(
    sources: list[str] | tuple[str, ...],
    mode: str,
    framework: str = "numpy",
    model: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    dtypes: dict[str, str] | None = None,
) -> StoreMeta:
    """Validate the user's choices and build the metadata of a new store."""
    srcs = tuple(check_name(s, "source") for s in sources)
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
        created=created, extra=dict(extra or {}), dtypes=_dtypes(dtypes or {}),
    )


#: Keys of the ``dtypes`` root attribute: the parameters' format and the optimizer's master weights'.
DTYPE_KEYS: tuple[str, ...] = ("parameters", "master")


def _dtypes(d: dict[str, Any]) -> dict[str, str]:
    bad = [k for k, v in d.items() if k not in DTYPE_KEYS or not isinstance(v, str) or not v]
    if bad:
        raise SpecError(f"dtypes must map {list(DTYPE_KEYS)} to dtype names like 'float32' or 'bfloat16'; "
                        f"got {d!r}.")
    return {k: str(v) for k, v in d.items()}


def parse_root_attrs(path: str, attrs: Any) -> StoreMeta:
    """Parse and validate the ``gradforensics`` root attribute of the store at *path*.

    Every field is typed strictly (``n_records`` is a non-negative integer, not
    ``"12"``, ``3.7`` or ``true``); a malformed field is one
    :class:`~gradforensics.errors.CorruptStoreError` naming it.
    """
    if not attrs:
        raise NotAStoreError(
            f"{path}: not a gradforensics store (no '{ROOT_ATTR}' root attribute); "
            "expected a store written by gf.Recorder."
        )
    if not isinstance(attrs, dict):
        raise CorruptStoreError(f"{path}: root attribute '{ROOT_ATTR}' is a {type(attrs).__name__}, not an object; "
                                "the store's metadata is damaged.")
    schema = attrs.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path} has schema {schema!r}; this gradforensics reads schema {SCHEMA_VERSION}. "
            "Upgrade gradforensics, or re-capture."
        )
    get = _FieldReader(path, attrs)
    sources = get("sources", list, required=True)
    problems = [p for p in (name_problem(s) for s in sources) if p]
    if not sources or problems or len(set(sources)) != len(sources):
        raise get.error("sources", "a non-empty list of distinct, valid source names")
    mode = get("mode", str, "training")
    if mode not in MODES:
        raise get.error("mode", f"one of {MODES}")
    n_records = get.count("n_records", 0)
    return StoreMeta(
        sources=tuple(sources), mode=mode,
        n_records=n_records, n_weights=get.count("n_weights", 0),
        framework=get("framework", str, ""), model=get("model", dict, {}), created=get("created", str, ""),
        records_per_chunk=max(get.count("records_per_chunk", 1), 1), extra=get("extra", dict, {}),
        ranks=_ranks(get, n_records), dtypes=_read_dtypes(get),
    )


def _read_dtypes(get: _FieldReader) -> dict[str, str]:
    d = get("dtypes", dict, {})
    if not all(k in DTYPE_KEYS and isinstance(v, str) for k, v in d.items()):
        raise get.error("dtypes", f"a mapping of {list(DTYPE_KEYS)} to dtype names")
    return dict(d)


def committed_prefix(per_rank: list[int]) -> int:
    """Longest prefix of global indices that are all written: ``min_q(c_q * R + q)``.

    Rank ``q`` of ``R`` writes its ``i``-th record at index ``i * R + q``
    (:mod:`gradforensics.store.ranks`).
    """
    world = len(per_rank)
    return min(c * world + q for q, c in enumerate(per_rank))


def _ranks(get: _FieldReader, n_records: int) -> dict[str, Any]:
    """The optional ``ranks`` field of a multi-rank store, checked: world size, completed ranks, counts.

    The counts agree with ``n_records``: once rank 0 has closed the store
    (``completed`` lists it) every rank's records are committed, ``n_records ==
    sum(records)``; before (a commit while the ranks write, or rank 0 died) the
    committed records are the longest prefix, ``n_records == committed_prefix(records)``.
    """
    ranks = get("ranks", dict, {})
    if not ranks:
        return {}
    world, done, recs = ranks.get("world_size"), ranks.get("completed"), ranks.get("records")
    ok = (type(world) is int and world >= 1 and isinstance(done, list) and isinstance(recs, list)
          and all(type(q) is int and 0 <= q < world for q in done) and len(recs) == world
          and all(type(n) is int and n >= 0 for n in recs))
    if not ok:
        raise get.error("ranks", "{'world_size': R, 'completed': [ranks in 0..R-1], 'records': [R counts]}")
    closed = bool(done)
    want = sum(recs) if closed else committed_prefix(recs)
    if n_records != want:
        how = (f"the sum of ranks.records {recs} (rank 0 closed the store: completed {done})" if closed else
               f"the longest prefix of ranks.records {recs} (no rank completed: min over q of records[q]*{world}+q)")
        raise CorruptStoreError(f"{get.path}: root attribute '{ROOT_ATTR}' field 'ranks' commits {want} records, "
                                f"{how}, but field 'n_records' is {n_records}. The store's metadata is damaged.")
    return dict(ranks)


class _FieldReader:
    """Typed access to the root attribute's fields, with one error message shape."""

    def __init__(self, path: str, attrs: dict[str, Any]) -> None:
        self.path, self.attrs = path, attrs

    def error(self, key: str, want: str) -> CorruptStoreError:
        value = repr(self.attrs.get(key))
        value = value if len(value) <= 80 else value[:77] + "..."
        return CorruptStoreError(f"{self.path}: root attribute '{ROOT_ATTR}' field {key!r} is {value}; "
                                 f"expected {want}. The store's metadata is damaged.")

    def __call__(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        if key not in self.attrs:
            if required:
                raise self.error(key, f"a {kind.__name__} (the field is required)")
            return default
        value: Any = self.attrs[key]
        if type(value) is not kind:
            raise self.error(key, f"a {kind.__name__}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise self.error(key, "a list of strings")
        return value

    def count(self, key: str, default: int) -> int:
        value = self.attrs.get(key, default)
        if type(value) is not int or value < 0:
            raise self.error(key, "a non-negative integer")
        return value


def grad_path(tensor: str) -> str:
    return f"grads/{tensor}"


def sketch_path(tensor: str) -> str:
    return f"sketch/{tensor}"


def weight_path(tensor: str) -> str:
    return f"weights/{tensor}"


def act_path(module: str, stat: str) -> str:
    return f"acts/{module}/{stat}"


def attn_path(module: str, stat: str) -> str:
    return f"attn/{module}/{stat}"


def router_path(module: str, stat: str) -> str:
    return f"router/{module}/{stat}"


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
