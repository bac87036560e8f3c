"""When a conflict is a finding: judged against the run's own base rate of disagreeing sources.

Sources of different domains have negative mean-gradient cosines in a healthy mixture: each pushes the
shared output layer towards its own bytes and away from the others', and near a stationary point of the
mixed loss the source means must roughly cancel.  That is the base rate (docs/conflict.md, "A
healthy mixture").  A conflict becomes a finding (severity >= 0.5) only when the run shows one of

* **a pair that stands out** (``why = "pair"``, three or more sources): the two sources conflict with
  each other beyond what each shows with the other sources.  With ``r_x`` the mean cosine of
  source ``x`` to the sources outside the pair and ``c`` the pair's cosine,
  ``q = ramp(min(r_a, r_b) - c - max(0, -min(r_a, r_b)), 0.3)``: the pair's cosine must lie below
  both members' cosines with the rest by more than that base rate's own depth below zero
  (contradictory data, the same contexts continued differently by two sources, while each agrees
  with the rest).  A source that differs from *all* the others (a distant domain) is not this:
  it conflicts with every source alike;
* **a source whose own loss stalls or climbs while the others fall** (``why = "loss"``, two or more
  sources): per source, over the records where it is the majority of the batch, the early level
  (mean loss of its first tenth, at least 3 records) and the late one (its last third); its
  progress ``P = (early - late) / early``.  ``stall = clip(1 - 2 P / P_ref, 0, 1)`` with ``P_ref``
  the smallest progress of the *other* sources (1 when its loss does not fall at all, 0 at half the
  slowest other's progress), times the significance of the slowest other source's fall
  (``flagging.significance`` of its one-sided z, over the sources).  A source the model cannot
  learn (random targets) pulls against everything the others teach and its loss stays put;
* **a conflict that grew beyond the sources' own early gradients** (``why = "rise"``, two sources,
  where there are no others to judge a pair against): :func:`rise`, the last quarter's
  noise-corrected inner product ``-G_ab`` over the first quarter's ``sqrt(G_aa G_bb)``;
  ``q = ramp(rise - 1, 1)``.  A cosine that merely falls from its early level is not enough: in a
  clean mixture every pair's cosine falls as the shared part is learned (+0.8 to -0.7 on the
  mixture twin), while the gradients shrink, so the late inner product stays below the early scale.

``standing`` is the largest of these (for the loss, of the pair's two sources), and the severity is capped at
``CONTEXT + (1 - CONTEXT) × standing``: a conflict the run does not single out stays context, at most
:data:`CONTEXT` (< 0.5); below the cap it keeps its severity (significance × effect × energy weight).
The flag names the source that stands out (``evidence.named``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradforensics.analysis.toolkit import flagging as fl

__all__ = ["CONTEXT", "SourceLoss", "loss_stall", "pair_standout", "pair_standouts", "source_losses", "stand_out"]

CONTEXT = 0.45         # the largest severity of a conflict the run does not single out
PAIR_FULL = 0.3        # how far beyond the base rate a pair's cosine lies for a full stand-out
RISE_PARTS = 4         # stretches of the run: the rise compares the last with the first
RISE_FULL = 1.0        # a rise this far above 1 (the sources' early scale) stands out fully


@dataclass(frozen=True)
class SourceLoss:
    """One source's loss early and late in the run (records where it is the batch's majority)."""

    n: int
    early: float
    late: float
    z_fall: float                  # (early - late) / its standard error

    @property
    def progress(self) -> float:
        return (self.early - self.late) / abs(self.early) if self.early else math.nan


def source_losses(loss: np.ndarray, mixture: np.ndarray, min_records: int = 6) -> list[SourceLoss | None]:
    """Per source (columns of *mixture*): its early and late loss level, None with too few records."""
    loss = np.asarray(loss, dtype=np.float64)
    out: list[SourceLoss | None] = []
    for k in range(mixture.shape[1]):
        y = loss[(mixture[:, k] >= 0.5) & np.isfinite(loss)]
        if y.size < min_records:
            out.append(None)
            continue
        m, t = max(3, math.ceil(y.size / 10)), max(3, y.size // 3)
        e, la = y[:m], y[-t:]
        se = math.sqrt(np.var(e, ddof=1) / m + np.var(la, ddof=1) / t)
        diff = float(e.mean() - la.mean())
        z = diff / se if se > 0 else (math.inf if diff > 0 else -math.inf if diff < 0 else 0.0)
        out.append(SourceLoss(int(y.size), float(e.mean()), float(la.mean()), z))
    return out


def loss_stall(losses: list[SourceLoss | None]) -> np.ndarray:
    """Per source, in [0, 1]: its loss stalls or climbs while every other source's falls (module docstring)."""
    from scipy.special import ndtr

    S = len(losses)
    q = np.zeros(S)
    for s, ls in enumerate(losses):
        others = [o for k, o in enumerate(losses) if k != s and o is not None]
        if ls is None or not others or len(others) < S - 1:
            continue
        slowest = min(others, key=lambda o: o.progress)
        p_ref = slowest.progress
        if not (np.isfinite(p_ref) and p_ref > 0 and np.isfinite(ls.progress)):
            continue
        stall = float(np.clip(1.0 - 2.0 * ls.progress / p_ref, 0.0, 1.0))
        falls = fl.significance(float(ndtr(-slowest.z_fall)), S)
        q[s] = stall * falls
    return q


def pair_standout(C: np.ndarray, a: int, b: int) -> float:
    """In [0, 1]: sources *a*, *b* conflict beyond what each shows with the others (module docstring).

    *C*: the unit's S×S cosine matrix (NaN where a source is absent); 0 with no third source.
    ``pair_standouts(C, [a], [b])[0]``.
    """
    return float(pair_standouts(C, np.array([a]), np.array([b]))[0])


def pair_standouts(C: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`pair_standout` of every pair ``(a[i], b[i])`` of one unit at once (``a != b``).

    ``r_x`` is the mean of ``C[x, t]`` over the third sources ``t`` with ``C[a, t]`` and ``C[b, t]``
    finite: with ``F`` the finite mask (the diagonal left out), ``(C F ᵀ)[a, b] / (F Fᵀ)[a, b]``.
    """
    C = np.array(C, dtype=np.float64)
    np.fill_diagonal(C, np.nan)
    F = np.isfinite(C).astype(np.float64)
    C0 = np.where(F > 0, C, 0.0)
    count, sums = F @ F.T, C0 @ F.T
    n = count[a, b]
    c = C[a, b]
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.minimum(sums[a, b] / n, sums[b, a] / n)
        x = (r - c - np.maximum(0.0, -r)) / PAIR_FULL
    return np.where((n > 0) & np.isfinite(c) & np.isfinite(x), np.clip(np.nan_to_num(x), 0.0, 1.0), 0.0)


def rise(K: np.ndarray, mixture: np.ndarray, a: int, b: int, parts: int = RISE_PARTS) -> float:
    """How far the conflict of sources *a*, *b* grew over the run, against their own early gradients.

    The unit's records (rows of *K*, in time order) in *parts* consecutive stretches; in the first
    and the last, the noise-corrected Gram of the two sources' means (as the table's, on that
    stretch alone): ``-G_ab(last) / sqrt(G_aa(first) G_bb(first))``.  Above 1 the late conflict is
    larger than the sources' early mean gradients themselves; a clean pair whose cosine merely falls
    as the shared part is learned stays well below (the mixture twins: at most 0.52).  NaN when a
    stretch lacks either source or an early norm is not positive.
    """
    from gradforensics.analysis.toolkit import kspace as ks

    n = K.shape[0]
    seg = np.arange(n) * parts // max(n, 1)
    grams = []
    for g in (0, parts - 1):
        rows = np.flatnonzero((seg == g) & (mixture[:, [a, b]].sum(axis=1) > 0))
        sub = mixture[rows][:, [a, b]]
        if rows.size < 4 or not (sub.sum(axis=0) > 0).all():
            return math.nan
        fit = ks.fit_sources(sub)
        if not fit.rank_ok or fit.index.size != 2:
            return math.nan
        grams.append(ks.source_gram(K[np.ix_(rows, rows)], fit, debias=True))
    first, last = grams
    scale = float(first[0, 0]) * float(first[1, 1])
    return -float(last[0, 1]) / math.sqrt(scale) if scale > 0 and first[0, 0] > 0 else math.nan


def stand_out(table: Any, sources: tuple[str, ...], losses: list[SourceLoss | None]) -> None:
    """Add ``standing``, ``named`` and ``why`` to the conflict *table* and weigh its severity by them."""
    n = len(table)
    standing = np.zeros(n)
    named = np.full(n, None, dtype=object)
    why = np.full(n, None, dtype=object)
    if n:
        index = {s: i for i, s in enumerate(sources)}
        stall = loss_stall(losses)
        cos = table["cosine_debiased"].where(table["cosine_debiased"].notna(), table["cosine"]).to_numpy(float)
        ia = table["source_a"].map(index).to_numpy(dtype=np.int64)
        ib = table["source_b"].map(index).to_numpy(dtype=np.int64)
        rises = table["rise"].to_numpy(dtype=float)
        names = np.asarray(sources, dtype=object)
        for rows in table.groupby(["tensor", "head"], dropna=False, sort=False).indices.values():
            a, b = ia[rows], ib[rows]
            M = np.full((len(sources),) * 2, np.nan)
            M[a, b] = M[b, a] = cos[rows]
            two = int(np.isfinite(M).any(axis=0).sum()) == 2
            if two:                                 # no other sources to judge against: the rise instead
                x = rises[rows] - 1.0
                q = np.where(np.isfinite(x), np.clip(np.nan_to_num(x) / RISE_FULL, 0.0, 1.0), 0.0)     # fl.ramp
            else:
                q = pair_standouts(M, a, b)
            k = np.where(stall[a] >= stall[b], a, b)
            sk = stall[k]
            pair = (q >= sk) & (q > 0)              # the pair names itself
            loss = ~pair & (sk > 0)
            standing[rows] = np.where(pair, q, np.where(loss, sk, 0.0))
            none = np.full(rows.size, None, dtype=object)
            why[rows] = np.where(pair, "rise" if two else "pair", np.where(loss, "loss", none))
            named[rows] = np.where(loss, names[k], none)
    table["standing"] = standing
    table["named"] = named          # the object arrays as they are (the same dtype as their lists, not a copy more)
    table["why"] = why
    table["severity"] = np.minimum(table["severity"].to_numpy(dtype=float), CONTEXT + (1.0 - CONTEXT) * standing)
