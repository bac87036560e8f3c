"""One unit's conflict test: per-source mean gradients, their cosines, the permutation p-value.

The statistics of :mod:`gradforensics.analysis.kinds.conflict` (its docstring gives the
formulas and references) for one unit's Gram matrix ``K`` and mixture rows: the design the
units with the same records share (:func:`source_design`), the pairs' cosines, debiased
cosines and sequential permutation p-values (:func:`conflict_units`, the units of one design at
once, each seeded by :func:`unit_seed`; :func:`conflict_unit`, one unit's rows), the replay cross-block test (:func:`cross_inner_z`), the p-value a
severity uses (:func:`severity_p`) and where in a long history a pair points apart
(:func:`segment_span`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.checks import Constraints, Interval, StrOptions
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.kinds.conflict.permtest import PairNulls
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit.stats import sequential_permutation_test

__all__ = ["EFFECT_FULL", "PAIR_COLUMNS", "ConflictOptions", "SourceDesign", "conflict_unit", "conflict_units",
           "cross_inner_z", "effect", "segment_span", "severity_p", "source_design", "unit_seed"]

EFFECT_FULL = 0.3      # -cosine at which the effect score saturates


@dataclass(frozen=True)
class ConflictOptions(Options):
    """``permutations`` (B), ``seed``, ``block``: records per permutation block in training mode
    (default ``max(4, ceil(N/16))``; replay permutes over all records), and ``hits``: the ``h`` of the
    sequential test (a pair stops drawing once ``h`` permuted statistics reach the observed one;
    None: every pair draws all ``B``), ``table_rows``: the table's rows kept at most beyond the
    flagged ones and one a unit (:func:`~gradforensics.analysis.kinds.conflict.keep_rows`; None: every
    row, a row per unit and source pair), and ``streams``: ``"unit"`` (each tensor and head draws its own
    permutations) or ``"tensor"`` (a tensor's heads share the tensor's: drawn and sorted once, about a
    third less CPU where every unit runs all ``B``; :func:`unit_seed`)."""

    permutations: int = 999
    seed: int = 0
    block: int | None = None
    hits: int | None = 10
    table_rows: int | None = 100_000
    streams: str = "unit"

    analysis_name = "conflict"
    constraints: ClassVar[Constraints] = {"permutations": Interval(int, 19, None), "seed": Interval(int, 0, None),
                   "block": [Interval(int, 2, None), None], "hits": [Interval(int, 1, None), None],
                   "table_rows": [Interval(int, 0, None), None], "streams": StrOptions({"unit", "tensor"})}


def unit_seed(seed: int, tensor: str, head: int | None, streams: str = "unit") -> tuple[int, int, int]:
    """The permutation seed of one unit, stable across runs and platforms (crc32 of the name):
    ``(seed, crc32(tensor), head + 1)`` (0 for the whole tensor); with *streams* ``"tensor"`` the tensor's,
    ``(seed, crc32(tensor), 0)``, for its heads too.  Either way each unit's test is a valid permutation
    test of its own (its p-value's distribution under the null does not depend on which permutations
    other units drew); sharing makes a tensor's heads' Monte-Carlo errors dependent, and lets them draw,
    sort and gather each round's permutations once (docs/conflict.md)."""
    if streams not in ("unit", "tensor"):
        raise ValueError(f"streams must be 'unit' or 'tensor'; got {streams!r}")
    return (int(seed), zlib.crc32(tensor.encode()), 0 if head is None or streams == "tensor" else int(head) + 1)


@dataclass(frozen=True)
class SourceDesign:
    """What the test of a unit needs from its mixture rows alone: the units with the same records share it.

    ``fit`` (:func:`~gradforensics.analysis.toolkit.kspace.fit_sources`), ``Q = (AᵀA)⁺``, the
    permutation ``block`` (None: over all records), and ``testable``: two or more sources of full
    rank and enough records.  A head-split tensor's heads (and usually every unit of a store) have
    the same finite records, so :func:`compute` builds one design per distinct record set.
    """

    fit: ks.SourceFit
    Q: np.ndarray | None
    block: int | None
    testable: bool


def source_design(mixture: np.ndarray, opts: ConflictOptions, training: bool) -> SourceDesign:
    """The :class:`SourceDesign` of these mixture rows (in the units' record order)."""
    n = mixture.shape[0]
    fit = ks.fit_sources(mixture)
    if fit.index.size < 2 or not fit.rank_ok or n < fit.index.size + 2:
        return SourceDesign(fit, None, None, False)
    block = (opts.block or ks.window_size(n)) if training else None
    return SourceDesign(fit, np.linalg.pinv(fit.A.T @ fit.A), block, True)


PAIR_COLUMNS = ("a", "b", "cosine", "p_value", "cosine_debiased", "z", "z_cross", "n_a", "n_b", "draws")
"""The columns :func:`conflict_units` gives per unit, a value per source pair (``a``, ``b``: store source indices)."""


def conflict_unit(K: np.ndarray, mixture: np.ndarray, opts: ConflictOptions, training: bool,
                  seed: int | tuple[int, ...] | None = None, design: SourceDesign | None = None,
                  ) -> tuple[list[dict[str, Any]], np.ndarray | None, np.ndarray]:
    """Per-pair rows (store source indices ``a``, ``b``), the S'×S' cosine matrix, kept source indices.

    One unit of :func:`conflict_units`, its pairs as a list of dicts.  *design*: :func:`source_design`
    of *mixture* when the caller shares it between units (the same numbers as building it here).
    """
    d = source_design(mixture, opts, training) if design is None else design
    cols, cos, idx = conflict_units([K], mixture, opts, training, [opts.seed if seed is None else seed], d)[0]
    rows = [dict(zip(PAIR_COLUMNS, vals, strict=True)) for vals in zip(*(cols[c].tolist() for c in PAIR_COLUMNS))]
    return rows, cos, idx


def conflict_units(grams: list[np.ndarray], mixture: np.ndarray, opts: ConflictOptions, training: bool,
                   seeds: list[int | tuple[int, ...]], design: SourceDesign,
                   ) -> list[tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]]:
    """Per unit (Gram matrices *grams* over the records of *mixture*, one *design*): its pairs' columns
    (:data:`PAIR_COLUMNS`, arrays), its S'×S' cosine matrix (None when untestable), its kept source indices.

    The pairs of all the units are tested together by
    :func:`~gradforensics.analysis.toolkit.stats.sequential_permutation_test`; unit ``u`` draws from
    ``permutations(n, B, seeds[u], design.block)``'s stream (:class:`PairNulls`; consecutive units with one
    seed, a tensor and its heads, share it) while one of their pairs still runs.  Memory: the Gram matrices, ``S'²`` per unit and a round of draws (bounded).
    """
    fit = design.fit
    if not design.testable or design.Q is None:
        return [(_empty_pairs(), None, fit.index) for _ in grams]
    S = fit.index.size
    iu, ju = np.triu_indices(S, 1)
    P = iu.size
    cos_l, cosdb_l, obs, ties = [], [], [], []
    for K in grams:
        G, G_db = ks.source_grams(K, fit)
        cos, cos_db = ks.gram_to_cos(G), ks.gram_to_cos(G_db)
        cos_l.append(cos)
        cosdb_l.append(cos_db)
        # the statistic is the inner product <M_a, M_b>, not the cosine: for two sources pointing
        # nearly opposite ways almost every relabelling also gives a cosine near -1 (the relabelled
        # groups' means are +-(k-m)/(k+m) of one direction), so the cosine's permutation null is
        # bimodal and has no power exactly where the conflict is strongest; the inner product
        # shrinks towards the shared mean under relabelling
        obs.append(np.where(np.isfinite(cos[iu, ju]), G[iu, ju], np.nan))
        ties.append(np.full(P, 1e-12 * float(np.abs(np.diagonal(G)).max(initial=0.0))))
    ip0 = np.concatenate(obs)
    nulls = PairNulls(grams, seeds, fit.A, design.Q, design.block, iu, ju)
    null = sequential_permutation_test(ip0, nulls, np.repeat(nulls.groups, P), opts.permutations, opts.hits,
                                       tie=np.concatenate(ties))
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(null.sd > 0, (null.mean - ip0) / null.sd, np.nan)
    a, b = fit.index[iu].astype(np.int64), fit.index[ju].astype(np.int64)
    pure = None if training else _pure_labels(mixture)
    out: list[tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]] = []
    for u, K in enumerate(grams):
        sl = slice(u * P, (u + 1) * P)
        # independent batches (replay): an asymptotic test that resolves beyond 1/(B+1)
        zx = (np.full(P, np.nan) if pure is None else
              np.array([_cross_z(K, pure, int(x), int(y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]))
        cols = {"a": a, "b": b, "cosine": cos_l[u][iu, ju], "p_value": null.p[sl], "cosine_debiased": cosdb_l[u][iu, ju],
                "z": z[sl], "z_cross": zx, "n_a": fit.weight[iu].astype(np.float64),
                "n_b": fit.weight[ju].astype(np.float64), "draws": null.draws[sl]}
        out.append((cols, cos_l[u], fit.index))
    return out


def _empty_pairs() -> dict[str, np.ndarray]:
    return {c: np.empty(0, dtype=np.int64 if c in ("a", "b", "draws") else np.float64) for c in PAIR_COLUMNS}


def _pure_labels(mixture: np.ndarray) -> np.ndarray:
    """Each record's source where its batch is pure, else -1 (:func:`cross_inner_z`)."""
    return np.where(np.isclose(mixture.max(axis=1), 1.0), mixture.argmax(axis=1), -1)


def cross_inner_z(K: np.ndarray, mixture: np.ndarray, a: int, b: int) -> float:
    """z of the test that sources *a* and *b* have mean gradients with a negative inner product.

    ``T = mean_{i in a, j in b} K_ij`` is an unbiased estimate of ``<G_a, G_b>`` from
    independent pure batches (no diagonal term, so no noise bias); its variance is the
    two-sample U-statistic one, ``Var(r_i / n_b) / n_a + Var(c_j / n_a) / n_b`` with
    ``r_i`` (``c_j``) the row (column) sums of the cross block.  Returns ``-T / se``:
    large when the sources point opposite ways.  Used in replay mode, where batches are
    independent, to extend the permutation p-value below its floor ``1/(B+1)``;
    NaN with fewer than 3 pure batches per source.
    """
    return _cross_z(K, _pure_labels(mixture), a, b)


def _cross_z(K: np.ndarray, pure: np.ndarray, a: int, b: int) -> float:
    """:func:`cross_inner_z` from the records' pure-batch sources *pure* (:func:`_pure_labels`)."""
    ia, ib = np.flatnonzero(pure == a), np.flatnonzero(pure == b)
    if ia.size < 3 or ib.size < 3:
        return math.nan
    C = ks.block(K, ia, ib)
    t = float(C.mean())
    var = np.var(C.mean(axis=1), ddof=1) / ia.size + np.var(C.mean(axis=0), ddof=1) / ib.size
    return -t / math.sqrt(var) if var > 0 else math.nan


def severity_p(p: float, z: float, B: int, z_cross: float = math.nan) -> float:
    """The p-value a severity uses: the permutation p, extrapolated at its floor ``1/(B+1)``.

    At the floor, the smaller of the normal tail of ``z`` (the observed inner product's
    distance from the permutation null, in null standard deviations) and, in replay mode, of
    ``z_cross`` (:func:`cross_inner_z`).  The normal extrapolation of the permutation
    null alone under-rates the strongest conflicts: when sources differ a lot, the
    permuted groups' cosines spread widely and ``z`` stays small (cos -0.92 scored 0.44).
    """
    from scipy.special import ndtr  # ndtr(-x): the standard normal upper tail, norm.sf(x)

    if np.isfinite(p) and p <= 1.0 / (B + 1) + 1e-12:
        tails = [ndtr(-x) for x in (z, z_cross) if np.isfinite(x)]
        return float(min([p, *tails]))
    return p


def effect(cos_db: float, cos: float) -> float:
    c = cos_db if np.isfinite(cos_db) else cos
    return fl.ramp(-c, EFFECT_FULL)


def segment_span(K: np.ndarray, mixture: np.ndarray, segment: np.ndarray, a: int, b: int) -> tuple[int, int] | None:
    """The contiguous segments around the most conflicted one where sources *a*, *b* point apart.

    Per segment (rows of *K* labelled by *segment*), the noise-corrected cosine of the
    two sources' least-squares means; the stretch is the run of segments with a
    negative cosine around the most negative.  None when no segment has one.
    """
    labels = np.unique(segment)
    cos = np.full(labels.size, np.nan)
    for k, lab in enumerate(labels):
        rows = np.flatnonzero(segment == lab)
        sub = mixture[rows][:, [a, b]]
        if (sub.sum(axis=0) > 0).all() and rows.size >= 4:
            fit = ks.fit_sources(sub)
            if fit.rank_ok and fit.index.size == 2:
                G = ks.source_gram(K[np.ix_(rows, rows)], fit, debias=True)
                cos[k] = ks.gram_to_cos(G)[0, 1]
    if not (np.nan_to_num(cos, nan=1.0) < 0).any():
        return None
    best = int(np.nanargmin(cos))
    neg = np.nan_to_num(cos, nan=1.0) < 0
    lo = hi = best
    while lo > 0 and neg[lo - 1]:
        lo -= 1
    while hi < labels.size - 1 and neg[hi + 1]:
        hi += 1
    return int(labels[lo]), int(labels[hi])

