"""Cross-rank consistency: the same batch replayed on every rank must give the same gradient.

In a store captured with every rank replaying the *same* batches (``torchrun ...
gradforensics capture --check-ranks``; the store's ``extra.replicated`` is true),
record ``i`` of every rank is the gradient of one batch at one checkpoint, so
the ranks' records must agree to floating-point tolerance.  A rank whose
gradients differ is computing something else: silent data corruption on one
device (a known cause of unexplained loss spikes in large runs; Dixit et al.
2021, Hochschild et al. 2021), a different library or kernel, or a
nondeterministic op.

The distance between records ``a`` and ``b`` of one batch is ``|g_a - g_b|``
relative to the larger norm, ``d_ab``, computed in float64 from the stored rows
themselves: through the Gram matrix (``sqrt(K_aa + K_bb - 2 K_ab)``) the
cancellation would leave only ``sqrt(eps)`` of resolution (about ``1e-3`` with
the pass's float32 products).  So this analysis reads each replayed batch's
records once more, one batch and one tensor at a time (a consistency store is
small: R ranks x a few batches).  The default tolerance ``rtol = 1e-5`` is far
above float32 rounding of one gradient (``1e-7``) and far below a flipped
mantissa bit in the upper half of a value.  For each replayed batch and each rank ``q`` the
rank's deviation is the median of ``d_qj`` over the other ranks ``j``: with three
or more ranks a single disagreeing rank deviates from all the others while they
agree among themselves, so the finding names it; with two ranks both deviate and
the finding says the two disagree.  From a sketch the same holds (the sketch of
a difference is the difference of the sketches; identical gradients give
identical sketches), with the sketch's relative error on the size of a
difference.

References
----------
Dixit, H. D. et al. (2021). Silent data corruptions at scale. arXiv:2102.11245.
Hochschild, P. H. et al. (2021). Cores that don't count. HotOS '21, 9-16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pandas as pd

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.contract.options import Options

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.store.reader import Store

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "RankConsistencyOptions", "compute", "consistency_table", "deviations",
           "flags", "plot", "readers", "relative_distances", "replay_groups", "severity", "store_units"]


NAME, KIND = "rankconsistency", "rank_disagreement"
COLUMNS = ("tensor", "head", "rank", "n_batches", "n_disagree", "max_rel_diff", "median_rel_diff", "first_record")


@dataclass(frozen=True)
class RankConsistencyOptions(Options):
    """``rtol``: the relative difference between two ranks' gradients of one batch above which they disagree.

    Nondeterministic kernels (atomic adds) make ranks differ by about ``1e-7``
    relative; raise it if your kernels differ more.
    """

    rtol: float = 1e-5

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"rtol": Interval(float, 0, 1, "neither")}


def replay_groups(ranks: np.ndarray) -> list[dict[int, int]]:
    """``[{rank: record}]``: the ``i``-th record of every rank, for each ``i`` (one replayed batch)."""
    by_rank = {int(q): np.flatnonzero(ranks == q) for q in np.unique(ranks)}
    n = max((len(v) for v in by_rank.values()), default=0)
    return [{q: int(v[i]) for q, v in by_rank.items() if i < len(v)} for i in range(n)]


def relative_distances(x: np.ndarray) -> np.ndarray:
    """``d[a, b] = |x_a - x_b| / max(|x_a|, |x_b|)`` between the rows of *x* (flattened), in float64."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    diff = np.sqrt(np.array([[np.sum((a - b) ** 2) for b in x] for a in x]))
    scale = np.maximum(np.maximum(norms[:, None], norms[None, :]), 1e-300)
    out: np.ndarray = diff / scale
    out[(norms[:, None] == 0) & (norms[None, :] == 0)] = 0.0     # two zero gradients agree
    return out


def deviations(read: Callable[[list[int]], np.ndarray],
               groups: list[dict[int, int]]) -> dict[int, list[tuple[float, int]]]:
    """Per rank: ``(deviation, record)`` for every replayed batch it took part in (with >= 2 ranks).

    ``read(records)`` gives those records' rows of one tensor (or head).
    """
    out: dict[int, list[tuple[float, int]]] = {}
    for grp in groups:
        if len(grp) < 2:
            continue
        qs, idx = list(grp), list(grp.values())
        x = read(idx)
        d = relative_distances(x)
        bad = ~np.isfinite(x.reshape(len(idx), -1)).all(axis=1)
        for a, q in enumerate(qs):
            dev = math.inf if bad[a] else float(np.median(np.delete(d[a], a)))
            out.setdefault(q, []).append((dev, idx[a]))
    return out


def consistency_table(readers: Mapping[tuple[str, int | None], Callable[[list[int]], np.ndarray]],
                      ranks: np.ndarray, rtol: float) -> pd.DataFrame:
    """One row per (tensor, head, rank): how often and how far the rank disagrees with the others."""
    groups = replay_groups(ranks)
    rows = []
    for (tensor, head), read in sorted(readers.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                          else kv[0][1])):
        for q, devs in sorted(deviations(read, groups).items()):
            vals = np.array([d for d, _ in devs])
            off = [rec for d, rec in devs if d > rtol]
            rows.append({"tensor": tensor, "head": head, "rank": q, "n_batches": len(devs), "n_disagree": len(off),
                         "max_rel_diff": float(vals.max()), "median_rel_diff": float(np.median(vals)),
                         "first_record": min(off) if off else -1})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def compute(ctx: Context) -> AnalysisResult:
    opt = ctx.options_for(NAME, RankConsistencyOptions)
    ranks = ctx.batches.get("rank")
    if not ctx.meta.extra.get("replicated") or ranks is None or len(np.unique(ranks)) < 2:
        return AnalysisResult(table=pd.DataFrame(columns=list(COLUMNS)))
    return AnalysisResult(table=consistency_table(readers(ctx), np.asarray(ranks), opt.rtol))


def store_units(store: Store) -> list[tuple[str, int | None]]:
    """Every (tensor, head) of *store*: each tensor whole, and each head of a head-split one.

    Read from the store, not from ``ctx.grams``: above ``N₀`` records (the
    long-history regime) the pass keeps no per-record Gram matrix, and this
    analysis re-reads the stored rows anyway.
    """
    out: list[tuple[str, int | None]] = []
    for tensor in store.tensors:
        info = store.grads[tensor] if tensor in store.grads else store.sketches[tensor]
        out.append((tensor, None))
        if info.split is not None:
            out += [(tensor, h) for h in range(int(info.shape[1]))]
    return out


def readers(ctx: Context) -> dict[tuple[str, int | None], Callable[[list[int]], np.ndarray]]:
    """For each (tensor, head) of the store, a reader of chosen records' rows (whole gradient, else sketch)."""
    store = ctx.require_store()
    out: dict[tuple[str, int | None], Callable[[list[int]], np.ndarray]] = {}
    for tensor, head in store_units(store):
        arr = store.grad(tensor) if tensor in store.grads else store.sketch(tensor)

        def read(idx: list[int], arr: Any = arr, head: int | None = head) -> np.ndarray:
            rows = np.stack([np.asarray(arr[i].compute()) for i in idx])
            return rows if head is None else rows[:, head]

        out[(tensor, head)] = read
    return out


def severity(max_rel: float, rtol: float) -> float:
    """0.6 just above the tolerance, 1.0 at 1000x it (or non-finite)."""
    if not math.isfinite(max_rel):
        return 1.0
    return float(np.clip(0.6 + 0.4 * math.log10(max(max_rel / rtol, 1.0)) / 3.0, 0.6, 1.0))


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per disagreeing rank, naming it and its worst tensor."""
    t = result.table
    if t.empty:
        return []
    rtol = ctx.options_for(NAME, RankConsistencyOptions).rtol
    world = int(t["rank"].nunique())
    out = []
    for q, rows in t[t["n_disagree"] > 0].groupby("rank"):
        worst = rows.loc[rows["max_rel_diff"].idxmax()]
        who = f"rank {q}" if world > 2 else f"rank {q} (one of two ranks: which one is wrong cannot be told)"
        evidence = {"rank": int(q), "max_rel_diff": float(worst["max_rel_diff"]),
                    "n_tensors": int(rows["tensor"].nunique()), "n_batches": int(rows["n_disagree"].max()),
                    "rtol": rtol, "world": world}
        first = int(rows["first_record"][rows["first_record"] >= 0].min())
        out.append(Flag(KIND, str(worst["tensor"]), None if pd.isna(worst["head"]) else int(worst["head"]), (),
                        severity(float(worst["max_rel_diff"]), rtol), (first, first), evidence,
                        f"{who}: gradients of the same replayed batch differ from the other ranks' by up to "
                        f"{float(worst['max_rel_diff']):.2g} (relative; tolerance {rtol:g}) in "
                        f"{evidence['n_tensors']} tensor(s)"))
    return out


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Largest relative difference to the other ranks, per rank, for the flagged tensor."""
    t = result.table
    rows = t[(t["tensor"] == flag.tensor)].groupby("rank")["max_rel_diff"].max()
    vals = np.maximum(rows.to_numpy(dtype=float), 1e-12)
    colors = ["tab:red" if int(q) == flag.evidence.get("rank") else "tab:blue" for q in rows.index]
    ax.bar([str(q) for q in rows.index], vals, color=colors)
    ax.set_yscale("log")
    ax.axhline(float(flag.evidence.get("rtol", 1e-4)), color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("rank")
    ax.set_ylabel("max relative difference")
    ax.set_title(f"Same batch, every rank: {flag.tensor}", fontsize=9)


ADVICE = Advice(
    title="Ranks disagree on the same batch",
    phrase="computes a different gradient for the same batch than the other ranks",
    evidence_keys={"rank": "rank", "max_rel_diff": "largest relative difference", "n_tensors": "tensors"},
    remedies=(
        "Re-run the check with the ranks on other devices or nodes: a difference that follows the device is a "
        "hardware fault (silent data corruption); drain that device and run the vendor's diagnostics.",
        "A difference on every device of one node points to its software: compare driver, library and kernel "
        "versions with the other nodes.",
        "A small difference on every rank is nondeterminism: enable deterministic algorithms and compare again.",
    ),
    references=("Dixit et al. 2021", "Hochschild et al. 2021"),
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={KIND: ADVICE}, options=RankConsistencyOptions, long_history=True)
