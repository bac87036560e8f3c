"""What one record is on its way to the writer thread, and how its arrays are encoded on disk.

:class:`PendingRecord` is what ``record()`` validates and hands over; :func:`encode`
turns an array into what the store holds (lossless unless a narrower ``dtype`` is
asked for; bfloat16 kept as its uint16 bit patterns).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradforensics.errors import SpecError, StoreMismatchError
from gradforensics.recording.sketch import Sketcher
from gradforensics.store.schema import decode_bf16, encode_bf16

__all__ = ["DTYPES", "PendingRecord", "encode", "is_bf16", "mixture_row", "parse_sketch", "to_f32"]


DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class PendingRecord:
    """One validated record on its way to the writer thread.

    ``settle``, when set, runs on the writer thread before the record is
    encoded: it finishes what the caller's thread left in flight (the PyTorch
    recorder waits there for its device-to-host copies, makes them final in
    ``grads`` and hands its buffers back).  Without it the arrays are final.
    """

    meta: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    acts: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    settle: Callable[[], None] | None = None
    #: Sketches computed where the gradient lives (:class:`~gradforensics.recording.sketch.DeviceSketch`):
    #: ``{tensor: (sketch (k,) or (H, k), the tensor's shape, its dtype name)}``; never sketched again.
    sketches: dict[str, tuple[np.ndarray, tuple[int, ...], str]] = field(default_factory=dict)
    #: Activation statistics reduced where the activations live: ``{module: {stat: array}}`` (its range
    #: is in the recorder's ``_ranges``).
    act_stats: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: Per-head attention statistics: ``{module: {stat: (H,) float32}}`` (:mod:`gradforensics.recording.attention`).
    attn: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: Other per-record arrays, by store path: ``{path: (row, attrs)}`` (``logits/``, ``optim_live/``).
    rows: dict[str, tuple[np.ndarray, dict[str, Any]]] = field(default_factory=dict)


def is_bf16(a: np.ndarray) -> bool:
    return a.dtype.name == "bfloat16"


def encode(a: np.ndarray, dtype: str | None, name: str = "") -> tuple[np.ndarray, str]:
    """Array -> (on-disk array, encoding).  Lossless unless *dtype* narrows it.

    A finite value that a narrowing *dtype* cannot hold (above 65504 in float16)
    raises :class:`StoreMismatchError` naming *name*: stored as inf it would read
    back as a training NaN/Inf, which it was not.
    """
    if is_bf16(a):
        bits = a.view(np.uint16)
        if dtype in (None, "bfloat16"):
            return bits, "bfloat16-as-uint16"
        a = decode_bf16(bits)
    target = dtype or ("float16" if a.dtype == np.float16 else "float32")
    if target == "bfloat16":
        out, encoding = encode_bf16(a), "bfloat16-as-uint16"
        overflow = ((out & np.uint16(0x7FFF)) == np.uint16(0x7F80))   # +-inf bit patterns
    else:
        with np.errstate(over="ignore"):      # overflow is checked just below, and named
            out, encoding = np.ascontiguousarray(a, dtype=target), target
        overflow = np.isinf(out) if out.dtype.itemsize < a.dtype.itemsize else None
    if overflow is not None and overflow.any() and np.isfinite(a[overflow]).any():
        big = float(np.max(np.abs(a[overflow & np.isfinite(a)])))
        raise StoreMismatchError(
            f"record(): {name or 'an array'} holds {big:.4g}, beyond the range of {target} (its chosen store "
            "dtype); it would be stored as inf. Record it as float32 or bfloat16 (dtype=...)."
        )
    return out, encoding


def to_f32(a: np.ndarray) -> np.ndarray:
    if is_bf16(a):
        return decode_bf16(a.view(np.uint16))
    return np.asarray(a, dtype=np.float32)


def parse_sketch(sketch: int | Mapping[str, Any] | None) -> Sketcher | None:
    if sketch is None:
        return None
    if isinstance(sketch, int) and not isinstance(sketch, bool):
        return Sketcher(k=sketch)
    if isinstance(sketch, Mapping):
        unknown = set(sketch) - {"k", "seed", "method"}
        if unknown or "k" not in sketch:
            raise SpecError(f"sketch must be k or a dict with keys k, seed, method; got {dict(sketch)!r}.")
        return Sketcher(k=int(sketch["k"]), seed=int(sketch.get("seed", 0)), method=str(sketch.get("method", "countsketch")))
    raise SpecError(f"sketch must be an int k or a dict; got {type(sketch).__name__}.")


def mixture_row(sources: tuple[str, ...], source: str | None, mixture: Mapping[str, float] | None) -> np.ndarray:
    """A record's mixture over *sources*: one-hot for *source*, else *mixture*'s shares normalised to sum 1."""
    row = np.zeros(len(sources), dtype=np.float32)
    if (source is None) == (mixture is None):
        raise SpecError("record(): give exactly one of source= or mixture=.")
    items = {source: 1.0} if source is not None else dict(mixture or {})
    for name, share in items.items():
        if name not in sources:
            raise SpecError(f"record(): source {name!r} is not one of the store's sources {list(sources)}.")
        row[sources.index(name)] = share
    total = row.sum()
    if not total > 0 or np.any(row < 0):
        raise SpecError(f"record(): mixture shares must be >= 0 with a positive sum; got {items}.")
    return row / total
