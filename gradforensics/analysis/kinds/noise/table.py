"""The noise analysis's table: per tensor, head and source, the noise-scale estimates from the Gram matrices.

What :mod:`gradforensics.analysis.kinds.noise` tabulates before it flags: the rows'
design (batch sizes, pure-source index, mixture shares; within-source estimates in a
replay of pure batches, else pooled), each unit's rows (all sources, then each source
with at least two pure records) through the stacked estimators of
:mod:`~gradforensics.analysis.kinds.noise.scale`, and the ``whole model`` rows summed
over the whole tensors.  The formulas and their references are that module's and the
analysis's docstrings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.kinds.noise.scale import (
    FIELDS,
    Parts,
    mixture_parts,
    noise_parts_stack,
    summaries,
    summarize,
)
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit.parallel import map_slabs

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    import pandas as pd

    from gradforensics.analysis.contract.grams import GramResult

__all__ = ["COLUMNS", "MODEL", "N_FEATURES", "STACK_BYTES", "Design", "Taken", "design", "model_rows", "noise_rows",
           "noise_rows_many", "noise_table"]

#: The ``tensor`` of the run-level rows and finding.
MODEL = "whole model"
COLUMNS = ("tensor", "head", "source", *FIELDS, "from_sketch")


@dataclass(frozen=True)
class Design:
    """What the rows are estimated from: batch sizes, pure-source index, mixture shares, within or pooled."""

    n_samples: np.ndarray
    source_index: np.ndarray
    sources: tuple[str, ...]
    shares: np.ndarray
    within: bool


def design(n_samples: np.ndarray, mixture: np.ndarray | None, source_index: np.ndarray, sources: tuple[str, ...],
           mode: str = "replay") -> Design:
    """Within-source estimates in a replay whose batches are all pure, with >= 2 sources of >= 2 records."""
    b = np.asarray(n_samples, dtype=np.float64)
    idx = np.asarray(source_index)
    if mixture is not None and len(sources):
        shares = (np.asarray(mixture, dtype=np.float64) * b[:, None]).sum(axis=0)
    else:
        shares = np.array([np.sum(b[idx == s]) for s in range(len(sources))])
    counts = np.array([np.sum((idx == s) & (b > 0)) for s in range(len(sources))])
    present = counts > 0
    within = bool(mode == "replay" and np.all(idx[b > 0] >= 0) and present.sum() >= 2 and counts[present].min() >= 2)
    return Design(b, idx, tuple(sources), shares, within)


def _within(gram: np.ndarray, rows: np.ndarray, d: Design) -> Parts | None:
    """The within-source parts of the records *rows* (every one pure, >= 2 sources of >= 2 records), else None."""
    present = np.unique(d.source_index[rows])
    if present.size >= 2 and min(np.sum(d.source_index[rows] == s) for s in present) >= 2:
        remap = np.searchsorted(present, d.source_index[rows])
        return mixture_parts(ks.block(gram, rows), d.n_samples[rows], remap, d.shares[present])
    return None


def _row(tensor: str, head: int | None, label: str, parts: Parts, estimator: str, b: np.ndarray,
         from_sketch: bool) -> dict[str, Any]:
    est = summarize(parts, float(b.mean()) if b.size else math.nan, int(b.size), estimator)
    return {"tensor": tensor, "head": head, "source": label, **est, "from_sketch": from_sketch}


def noise_rows(g: GramResult, d: Design, mask: np.ndarray | None = None) -> tuple[list[dict[str, Any]], dict]:
    """Rows of one tensor (or head): all sources, then each source with >= 2 pure records; and their parts."""
    return noise_rows_many([g], d, mask)[0]


def noise_rows_many(gs: Iterable[GramResult], d: Design, mask: np.ndarray | None = None,
                    ) -> list[tuple[list[dict[str, Any]], dict]]:
    """The rows of every unit of *gs* (:func:`noise_rows` is a stack of one): the pooled estimates of all rows with
    the same records in one :func:`~gradforensics.analysis.kinds.noise.scale.noise_parts_stack` pass, the
    jackknife errors of all rows in one :func:`~gradforensics.analysis.kinds.noise.scale.summaries` call.

    The units are taken one at a time (*gs* may read each Gram matrix when it is taken): what is kept of a
    unit is its rows' sub-blocks of K, until the stacked pass.
    """
    entries: list[tuple[int, str, np.ndarray, Parts | None, str]] = []      # unit, label, its records' mask, ...
    pooled: dict[bytes, tuple[np.ndarray, list[int], list[np.ndarray]]] = {}
    meta: list[tuple[str, int | None, bool]] = []
    for u, g in enumerate(gs):
        meta.append((g.tensor, g.head, g.from_sketch))
        usable = g.finite & (d.n_samples > 0) if mask is None else mask
        for s in [None, *range(len(d.sources))]:
            sel = usable if s is None else usable & (d.source_index == s)
            if s is not None and sel.sum() < 2:
                continue
            rows = np.flatnonzero(sel)
            within = _within(g.gram, rows, d) if s is None and d.within else None
            if within is None:
                group = pooled.setdefault(rows.tobytes(), (rows, [], []))
                group[1].append(len(entries))
                group[2].append(ks.block(np.asarray(g.gram, dtype=np.float64), rows))
            entries.append((u, "" if s is None else d.sources[s], sel, within, "within sources" if within else "pooled"))
        del g
    got: dict[int, Parts] = {}
    for rows, members, blocks in pooled.values():
        got.update(zip(members, noise_parts_stack(np.stack(blocks), d.n_samples[rows]), strict=True))
        blocks.clear()
    parts = [p if p is not None else got[e] for e, (_, _, _, p, _) in enumerate(entries)]
    sizes = [d.n_samples[sel] for _, _, sel, _, _ in entries]
    ests = summaries([(p, float(b.mean()) if b.size else math.nan, int(b.size), how)
                      for p, b, (_, _, _, _, how) in zip(parts, sizes, entries, strict=True)])
    out: list[tuple[list[dict[str, Any]], dict]] = [([], {}) for _ in meta]
    for p, est, (u, label, _, _, _) in zip(parts, ests, entries, strict=True):
        tensor, head, sketch = meta[u]
        out[u][1][label] = p
        out[u][0].append({"tensor": tensor, "head": head, "source": label, **est, "from_sketch": sketch})
    return out


STACK_BYTES = 32 * 2**20
"""Bytes of K's sub-blocks one stacked pass of noise's slab holds, at most (at least one unit a pass)."""


def model_rows(grams: Mapping[tuple[str, int | None], GramResult], d: Design,
               done: Mapping[tuple[str, int | None], tuple[list[dict[str, Any]], dict]] | None = None,
               seen: Mapping[tuple[str, int | None], Taken] | None = None,
               ) -> list[dict[str, Any]]:
    """The ``whole model`` rows: |G|² and tr(Σ) summed over the whole tensors, on records usable in all.

    *done*: :func:`noise_rows` of some units on their own usable records; a whole tensor whose own
    usable records are the model's (no non-finite record of its own) takes its parts from there (the
    same function of the same numbers) instead of estimating them again.  *seen*: what
    :func:`noise_table` saw of the units as it read them (their records and sketch flags, not read again).
    """
    whole = [k for k in grams if k[1] is None]          # keys: a spilled pass reads each K when taken
    if not whole:
        return []
    seen = seen or {}
    finite = {k: seen[k].finite if k in seen else grams[k].finite for k in whole}
    mask = np.logical_and.reduce(list(finite.values())) & (d.n_samples > 0)
    total: dict[str, Parts] = {}
    sketch = False
    for k in whole:
        own = done is not None and k in done and np.array_equal(finite[k] & (d.n_samples > 0), mask)
        if own and done is not None:
            parts = done[k][1]
            sketch = sketch or (seen[k].from_sketch if k in seen else grams[k].from_sketch)
        else:
            g = grams[k]
            sketch = sketch or g.from_sketch
            parts = noise_rows(g, d, mask)[1]
        for label, p in parts.items():
            total[label] = p if label not in total else total[label] + p
    out = []
    for label, p in total.items():
        sel = mask if label == "" else mask & (d.source_index == d.sources.index(label))
        how = "within sources" if label == "" and d.within else "pooled"
        out.append(_row(MODEL, None, label, p, how, d.n_samples[sel], sketch))
    return out


def noise_table(grams: Mapping[tuple[str, int | None], GramResult], n_samples: np.ndarray, source_index: np.ndarray,
                sources: tuple[str, ...], mixture: np.ndarray | None = None, mode: str = "training") -> pd.DataFrame:
    """The ``noise.csv`` table: the ``whole model`` rows, then a row per tensor, head and source (``source`` empty = all)."""
    import pandas as pd

    d = design(np.asarray(n_samples), mixture, source_index, sources, mode)
    keys = sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    step = max(1, STACK_BYTES // max(1, 16 * d.n_samples.size ** 2))      # a unit's blocks: at most 2 N² floats

    seen: dict[tuple[str, int | None], Taken] = {}

    def taken(part: list[tuple[str, int | None]]) -> Iterator[GramResult]:
        for key in part:
            g = grams[key]
            seen[key] = Taken(int(getattr(g, "n_features", 0)), g.finite, bool(g.from_sketch))  # a key a thread
            yield g

    def slab(part: list[tuple[str, int | None]]) -> list[tuple[list[dict[str, Any]], dict]]:
        done = [r for at in range(0, len(part), step)            # each K read when taken, one at a time
                for r in noise_rows_many(taken(part[at:at + step]), d)]
        return [(rows, parts if key[1] is None else {}) for key, (rows, parts) in zip(part, done, strict=True)]
        # (a whole tensor's parts may serve the model's rows)

    done = dict(zip(keys, map_slabs(slab, keys), strict=True))
    rows = model_rows(grams, d, done, seen)
    for key in keys:
        rows += done[key][0]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table["head"] = table["head"].astype("Int64")
    table.attrs[N_FEATURES] = np.array([seen[k].n_features if (k := (r["tensor"], r["head"])) in seen else math.nan
                                        for r in rows], dtype=np.float64).tobytes().hex()
    return table


@dataclass(frozen=True)
class Taken:
    """What :func:`noise_table` saw of a unit's Gram result as it read it: its feature count, usable records and
    whether it came from a sketch (so the model's rows and the flags need not read it again)."""

    n_features: int
    finite: np.ndarray
    from_sketch: bool


N_FEATURES = "gradforensics.noise.n_features"
"""``table.attrs`` key of :func:`noise_table`'s tables: each row's Gram result's ``n_features`` (NaN: the model's
rows), float64 bytes in row order as a hex string (immutable: pandas' copies of ``attrs`` cost nothing; JSON: a
table written where pandas keeps its ``attrs`` still writes), read by the flags of the same pass instead of mapping
each Gram matrix again; a table without it (read back from a store) falls back to the Gram results."""


