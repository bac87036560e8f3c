"""The plan of one pass: which collections compute what, and where each value goes back.

:func:`plan_pass` chooses the regime (exact below ``N₀`` records, long-history above;
a spill to disk where the Gram matrices are large), then builds, per tensor, one slab
pass that feeds its Gram matrices and every selected analysis's slab reductions of that
tensor (one-slab tensors many a task: :mod:`~gradforensics.analysis.engine.plan_small`),
then the analyses' ``lazy`` graphs.  The :class:`Plan` holds a key per value, the
collections computed in one ``dask.compute``
(:func:`~gradforensics.analysis.engine.schedule.compute_collections`), and
:meth:`Plan.unpack` turns their values into ``(grams, computed, long)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.grams import Design, GramResult, LongHistory, SlabReduction
from gradforensics.analysis.contract.model import Analysis, Need
from gradforensics.analysis.engine.gram import flatten_grams, gram_graph, slab_outputs
from gradforensics.analysis.engine.longhistory import check_supported, design, long_graph
from gradforensics.analysis.engine.options import EngineOptions
from gradforensics.analysis.engine.plan_small import OneSlab, fused_output, fused_outputs, one_slab
from gradforensics.analysis.engine.spill import GramSpill
from gradforensics.errors import SpecError, WriteRefusedError

if TYPE_CHECKING:
    from distributed import Client

    from gradforensics.store.reader import Store

__all__ = ["Plan", "n_units", "plan_pass", "units_at_once"]

Key = tuple[str, ...]
Grams = Mapping[tuple[str, int | None], GramResult]


@dataclass
class Plan:
    """One pass: a key per value (``("gram", tensor)`` or ``("lazy", analysis, key)``), the
    collections that compute them, and where each collection's value goes among the keys."""

    keys: list[Key]
    collections: list[Any]
    #: per collection, the key it computes, or a fused task's list of keys (-1: a value that goes on elsewhere)
    slots: list[int | list[int]]
    #: under a client, the Gram collections whose values go to their spill as they come back
    arrive: dict[int, GramSpill] | None
    sink: GramSpill | None
    long_design: Design | None
    n0: int
    #: the analyses with ``lazy`` or ``slab_reductions`` (each gets a ``computed`` entry)
    computing: list[str]

    def unpack(self, values: list[Any]) -> tuple[Grams, dict[str, Any], LongHistory | None]:
        """``(grams, computed, long)`` from the values of :attr:`collections` (what ``Context`` holds)."""
        gram_lists: dict[str, list[Any]] = {}
        computed: dict[str, dict[str, Any]] = {name: {} for name in self.computing}
        for key, val in zip(self.keys, _spread(values, self.slots, len(self.keys)), strict=True):
            if key[0] == "gram":
                gram_lists[key[1]] = val
            else:
                computed[key[1]][key[2]] = val
        if self.long_design is not None:
            longs = {(g.tensor, g.head): g for res in gram_lists.values() for g in res}
            return {}, computed, LongHistory(self.long_design, longs, self.n0)
        return (flatten_grams(gram_lists) if self.sink is None else self.sink.grams(gram_lists)), computed, None


def plan_pass(store: Store, selected: list[Analysis], engine: EngineOptions, client: Client | None,
              grams: bool = True, batches: dict[str, np.ndarray] | None = None,
              spill: GramSpill | None = None) -> Plan:
    """The :class:`Plan` of a pass of *selected* over *store* (nothing is read but ``batches/mixture``).

    With *spill* the exact regime's Gram matrices go to its directory as they are computed
    (:mod:`~gradforensics.analysis.engine.spill`); *client* is the one the pass runs on
    (None: the local threads).

    Raises
    ------
    SpecError
        An analysis returns the same key from ``lazy`` and ``slab_reductions``, or one
        that does not run in the long-history regime is selected above ``N₀`` records.
    """
    want_gram = grams and any(Need.GRAM in a.needs for a in selected)
    reductions = _slab_reductions(store, selected)
    n0, long_design = _regime(store, selected, engine, want_gram, batches, spill)
    sink = spill if spill is not None and spill.on_disk else None
    planner = _Planner(store, engine, client, sink, long_design)
    for tensor in store.tensors if want_gram else sorted(reductions):
        planner.tensor(tensor, reductions.get(tensor, []), want_gram)
    planner.lazy(selected)
    keys = planner.keys
    arrive = {i: sink for i, k in enumerate(keys) if k[0] == "gram"} if sink is not None and client is not None \
        else None
    fused = {first + j for first, one in planner.small for j in range(one.n_outputs)}
    slots: list[int | list[int]] = [i for i in range(len(keys)) if i not in fused]   # one collection each
    slots, collections = _with_fused(planner.small, slots, planner.collections, engine.precision)
    computing = [a.name for a in selected if a.lazy is not None or a.slab_reductions is not None]
    return Plan(keys, collections, slots, arrive, sink, long_design, n0, computing)


def _regime(store: Store, selected: list[Analysis], engine: EngineOptions, want_gram: bool,
            batches: dict[str, np.ndarray] | None, spill: GramSpill | None) -> tuple[int, Design | None]:
    """``(N₀, design)`` of the pass: the design of the super-records above ``N₀`` records, else None."""
    n0 = first_n0 = engine.n0(units_at_once(store))
    if want_gram and store.n_records <= n0 and spill is not None:
        n0 = _start_spill(store, selected, engine, spill, n0)     # below N records: no room on disk
    if not (want_gram and store.n_records > n0):
        return n0, None
    check_supported(selected, store.n_records, n0)    # before anything is read
    mix = (batches if batches is not None else store.batches())["mixture"]
    long_design = design(mix, engine.band, engine.windows)
    if spill is not None:
        _start_long_spill(store, engine, spill, long_design, fell_back=n0 < first_n0)
    return n0, long_design


class _Planner:
    """The keys and collections of a pass, built tensor by tensor."""

    def __init__(self, store: Store, engine: EngineOptions, client: Client | None, sink: GramSpill | None,
                 long_design: Design | None) -> None:
        self.store, self.engine, self.client, self.sink, self.long_design = store, engine, client, sink, long_design
        self.keys: list[Key] = []
        self.collections: list[Any] = []
        self.small: list[tuple[int, OneSlab]] = []      # one-slab tensors: read and reduced many a task (plan_small)

    def add(self, key: Key, collection: Any) -> None:
        self.keys.append(key)
        self.collections.append(collection)

    def gram(self, tensor: str, collection: Any) -> None:
        """One tensor's Gram collection, written to the spill by a task of its own under the local scheduler."""
        if self.sink is not None and self.client is None:
            collection = self.sink.wrap(collection, len(self.keys))
        self.add(("gram", tensor), collection)

    def reduced(self, mine: list[tuple[str, str, SlabReduction]], parts: list[Any]) -> None:
        for j, (aname, rkey, r) in enumerate(mine):
            self.add(("lazy", aname, rkey), parts[j] if r.finish is None else r.finish(parts[j]))

    def tensor(self, tensor: str, mine: list[tuple[str, str, SlabReduction]], want_gram: bool) -> None:
        """The slab pass of *tensor*: its Gram matrices (if *want_gram*) and the slab reductions *mine*."""
        store, engine, sink = self.store, self.engine, self.sink
        # a spilled pass fuses too under the local scheduler: the fused task writes each tensor's spill files
        one = None if self.long_design is not None or (sink is not None and self.client is not None) \
            else one_slab(store, tensor, [r for _, _, r in mine], want_gram, engine.slab_bytes,
                          None if sink is None or sink.directory is None else (sink.directory, len(self.keys)))
        if one is not None:
            self.small.append((len(self.keys), one))
            self.keys += ([("gram", tensor)] if want_gram else []) + [("lazy", a, k) for a, k, _ in mine]
            return
        opts: dict[str, Any] = {"slab_bytes": engine.slab_bytes, "split_every": engine.split_every}
        if self.long_design is not None:
            if mine and tensor not in store.grads:
                raise SpecError(f"{store.path}: slab reductions of {tensor} need grads/{tensor}.")
            out = long_graph(store, tensor, self.long_design, tuple(r for _, _, r in mine), **opts)
            self.gram(tensor, out[0])
            self.reduced(mine, [out[1][j] for j in range(len(mine))])
            return
        if not mine:
            self.gram(tensor, gram_graph(store, tensor, precision=engine.precision, **opts))
            return
        g, parts = slab_outputs(store, tensor, [r for _, _, r in mine], gram=want_gram, precision=engine.precision,
                                **opts)
        if g is not None:
            self.gram(tensor, g)
        self.reduced(mine, parts)

    def lazy(self, selected: list[Analysis]) -> None:
        """The analyses' ``lazy`` graphs (``acts/*``, ``weights/*``), each key taken once."""
        taken = {k for k in self.keys if k[0] == "lazy"}      # a set: a list's `in` per lazy key was keys x lazy keys
        for a in selected:
            if a.lazy is None:
                continue
            for name, coll in dict(a.lazy(self.store)).items():
                if ("lazy", a.name, name) in taken:
                    raise SpecError(f"{a.name}: key {name!r} is returned by both lazy and slab_reductions.")
                self.add(("lazy", a.name, name), coll)


def _with_fused(small: list[tuple[int, OneSlab]], slots: list[int | list[int]], collections: list[Any],
                precision: str) -> tuple[list[int | list[int]], list[Any]]:
    """*collections* with the fused tasks of the one-slab tensors *small* appended; *slots*: where each
    collection's value goes among the pass's keys (a fused task's list of values: one key each, -1 for a
    reduction's aggregate that goes on through its ``finish``, a collection of its own appended after)."""
    where = dict((id(one), first) for first, one in small)
    finished: list[tuple[int, Any]] = []
    for coll, group in fused_outputs([one for _, one in small], precision):
        slot: list[int] = []
        for one in group:
            for j in range(one.n_outputs):
                r = one.reductions[j - int(one.gram)] if j >= int(one.gram) else None
                if r is not None and r.finish is not None:
                    finished.append((where[id(one)] + j, r.finish(fused_output(coll, len(slot)))))
                    slot.append(-1)
                else:
                    slot.append(where[id(one)] + j)
        collections.append(coll)
        slots.append(slot)
    for at, coll in finished:
        collections.append(coll)
        slots.append(at)
    return slots, collections


def _spread(values: list[Any], slots: list[int | list[int]], n: int) -> list[Any]:
    """The value of each of the pass's *n* keys from the collections' *values* (placed by *slots*)."""
    out: list[Any] = [None] * n
    for slot, val in zip(slots, values, strict=True):
        if isinstance(slot, list):
            for i, v in zip(slot, val, strict=True):
                if i >= 0:
                    out[i] = v
        else:
            out[slot] = val
    return out


def _start_spill(store: Store, selected: list[Analysis], engine: EngineOptions, spill: GramSpill, n0: int) -> int:
    """``N₀`` of the pass: *n0*, or - ``TMPDIR`` lacks room for the exact Gram matrices - the records it has room for.

    Falls back (with a one-line warning) only where nothing asked for the exact regime and
    every selected analysis runs in the long one; otherwise refuses in one line.
    """
    short = spill.start(n_units(store), store.n_records, engine.spill)
    if short is None:
        return n0
    what, fit = short
    bad = [a.name for a in selected if not a.long_history]
    if engine.long_history is not None or bad:
        why = (f"{', '.join(bad)} cannot run in the long-history regime" if bad
               else f"the exact regime was asked for (engine option long_history = {engine.long_history:,})")
        raise WriteRefusedError(f"{store.path}: {what}, and {why}; point TMPDIR at a disk with room, or hold "
                                "them in memory with options={'engine': {'spill': False}}.")
    warnings.warn(f"{store.path}: {what}: running the long-history regime instead (N₀ = {fit:,} for this "
                  "pass); point TMPDIR at a disk with room for the exact one.", stacklevel=_CALLER)
    return min(n0, fit)


def _start_long_spill(store: Store, engine: EngineOptions, spill: GramSpill, d: Design, fell_back: bool) -> None:
    """Spill the long-history regime's super-record Gram matrices (``m²`` float64 a unit) where they are large.

    Where ``TMPDIR`` lacks the room they stay in memory, with a one-line warning
    (silently where the pass just fell back from the exact regime for the same lack,
    and said so); where spilling was asked for (engine option ``spill = true``) the
    pass refuses in one line instead, before anything is read.
    """
    kept = int(np.count_nonzero(d.weights() > 0))
    short = spill.start(n_units(store), kept, engine.spill, what="the long-history regime's super-record Gram "
                        "matrices", rows="super-records")
    if short is None or fell_back:
        return
    what = short[0]
    if engine.spill:
        raise WriteRefusedError(f"{store.path}: {what}, and spilling them was asked for (engine option spill = "
                                "true); point TMPDIR at a disk with room, or hold them in memory with "
                                "options={'engine': {'spill': False}}.")
    warnings.warn(f"{store.path}: {what}: holding them in memory instead; point TMPDIR at a disk with room.",
                  stacklevel=_CALLER)


#: the warnings above name the caller of ``analyze`` (_start_*, _regime, plan_pass, run_pass, _analyze, analyze)
_CALLER = 7


def n_units(store: Store) -> int:
    """Tensors and heads of *store* the Gram pass covers (one Gram matrix each in the exact regime)."""
    return sum(_units_of(store, t) for t in store.tensors)


def units_at_once(store: Store) -> int:
    """Units (whole + heads) of *store*'s largest tensor: the Gram matrices the exact regime holds at once per thread."""
    return max((_units_of(store, t) for t in store.tensors), default=1)


def _units_of(store: Store, tensor: str) -> int:
    info = store.grads[tensor] if tensor in store.grads else store.sketches[tensor]
    return 1 + (int(info.shape[1]) if info.split is not None else 0)


def _slab_reductions(store: Store, selected: list[Analysis]) -> dict[str, list[tuple[str, str, SlabReduction]]]:
    """Every selected analysis's slab reductions, grouped by tensor: ``{tensor: [(analysis, key, reduction)]}``."""
    out: dict[str, list[tuple[str, str, SlabReduction]]] = {}
    for a in selected:
        if a.slab_reductions is None:
            continue
        for key, r in dict(a.slab_reductions(store)).items():
            out.setdefault(r.tensor, []).append((a.name, key, r))
    return out
