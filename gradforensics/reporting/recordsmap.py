"""The records map: every record of one tensor (head) placed in 2-D by its gradient's direction.

For the top direction finding (a kind whose ``Advice.records_map`` says how to read
the map: conflict, oscillation, drift) the report draws the records of its tensor (or
head) as points: two records are close when their
gradients point the same way.  The coordinates are the classical multidimensional
scaling (Torgerson 1952; Gower 1966) of the cosine distances read from the Gram
matrix ``K`` the analysis saved (``K_ij = <g_i, g_j>``, no gradient is read):

* ``cos_ij = K_ij / sqrt(K_ii K_jj)`` and ``d_ij² = 2 - 2 cos_ij`` (the chord between
  the unit vectors ``g_i/|g_i|``), so the double-centred matrix ``B = -½ J D² J = J C J``
  is the Gram matrix of the centred unit vectors, and its two leading eigenpairs
  ``(λ, v)`` give the coordinates ``v sqrt(λ)``: exactly the first two principal
  components of the normalised gradients.  ``explained = (λ₁ + λ₂) / Σ λ⁺`` is the
  share of their spread the map shows.

Two panels: coloured by data source (two sources pulling a layer apart show as two
clouds) and by optimizer step, successive records joined (a run flipping between two
poles shows as a zig-zag between two clouds; a drift as a path walking away).

The map is omitted, with one line saying why, when the Gram matrices were not saved
(``analyze`` ran with ``persist`` off), when the long-history regime stored no
per-record ``K``, when the store is not at hand, or when fewer than 3 records have a
usable gradient.  Above :data:`MAX_POINTS` records an evenly spaced subset is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gradforensics._text import visible
from gradforensics.analysis.contract.model import regime_of
from gradforensics.analysis.contract.registry import advice_of, records_map_kinds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from gradforensics.analysis.contract.model import Findings, Flag
    from gradforensics.store.reader import Store

#: At most this many records are placed (an O(N³) eigen-decomposition); more are subsampled evenly.
MAX_POINTS = 2000
MIXED = "mixed"


@dataclass(frozen=True)
class RecordsMap:
    """Coordinates of the records of one unit, and what colours them."""

    tensor: str
    head: int | None
    kind: str
    xy: np.ndarray            # (m, 2)
    records: np.ndarray       # (m,) record indices into the store
    source: list[str]         # (m,) the record's source, or MIXED
    step: np.ndarray          # (m,) optimizer step (or record index when all steps are equal)
    step_label: str           # "optimizer step" or "record"
    explained: float          # share of the normalised gradients' spread on the two axes
    n_records: int            # records in the store (before subsampling)
    unit_word: str = "head"   # what ``head`` counts: "expert" on a mixture-of-experts unit

    def where(self, sep: str = " ") -> str:
        """``tensor``, ``tensor head h`` or ``tensor expert e`` (*sep* before the head's word)."""
        return self.tensor + ("" if self.head is None else f"{sep}{self.unit_word} {self.head}")


def classical_mds(d2: np.ndarray, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Classical MDS of squared distances *d2* (n, n): ``(coordinates (n, k), eigenvalues of B, descending)``.

    Exact for Euclidean distances: the coordinates reproduce every distance of points
    that span at most *k* dimensions.  Axes are signed so that each one's largest
    absolute coordinate is positive (deterministic output).
    """
    d2 = np.asarray(d2, dtype=np.float64)
    n = d2.shape[0]
    if d2.shape != (n, n):
        raise ValueError(f"classical_mds needs a square matrix of squared distances; got shape {d2.shape}.")
    j = np.eye(n) - 1.0 / n
    b = -0.5 * j @ d2 @ j
    b = (b + b.T) / 2
    w, v = np.linalg.eigh(b)
    order = np.argsort(w)[::-1]
    w, v = w[order], v[:, order]
    xy = np.zeros((n, k))
    m = min(k, n)
    xy[:, :m] = v[:, :m] * np.sqrt(np.clip(w[:m], 0.0, None))
    for a in range(m):
        col = xy[:, a]
        if col.size and col[np.argmax(np.abs(col))] < 0:
            xy[:, a] = -col
    return xy, w


def cosine_map(k: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Records placed by the cosine distances of Gram matrix *k*: ``(xy (m, 2), kept record indices, explained)``.

    Records whose gradient is zero or not finite (a zero row in ``K``) are left out.
    """
    k = np.asarray(k, dtype=np.float64)
    diag = np.diag(k).copy()
    keep = np.flatnonzero(np.isfinite(diag) & (diag > 0) & np.all(np.isfinite(k), axis=1))
    if keep.size < 3:
        return np.zeros((keep.size, 2)), keep, math.nan
    norms = np.sqrt(diag[keep])
    cos = np.clip(k[np.ix_(keep, keep)] / np.outer(norms, norms), -1.0, 1.0)
    xy, w = classical_mds(2.0 - 2.0 * cos, 2)
    pos = w[w > 0]
    explained = float(np.sum(np.clip(w[:2], 0, None)) / np.sum(pos)) if pos.size else math.nan
    return xy, keep, explained


def pick(findings: Findings) -> Flag | None:
    """The most severe flag of a direction kind (the unit the map is drawn for), or None.

    The direction kinds are those whose ``Advice.records_map`` is non-empty (:func:`records_map_kinds`).
    """
    kinds = set(records_map_kinds())
    flags = [f for f in findings.flags if f.kind in kinds]
    return max(flags, key=lambda f: f.severity) if flags else None


def unit_gram(store: Store, tensor: str, head: int | None) -> tuple[np.ndarray | None, str | None]:
    """The saved K of one unit (only its slice is read), or None and why not."""
    from gradforensics.errors import GradforensicsError
    from gradforensics.store.backends import open_backend
    from gradforensics.store.results import GRAM_ARRAY, GRAM_INDEX, has_result, read_document

    if not has_result(store, GRAM_INDEX):
        return None, ("the store holds no saved Gram matrices (analyze ran with persist off, or the store was "
                      "reopened before it saved them)")
    try:
        index = read_document(store, GRAM_INDEX)
    except GradforensicsError as exc:
        return None, f"the saved Gram index could not be read ({exc})"
    if not index:
        return None, ("no per-record Gram matrix is stored (a long history: above N₀ records the pass keeps window means, "
                      "not record pairs; or analyze ran with the engine option save_grams 'none')")
    entry = next((e for e in index if isinstance(e, dict) and e.get("tensor") == tensor and e.get("head") == head),
                 None) if isinstance(index, list) else None
    info = store.arrays.get(GRAM_ARRAY)
    if entry is None or info is None or not isinstance(entry.get("i"), int) or not 0 <= entry["i"] < info.shape[0]:
        where = tensor + ("" if head is None else f" head {head}")
        return None, f"no saved Gram matrix for {where} (the engine option save_grams chose which are saved)"
    b = open_backend(store.location, "r")              # with a remote store's file-system options
    try:
        where_k = store.analysis_selection.physical(GRAM_ARRAY)       # in the committed generation
        k = np.asarray(b.read(where_k, slice(entry["i"], entry["i"] + 1)), dtype=np.float64)[0]
    except (GradforensicsError, OSError, RuntimeError, ValueError) as exc:
        return None, f"the saved Gram matrix could not be read ({type(exc).__name__}: {exc})"
    finally:
        b.close()
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        return None, f"the saved Gram matrix has shape {k.shape}, not (records, records)"
    return k, None


def _labels(batches: dict[str, np.ndarray], sources: tuple[str, ...], n: int) -> list[str]:
    mix = batches.get("mixture")
    if mix is None or mix.ndim != 2 or mix.shape[0] < n or mix.shape[1] != len(sources) or not sources:
        return ["all"] * n
    mix = np.nan_to_num(np.asarray(mix[:n], dtype=np.float64))
    top = np.argmax(mix, axis=1)
    pure = mix[np.arange(n), top] >= 0.999
    return [sources[t] if p else MIXED for t, p in zip(top, pure)]


def records_map(findings: Findings, store: Store | None) -> tuple[RecordsMap | None, str | None]:
    """The map of the top direction finding's unit, or ``(None, why)``; ``(None, None)`` when there is no such finding."""
    flag = pick(findings)
    if flag is None:
        return None, None
    regime = regime_of(findings.header.get("regime"))
    if regime is not None and regime["name"] == "long-history":
        return None, (f"{findings.n_records:,} records are above N₀ = {regime['n0']:,}: the long-history regime "
                      "keeps window means, not record pairs, so no per-record Gram matrix exists")
    if store is None:
        return None, "the store was not given to the report, so its saved Gram matrices cannot be read"
    k, why = unit_gram(store, flag.tensor, flag.head)
    if k is None:
        return None, why
    n = k.shape[0]
    chosen = np.arange(n) if n <= MAX_POINTS else np.unique(np.linspace(0, n - 1, MAX_POINTS).round().astype(int))
    xy, keep, explained = cosine_map(k[np.ix_(chosen, chosen)])
    if keep.size < 3:
        return None, f"fewer than 3 records of {flag.tensor} have a finite, non-zero gradient"
    recs = chosen[keep]
    batches = store.batches()
    step = np.asarray(batches.get("step", np.arange(n)))
    step = step[recs] if step.shape[:1] == (n,) else recs
    label = "optimizer step"
    if np.unique(step).size <= 1:                       # a replay: one checkpoint, colour by record order
        step, label = recs, "record"
    labels = _labels(batches, store.sources, n)
    source = [labels[i] for i in recs]
    return RecordsMap(flag.tensor, flag.head, flag.kind, xy, recs, source, np.asarray(step, dtype=np.float64),
                      label, explained, n, "expert" if "expert" in flag.evidence else "head"), None


def figure(m: RecordsMap) -> Figure:
    """Two panels: the records coloured by source, and by step (successive records joined)."""
    import matplotlib as mpl

    from gradforensics.reporting.figures import new_figure

    fig = new_figure(10.0, 4.4)
    ax_s, ax_t = fig.subplots(1, 2, sharex=True, sharey=True)
    names = list(dict.fromkeys(m.source))
    cmap = mpl.colormaps["tab10"]
    for i, s in enumerate(names):
        sel = np.array([x == s for x in m.source])
        color = "#9e9e9e" if s == MIXED else cmap(i % 10)
        ax_s.scatter(m.xy[sel, 0], m.xy[sel, 1], s=22, color=color, alpha=0.85, edgecolors="none",
                     label=visible(f"{s} ({int(sel.sum())})"))
        if s != MIXED and sel.sum() >= 2:
            c = m.xy[sel].mean(axis=0)
            ax_s.scatter([c[0]], [c[1]], s=140, marker="X", color=color, edgecolors="black", linewidths=0.8)
    # below the panels, never over a cloud or a centroid (``loc="best"`` inside the panel covered one)
    handles, texts = ax_s.get_legend_handles_labels()
    fig.legend(handles, texts, title="source (× = centroid)", fontsize=8, title_fontsize=8,
               loc="outside lower center", ncols=max(1, min(len(texts), 6)), frameon=False)
    ax_s.set_title("by data source", fontsize=10)
    order = np.argsort(m.step, kind="stable")
    ax_t.plot(m.xy[order, 0], m.xy[order, 1], color="#c8c8c8", lw=0.6, zorder=1)
    sc = ax_t.scatter(m.xy[:, 0], m.xy[:, 1], c=m.step, cmap="viridis", s=22, edgecolors="none", zorder=2)
    cb = fig.colorbar(sc, ax=ax_t, fraction=0.05, pad=0.01)
    cb.set_label(m.step_label)
    ax_t.set_title(f"by {m.step_label} (successive records joined)", fontsize=10)
    for ax in (ax_s, ax_t):
        ax.set_xlabel("MDS axis 1")
        ax.axhline(0, color="#eeeeee", lw=0.8, zorder=0)
        ax.axvline(0, color="#eeeeee", lw=0.8, zorder=0)
    ax_s.set_ylabel("MDS axis 2")
    where = visible(m.where(", "))
    shown = "" if len(m.records) == m.n_records else f"; {len(m.records):,} of {m.n_records:,} records"
    pct = "" if not math.isfinite(m.explained) else f"; the two axes hold {m.explained:.0%} of the spread"
    fig.suptitle(f"Records map of {where} ({m.kind})\none point per record, close = gradients pointing the same way "
                 f"(classical MDS of cosine distances{pct}{shown})", fontsize=10)
    return fig


def caption(m: RecordsMap) -> str:
    """One sentence under the map: what it shows and how to read it."""
    where = m.where()
    declared = advice_of(m.kind)
    read = f"; {declared.records_map}" if declared is not None and declared.records_map else ""
    return (f"Records map of {where}: {len(m.records):,} records placed by the cosine distance between their "
            f"gradients (classical MDS of the saved Gram matrix){read}.")


def build(findings: Findings, store: Store | None) -> tuple[Figure | None, str | None, RecordsMap | None]:
    """``(figure, None, map)``, or ``(None, why, None)`` when it cannot be drawn, or all None without a direction finding."""
    m, why = records_map(findings, store)
    if m is None:
        return None, why, None
    return figure(m), None, m


__all__ = ["MAX_POINTS", "RecordsMap", "build", "caption", "classical_mds", "cosine_map",
           "figure", "pick", "records_map", "unit_gram"]
