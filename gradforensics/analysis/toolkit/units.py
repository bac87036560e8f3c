"""The units of the direction analyses (drift, oscillation, conflict), and their series.

A :class:`Unit` is one tensor, or one head of it, ready for the K-space statistics of
:mod:`gradforensics.analysis.toolkit.kspace`: its Gram matrix restricted to the
records usable for direction statistics (non-finite records excluded), rows in time
order.  :func:`units` lists every unit of a pass.

The per-unit series an analysis saves for its figures are packed per kind into one
array (:class:`SeriesPack`, read back with :func:`unit_series`), so a store with
thousands of heads gets a handful of arrays; names and small objects travel with
them as JSON in uint8 arrays (:func:`encode_json`, :func:`encode_names`).
:func:`head_of` and :func:`heads_per_tensor` read the ``head`` column of the
analyses' own tables.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.store.names import layer_of

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Context

__all__ = ["SeriesPack", "Unit", "Units", "decode_json", "decode_names", "encode_json", "encode_names", "head_of",
           "heads_per_tensor", "is_experts", "time_order", "unit_series", "units", "where"]


@dataclass(frozen=True)
class Unit:
    """One tensor (or one head of it), ready for K-space statistics.

    ``gram`` is K restricted to the usable (finite) records, rows in time order
    (by ``batches/step``, ties by record index); ``records`` are the store
    indices of those rows.  ``n_heads`` is set on the whole-tensor unit of a
    head-split tensor.
    """

    tensor: str
    head: int | None
    gram: np.ndarray
    records: np.ndarray
    n_excluded: int
    from_sketch: bool = False
    n_heads: int | None = None

    @property
    def n(self) -> int:
        return int(self.records.size)

    @property
    def layer(self) -> int | None:
        return layer_of(self.tensor)

    def where(self) -> str:
        """``tensor`` or ``tensor head h`` for sentences."""
        return self.tensor if self.head is None else f"{self.tensor} head {self.head}"


def time_order(batches: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Record indices sorted by optimizer step (stable: ties keep record order)."""
    step = batches.get("step")
    if step is None or len(step) != n:
        return np.arange(n)
    return np.argsort(np.asarray(step), kind="stable")


def units(ctx: Context) -> Units:
    """Every (tensor, head) of ``ctx.grams`` as a :class:`Unit`, sorted (a :class:`Units` sequence).

    A head-split tensor whose whole-tensor Gram matrix the engine did not
    provide gets one as the sum of its heads' (``K = Σ_h K_h``, exact: the
    heads partition the features).
    """
    return Units(ctx.grams, time_order(ctx.batches, ctx.n_records))


class Units(Sequence[Unit]):
    """The units of a pass, each built when it is taken (``units[i]``, iteration), none kept.

    ``ctx.grams`` may read its Gram matrices from disk one at a time
    (:mod:`~gradforensics.analysis.engine.spill`): a list of all units would hold
    every restricted K at once.  Taking a unit twice builds it twice, the same.
    Each unit's usable records are kept once found (:meth:`info` after ``units[i]``
    maps no file again; ``units[i]`` after :meth:`info` finds no records again), one
    array per distinct record set, read-only.
    """

    def __init__(self, grams: Mapping[tuple[str, int | None], Any], order: np.ndarray) -> None:
        by_tensor: dict[str, list[int]] = {}
        for tensor, head in grams:
            if head is not None:
                by_tensor.setdefault(tensor, []).append(int(head))
        self._grams, self._order = grams, order
        self._plan: list[tuple[str, int | None, tuple[int, ...]]] = []
        for tensor in sorted({t for t, _ in grams}):
            heads = tuple(sorted(by_tensor.get(tensor, [])))
            self._plan += [(tensor, head, heads) for head in [None, *heads]]
        self._kept: dict[int, tuple[np.ndarray, bool]] = {}        # unit -> (its records, from_sketch)
        self._sets: dict[bytes, np.ndarray] = {}                     # one array per distinct record set

    def __len__(self) -> int:
        return len(self._plan)

    @overload
    def __getitem__(self, i: int) -> Unit: ...
    @overload
    def __getitem__(self, i: slice) -> list[Unit]: ...

    def __getitem__(self, i: int | slice) -> Unit | list[Unit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        tensor, head, heads = self._plan[i]
        g = self._grams.get((tensor, head))
        if g is None:
            g = _sum_heads([self._grams[(tensor, h)] for h in heads])
        keep = self._records(i, g)
        K = np.asarray(g.gram, dtype=np.float64)
        sub = ks.block(K, keep)       # = K[np.ix_(keep, keep)]: a slice's copy for every record in store order
        return Unit(tensor=tensor, head=head, gram=sub,
                    records=keep.copy(), n_excluded=int(self._order.size - keep.size),
                    from_sketch=self._kept[i][1], n_heads=len(heads) if head is None and heads else None)

    def _records(self, i: int, g: Any) -> np.ndarray:
        """Unit *i*'s usable records (:func:`_kept` of its Gram result *g*), found once (read-only, shared by the
        units with the same records)."""
        got = self._kept.get(i)
        if got is None:
            keep = _kept(g, self._order).astype(np.int64)
            keep = self._sets.setdefault(keep.tobytes(), keep)
            keep.flags.writeable = False
            got = self._kept[i] = (keep, bool(getattr(g, "from_sketch", False)))
        return got[0]

    def info(self, i: int) -> Unit:
        """Unit *i* without its restricted K (``gram`` 0×0): its names, records and exclusions, as ``self[i]``
        gives them, for the tables after the statistics (no copy of K; a whole tensor the engine gave no
        Gram matrix of is built from its heads, as ``self[i]`` does)."""
        tensor, head, heads = self._plan[i]
        if i not in self._kept:
            g = self._grams.get((tensor, head))
            if g is None:
                return dataclasses.replace(self[i], gram=_NO_GRAM)
            self._records(i, g)
        keep, sketch = self._kept[i]
        return Unit(tensor=tensor, head=head, gram=_NO_GRAM, records=keep.copy(),
                    n_excluded=int(self._order.size - keep.size), from_sketch=sketch,
                    n_heads=len(heads) if head is None and heads else None)


_NO_GRAM = np.zeros((0, 0))
_NO_GRAM.flags.writeable = False


def _sum_heads(parts: list[Any]) -> Any:
    first = parts[0]
    gram = np.sum([np.asarray(p.gram, dtype=np.float64) for p in parts], axis=0)
    nonfinite = np.sum([np.asarray(p.nonfinite) for p in parts], axis=0)
    return dataclasses.replace(first, head=None, gram=gram, nonfinite=nonfinite,
                               n_features=sum(int(p.n_features) for p in parts))


def _kept(g: Any, order: np.ndarray) -> np.ndarray:
    """The records of *g* usable for direction statistics (no non-finite element, finite diagonal), in *order*."""
    finite = np.asarray(g.nonfinite) == 0
    return order[finite[order] & np.isfinite(np.diagonal(np.asarray(g.gram)))[order]]


# ------------------------------------------------------------ series
class SeriesPack:
    """Per-unit series of one kind packed into one array, so a store with thousands of
    heads gets a handful of arrays, not thousands.

    ``add(tensor, head, arr)`` per unit; ``to_series(what)`` returns
    ``{what: (U, *max_shape) float64, NaN-padded, what + "_units": JSON of [[tensor, head], ...]}``;
    :func:`unit_series` reads one unit back.
    """

    def __init__(self) -> None:
        self.units: list[list[Any]] = []
        self.arrays: list[np.ndarray] = []

    def add(self, tensor: str, head: int | None, arr: np.ndarray) -> None:
        self.units.append([tensor, None if head is None else int(head)])
        self.arrays.append(np.asarray(arr, dtype=np.float64))

    def to_series(self, what: str) -> dict[str, np.ndarray]:
        if not self.arrays:
            return {}
        ndim = max(a.ndim for a in self.arrays)
        arrs = [a.reshape(a.shape + (1,) * (ndim - a.ndim)) for a in self.arrays]
        shape = tuple(max(a.shape[d] for a in arrs) for d in range(ndim))
        out = np.full((len(arrs), *shape), np.nan)
        for i, a in enumerate(arrs):
            dims: tuple[int, ...] = tuple(a.shape)
            idx: tuple[Any, ...] = (i, *map(slice, dims))
            out[idx] = a
        return {what: out, f"{what}_units": encode_json(self.units)}


def unit_series(series: Mapping[str, np.ndarray], what: str, tensor: str, head: int | None) -> np.ndarray | None:
    """The series *what* of one unit from a :class:`SeriesPack` (None if absent)."""
    arr, raw = series.get(what), series.get(f"{what}_units")
    if arr is None or raw is None:
        return None
    for i, (t, h) in enumerate(decode_json(raw)):
        if t == tensor and h == (None if head is None else int(head)):
            return np.asarray(arr)[i]
    return None


def encode_json(obj: Any) -> np.ndarray:
    """A JSON-able object as a uint8 array, so it travels with the numeric series."""
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()


def decode_json(raw: np.ndarray) -> Any:
    """Inverse of :func:`encode_json`."""
    return json.loads(np.asarray(raw, dtype=np.uint8).tobytes().decode())


def encode_names(names: Iterable[str]) -> np.ndarray:
    """Source names as a uint8 array (JSON)."""
    return encode_json(list(names))


def decode_names(raw: np.ndarray | None, n: int) -> list[str]:
    """Inverse of :func:`encode_names`; ``["0", "1", ...]`` when absent or of the wrong length."""
    if raw is not None:
        names = decode_json(raw)
        if len(names) == n:
            return [str(x) for x in names]
    return [str(i) for i in range(n)]


# ------------------------------------------------------------ names
def is_experts(ctx: Context, tensor: str) -> bool:
    """Whether *tensor* is a mixture-of-experts unit: its "heads" (axis 1) are experts."""
    return ctx.store is not None and tensor in ctx.store.grads and bool(ctx.store.experts_of(tensor))


def where(tensor: str, head: int | None, experts: bool = False) -> str:
    """``tensor``, ``tensor head h``, or ``tensor expert e`` (*experts*: the unit of a mixture-of-experts tensor)."""
    return tensor if head is None else f"{tensor} {'expert' if experts else 'head'} {head}"


# ------------------------------------------------------------ tables
def head_of(value: Any) -> int | None:
    """A table's ``head`` cell as ``int`` or ``None`` (pandas may hold NaN or a float)."""
    import pandas as pd

    if value is None or bool(pd.isna(value)):
        return None
    return int(value)


def heads_per_tensor(table: Any) -> dict[str, int]:
    """Number of distinct heads of each head-split tensor in an analysis table."""
    seen: dict[str, set[int]] = {}
    for tensor, head in zip(table["tensor"], table["head"]):
        h = head_of(head)
        if h is not None:
            seen.setdefault(tensor, set()).add(h)
    return {t: len(h) for t, h in seen.items()}
