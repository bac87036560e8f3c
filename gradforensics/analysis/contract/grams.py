"""The Gram matrices an analysis reads, and the reductions it folds into the Gram pass.

Contract types (the pass builds them, analyses read them): :class:`GramResult` (the
N×N Gram matrix of one tensor or head), :class:`SlabReduction` (a per-slab
reduction an analysis declares, run inside the pass's one read of each slab), and
the long-history regime's :class:`Design`, :class:`LongGram`, :class:`WindowMoments` and
:class:`LongHistory` (band-test window moments and window-source sums instead of N×N; how they
are computed: :mod:`gradforensics.analysis.engine.longhistory`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Design", "GramResult", "LongGram", "LongHistory", "SlabReduction", "WindowMoments"]


@dataclass(frozen=True)
class GramResult:
    """The Gram matrix of one tensor (or one head) over all records.

    ``gram[i, j] = <g_i, g_j>`` in float64, with records holding any non-finite
    value zeroed out (their rows/columns are 0); ``nonfinite[i]`` counts the
    non-finite elements of record *i*.  ``from_sketch``: computed from the
    stored sketch (inner products are then estimates).
    """

    tensor: str
    head: int | None
    gram: np.ndarray
    nonfinite: np.ndarray
    n_features: int
    from_sketch: bool = False

    @property
    def finite(self) -> np.ndarray:
        """Boolean mask of the records usable for direction statistics."""
        return self.nonfinite == 0


@dataclass(frozen=True)
class SlabReduction:
    """A per-slab reduction of one stored gradient, folded into the Gram pass's read.

    The engine reads each slab of ``grads/<tensor>`` once; in the same task that
    takes the slab's Gram product it calls ``chunk(x, sel)`` of every reduction of
    that tensor, where ``x`` is the slab as read (float32, shape ``(n, ...)``: the
    records of the slab by the features of the slab, head axis included for a
    head-split array) and ``sel`` the slab's place in the array (a tuple of slices,
    record axis first).  Partial results meet in the Gram combine tree
    (``combine(list_of_partials)``), and ``aggregate(partial)`` finishes them in
    one task.  ``finish``, if given, receives the aggregated value as a
    :class:`dask.delayed.Delayed` and returns the dask collection whose value
    lands in ``ctx.computed[analysis][key]`` (e.g. one SVD task per window mean, or
    tasks that also read weight snapshots); by default the aggregate itself.

    ``chunk`` is called once per slab, or once per record block when the record
    axis is split (huge records; ``sel[0]`` then covers part of the records).
    :mod:`gradforensics.analysis.toolkit.slabs` (``feature_blocks``,
    ``merge_feature_blocks``, ``assemble_feature_blocks``) covers the usual case of a
    per-feature result.
    """

    tensor: str
    chunk: Callable[[np.ndarray, tuple[slice, ...]], Any]
    combine: Callable[[list[Any]], Any]
    aggregate: Callable[[Any], Any] | None = None
    finish: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Design:
    """Which records make each super-record, and the super-records' batch metadata.

    Super-record ``r = w · S + s`` is the weighted sum of window *w*'s records
    with weights ``A[:, s]`` (the mixture share of source *s*).
    """

    n: int
    edges: np.ndarray          # (n_w + 1,) record boundaries of the windows
    mixture: np.ndarray        # (N, S) float64, the weights
    band: int

    @property
    def n_sources(self) -> int:
        return int(self.mixture.shape[1])

    @property
    def n_windows(self) -> int:
        return int(self.edges.size - 1)

    @property
    def m(self) -> int:
        return self.n_windows * self.n_sources

    @property
    def window_size(self) -> int:
        return int(self.edges[1] - self.edges[0]) if self.edges.size > 1 else 0

    def weights(self, finite: np.ndarray | None = None) -> np.ndarray:
        """``c_r = Σ_{i∈w} A_is`` over the (finite) records of each super-record."""
        a = self.mixture if finite is None else self.mixture * np.asarray(finite, dtype=np.float64)[:, None]
        return np.add.reduceat(a, self.edges[:-1], axis=0).reshape(-1) if self.n else np.zeros(0)

    def super_gram(self, sums: np.ndarray, finite: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The kept super-records' Gram matrix from the window-source sums' ``Y Yᵀ``, and which have no weight.

        ``K_rs = (Y Yᵀ)_rs / (c_r c_s)`` over the super-records holding any weight
        (``c`` over the *finite* records; all when None); a super-record with no
        finite record is 0 and flagged 1.  Read-only.
        """
        w = self.weights()
        keep = np.flatnonzero(w > 0)
        c = (w if finite is None else self.weights(finite))[keep]
        ok = c > 0
        cs = np.where(ok, c, 1.0)
        K = np.asarray(sums, dtype=np.float64)[np.ix_(keep, keep)] / np.outer(cs, cs)
        K[~ok, :] = 0.0
        K[:, ~ok] = 0.0
        K.flags.writeable = False
        return K, (~ok).astype(np.int64)


@dataclass(frozen=True)
class WindowMoments:
    """What the band test and the consecutive cosines need of one unit, per window of the band test.

    Per window *w* (``oscillation_edges``) over the records whose lags ``0..band`` are
    all finite: ``count[w]``, the mean ``mean[w, k]`` and the centred sum of squares
    ``m2[w, k]`` of ``z_i = h_P · B[1:, i]`` for each period ``P = k + 2``, and
    ``e0[w] = Σ B[0, i]``; over the records whose lag-1 cosine is defined:
    ``cc_sum[w]`` and ``cc_n[w]``.  Partial moments of disjoint record sets combine
    with ``+`` (Chan, Golub & LeVeque 1979's pairwise update; a window seen by one
    part only is taken as is), so a window split between record blocks is exact to
    rounding.  Immutable: ``+`` returns a new object.
    """

    count: np.ndarray       # (n_w,) float64
    mean: np.ndarray        # (n_w, P)
    m2: np.ndarray          # (n_w, P)
    e0: np.ndarray          # (n_w,)
    cc_sum: np.ndarray      # (n_w,)
    cc_n: np.ndarray        # (n_w,)

    @classmethod
    def zeros(cls, n_windows: int, n_periods: int) -> WindowMoments:
        z = np.zeros(n_windows)
        return cls(z, np.zeros((n_windows, n_periods)), np.zeros((n_windows, n_periods)), z, z, z)

    def __add__(self, other: WindowMoments) -> WindowMoments:
        na, nb = self.count[:, None], other.count[:, None]
        n = na + nb
        with np.errstate(invalid="ignore", divide="ignore"):
            delta = other.mean - self.mean
            mean = self.mean + delta * (nb / n)
            m2 = self.m2 + other.m2 + delta * delta * (na * nb / n)
        mean = np.where(na == 0, other.mean, np.where(nb == 0, self.mean, mean))
        m2 = np.where(na == 0, other.m2, np.where(nb == 0, self.m2, m2))
        return WindowMoments(self.count + other.count, mean, m2, self.e0 + other.e0,
                             self.cc_sum + other.cc_sum, self.cc_n + other.cc_n)

    def copy(self) -> WindowMoments:
        return self

    def consecutive_cosine(self) -> float:
        """Mean lag-1 cosine over every record where it is defined (NaN if none)."""
        n = float(self.cc_n.sum())
        return float(self.cc_sum.sum()) / n if n > 0 else float("nan")

    def window_cosines(self) -> np.ndarray:
        """Mean lag-1 cosine per window (NaN where none is defined)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.cc_n > 0, self.cc_sum / np.where(self.cc_n > 0, self.cc_n, 1.0), np.nan)


@dataclass(frozen=True)
class LongGram:
    """What the long-history pass keeps of one tensor (or head): no N×N matrix, nothing of size N per head.

    ``super_gram``: the Gram matrix of the kept super-records (the window-source sums
    ``Y Yᵀ`` divided by their finite weights, :meth:`Design.super_gram`; read-only, shared
    by every reader), or None when the pass spilled it to the file ``super_path`` (raw float64)
    (:mod:`~gradforensics.analysis.engine.spill`): read it with :meth:`super_matrix`;
    ``super_bad`` (1 where a super-record has no finite record);
    ``moments``: the band
    test's window statistics (:class:`WindowMoments`); ``bad`` / ``bad_counts``: the
    records holding non-finite values (sorted) and their counts (every other record
    has none); ``norms``: the per-record squared norms ``K_ii`` of a whole tensor (the
    gradient-norm series; None for a head).
    """

    tensor: str
    head: int | None
    super_gram: np.ndarray | None
    super_bad: np.ndarray
    moments: WindowMoments
    n_records: int
    bad: np.ndarray
    bad_counts: np.ndarray
    n_features: int
    from_sketch: bool = False
    norms: np.ndarray | None = None
    super_path: str | None = None

    def super_matrix(self) -> np.ndarray:
        """The super-records' Gram matrix: the one held, or its spill file memory-mapped read-only (each call)."""
        if self.super_gram is not None:
            return self.super_gram
        if self.super_path is None:
            raise ValueError(f"{self.tensor}: a LongGram holds neither its super-record Gram matrix nor its file.")
        n = int(self.super_bad.size)
        if n == 0:
            return np.zeros((0, 0))
        return np.memmap(self.super_path, dtype=np.float64, mode="r", shape=(n, n))

    @property
    def nonfinite(self) -> np.ndarray:
        """Per-record non-finite counts (built on demand: ``n_records`` int64)."""
        out = np.zeros(self.n_records, dtype=np.int64)
        out[self.bad] = self.bad_counts
        return out

    @property
    def finite(self) -> np.ndarray:
        out = np.ones(self.n_records, dtype=bool)
        out[self.bad] = False
        return out

    def norms2(self) -> np.ndarray | None:
        """Per-record squared norms ``K_ii`` of a whole tensor (NaN for non-finite records); None for a head."""
        if self.norms is None:
            return None
        return np.where(self.finite, self.norms, np.nan)


class _SuperGrams(Mapping[tuple[str, int | None], GramResult]):
    """``{(tensor, head): GramResult}`` of the super-records, each built when taken (a spilled matrix read then)."""

    def __init__(self, grams: dict[tuple[str, int | None], LongGram]) -> None:
        self._grams = grams

    def __getitem__(self, key: tuple[str, int | None]) -> GramResult:
        g = self._grams[key]
        return GramResult(g.tensor, g.head, g.super_matrix(), g.super_bad, g.n_features, g.from_sketch)

    def __contains__(self, key: object) -> bool:
        return key in self._grams

    def __iter__(self) -> Iterator[tuple[str, int | None]]:
        return iter(self._grams)

    def __len__(self) -> int:
        return len(self._grams)


class _RecordGrams(Mapping[tuple[str, int | None], GramResult]):
    def __init__(self, grams: dict[tuple[str, int | None], LongGram]) -> None:
        self._grams = grams

    def __getitem__(self, key: tuple[str, int | None]) -> GramResult:
        g = self._grams[key]
        return GramResult(g.tensor, g.head, np.zeros((0, 0)), g.nonfinite, g.n_features, g.from_sketch)

    def __iter__(self) -> Iterator[tuple[str, int | None]]:
        return iter(self._grams)

    def __len__(self) -> int:
        return len(self._grams)


@dataclass(frozen=True)
class LongHistory:
    """The long-history regime of a pass: the design and one :class:`LongGram` per tensor and head."""

    design: Design
    grams: dict[tuple[str, int | None], LongGram]
    n0: int

    def header(self) -> dict[str, Any]:
        """The ``regime`` fields of the findings header."""
        return {"name": "long-history", "n0": int(self.n0), "window": self.design.window_size,
                "windows": self.design.n_windows, "band": self.design.band}

    def record_grams(self) -> Mapping[tuple[str, int | None], GramResult]:
        """Per-record results without K (``gram`` is 0×0): non-finite counts and sizes only.

        A read-only mapping that builds each unit's ``N`` counts when it is looked up
        (one unit at a time in memory, not units × records).
        """
        return _RecordGrams(self.grams)

    # ------------------------------------------------------------ super-records
    def kept(self) -> np.ndarray:
        """Super-records holding any weight (a source present in that window)."""
        return np.flatnonzero(self.design.weights() > 0)

    def first_record(self) -> np.ndarray:
        """First record of each kept super-record's window."""
        return self.design.edges[:-1][self.kept() // self.design.n_sources]

    def last_record(self) -> np.ndarray:
        return self.design.edges[1:][self.kept() // self.design.n_sources] - 1

    def super_batches(self, batches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``batches/*`` of the kept super-records: mixture, n_samples, step (window means), loss."""
        d, keep = self.design, self.kept()
        S = d.n_sources
        c = d.weights()
        b = np.asarray(batches.get("n_samples", np.ones(d.n)), dtype=np.float64)
        inv = np.where(b > 0, 1.0 / np.where(b > 0, b, 1.0), 0.0)
        sq = np.add.reduceat(d.mixture ** 2 * inv[:, None], d.edges[:-1], axis=0).reshape(-1)
        eff = np.where(sq > 0, c ** 2 / np.where(sq > 0, sq, 1.0), 0.0)
        mix = np.zeros((d.m, S))
        mix[np.arange(d.m), np.arange(d.m) % S] = 1.0      # pure per source for pure batches
        if not np.all(np.isclose(d.mixture.max(axis=1), 1.0)):
            # mixed batches: the super-record's mixture is its weighted mean of mixture rows
            for s in range(S):
                w = np.add.reduceat(d.mixture * d.mixture[:, [s]], d.edges[:-1], axis=0)
                rows = np.arange(d.n_windows) * S + s
                mix[rows] = np.where(c[rows, None] > 0, w / np.where(c[rows, None] > 0, c[rows, None], 1.0), 0.0)
        step = np.asarray(batches.get("step", np.arange(d.n)), dtype=np.float64)
        mean_step = np.add.reduceat(step, d.edges[:-1]) / np.diff(d.edges)
        out = {"mixture": mix[keep], "n_samples": np.round(eff[keep]).astype(np.int64),
               "step": np.repeat(mean_step, S)[keep]}
        loss = batches.get("loss")
        if loss is not None:
            out["loss"] = np.repeat(np.add.reduceat(np.asarray(loss, dtype=np.float64), d.edges[:-1])
                                    / np.diff(d.edges), S)[keep]
        return out

    def super_grams(self) -> Mapping[tuple[str, int | None], GramResult]:
        """Gram matrices of the kept super-records (per-window, per-source mean gradients): the pass's, not copies.

        A read-only mapping that builds each unit's :class:`GramResult` when it is
        looked up: a spilled pass reads that unit's matrix from disk then (memory-mapped),
        so the readers hold the units in hand, not all of them.
        """
        return _SuperGrams(self.grams)
