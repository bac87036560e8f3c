"""Data-source conflict: do two sources' mean gradients point opposite ways?

For each tensor and head, from its Gram matrix ``K`` and ``batches/mixture`` only
(see :mod:`~gradforensics.analysis.toolkit.kspace`):

* the **per-source mean gradients** ``M = C X`` with ``C = (AᵀA)⁻¹Aᵀ``, the least
  squares fit of ``X ≈ A M`` (``A``: the records' mixture rows; for pure batches
  ``C``'s rows are the per-source averages), and their Gram ``M Mᵀ = C K Cᵀ``,
  hence the **cosine matrix** between sources;
* a **debiased cosine**: ``C K Cᵀ - C diag(r) Cᵀ`` with the per-record noise
  energy ``r_i`` estimated from the residuals (HC2; MacKinnon & White 1985):
  the cosine between the *population* source means, free of the attenuation
  batch noise puts on the sample means;
* **significance** by permutation of the source labels: the mixture rows are
  shuffled among the records (within consecutive blocks in a ``training`` store,
  so a trend over time cannot pose as a source effect), up to ``B = 999`` seeded
  permutations, one-sided (less aligned than chance), sequential (Besag & Clifford 1991:
  ``p = h / L`` where the ``h``-th (10th) permutation to reach ``t`` is the ``L``-th, else the
  fixed test's ``(1 + #{t_π ≤ t}) / (B + 1)``, Phipson & Smyth 2010) on the inner product ``t = <M_a, M_b>``
  of the two sources' mean gradients (the cosine is the effect size, not the test
  statistic: two nearly opposite sources give a relabelled cosine near -1 too, so
  the cosine's permutation null has no power where the conflict is strongest).  ``AᵀA`` is invariant under row
  permutations, so a permutation costs one ``O(N² S)`` product with K.  Where no
  permutation reaches the observed cosine, the normal approximation of the
  permutation distribution extrapolates the p-value for the severity
  (reported as ``z``);
* the **depth band** and **heads** that concentrate a pair's conflict: the layer
  range (parsed from ``model.layers.L.``) and the heads of its flagged units.

Conflict means a *negative* inner product: a step along ``-g_a`` then raises the
loss of source b to first order (Yu et al. 2020, "gradient surgery").  Severity
= ``significance(p, n_tests) × clip(-cos / 0.3, 0, 1)`` with ``cos`` the debiased
cosine (the raw one where the debiased is undefined) and ``n_tests`` the number
of (unit, pair) tests in the store: two sources that merely differ (positive
cosine) are reported in the table (up to ``table_rows`` rows: :func:`keep_rows`) but not flagged.  The severity is then weighted by
the unit's share of the gradient energy (``energy_share``: its mean ``‖g‖²`` over the
records against the sum over the model's whole tensors):
``× (ENERGY_FLOOR + (1 - ENERGY_FLOOR) min(1, share / ENERGY_FULL)^½)``, so a conflict
confined to a unit with 0.5 % of the energy stays below 0.5 (it cannot move the training
much) but is still listed (a clear one at 0.25, the report's floor), and one in 6 % of
the energy or more keeps its full severity.

Last, the run's own base rate (:mod:`~gradforensics.analysis.kinds.conflict.standout`): sources
of different domains disagree in a healthy mixture, so the severity is capped at
``0.45 + 0.55 × standing``, with ``standing`` from a pair that stands out beyond how its sources
relate to the others, or a source whose own loss stalls while the others fall (named in the flag);
a conflict the run does not single out is context.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics._contrast import annotate
from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Flag, Need, NotJudged
from gradforensics.analysis.kinds.conflict.standout import SourceLoss, rise, source_losses, stand_out
from gradforensics.analysis.kinds.conflict.unit import (
    ConflictOptions,
    SourceDesign,
    conflict_units,
    effect,
    segment_span,
    severity_p,
    source_design,
    unit_seed,
)
from gradforensics.analysis.toolkit import flagging as fl
from gradforensics.analysis.toolkit import units as un
from gradforensics.analysis.toolkit.parallel import SLAB_UNITS, map_slabs, release_freed_memory

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "MIN_PER_SOURCE", "SEGMENTS", "compute", "flags",
           "keep_rows", "min_per_source", "not_judged", "plot", "weigh_by_energy"]


COLUMNS = [
    "tensor", "head", "layer", "source_a", "source_b", "cosine", "p_value", "cosine_debiased", "z",
    "n_a", "n_b", "n_records", "n_excluded", "z_cross", "record_first", "record_last", "energy", "energy_share",
    "rise", "draws", "severity", "standing", "named", "why",
]
_PAIR_TABLE = set(COLUMNS) - {"energy_share", "severity", "standing", "named", "why"}     # given per unit
SEGMENTS = 8           # long histories: stretches of the run a conflict is located in
ENERGY_FULL = 0.06     # a unit's share of the gradient energy at which a conflict keeps its full severity
ENERGY_FLOOR = 0.25    # the weight of a conflict in a unit with no energy: listed, never an alarm
#: Records per source below which no conflict can reach 0.5: the permutation test (and, in replay, the
#: cross-block z of :func:`~gradforensics.analysis.kinds.conflict.unit.cross_inner_z`, NaN below 3) cannot
#: get p small enough; a planted cos -0.8 at SNR 50 stays at 0 with one record fewer
#: (``tests/test_not_judged.py``).  Training stores permute within blocks, so they need one more.
MIN_PER_SOURCE = {"replay": 3, "training": 4}

def compute(ctx: Context) -> AnalysisResult:
    """The conflict table (a row per unit and source pair, cut to the option ``table_rows`` by
    :func:`keep_rows`) and the cosine matrices.

    In the long-history regime the statistics run on the per-window, per-source
    mean gradients, and each row's ``record_first``/``record_last`` is the stretch
    of the run (of :data:`SEGMENTS`) where the pair points apart.
    """
    losses = source_losses(ctx.batches.get("loss", np.full(ctx.n_records, np.nan)),
                           np.asarray(ctx.batches["mixture"], dtype=np.float64))
    if ctx.long is None:
        res = _compute(ctx, None, losses)
    else:
        long = ctx.long
        first, last = long.first_record(), long.last_record()
        res = _compute(ctx.super_records(), (first, last), losses)
    res.not_judged = not_judged(ctx)
    return res


def min_per_source(mode: str) -> int:
    """Records per source below which no conflict can reach 0.5 (:data:`MIN_PER_SOURCE`, by store mode)."""
    return MIN_PER_SOURCE["training" if mode == "training" else "replay"]


def not_judged(ctx: Context) -> list[NotJudged]:
    """The conflict a store with too few records of some source could not show (``[]`` when every source has
    enough, or there are fewer than two sources: no pair to judge)."""
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    if len(ctx.sources) < 2 or mix.ndim != 2 or mix.shape[1] != len(ctx.sources):
        return []
    have = np.nansum(mix, axis=0)           # a pure batch counts 1 for its source; a mixed one its shares
    need = min_per_source(ctx.meta.mode)
    short = [(s, h) for s, h in zip(ctx.sources, have) if h < need - 1e-9]
    if not short:
        return []
    counts = ", ".join(f"{s} {h:.3g}" for s, h in short)
    pairs = "every pair" if len(short) == len(ctx.sources) or len(short) >= len(ctx.sources) - 1 else \
        f"the pairs with {', '.join(s for s, _ in short)}"
    return [NotJudged("conflict", f"too few records per source: {counts}; {pairs} not judged",
                      f"≥ {need} records per source ({ctx.meta.mode} store)")]


SLAB_BYTES = 64 * 2**20    # Gram matrices one slab of units holds at most (units tested together)


def _conflict_of(slab: list[un.Unit], mix: np.ndarray, opts: ConflictOptions, training: bool,
                 designs: dict[bytes, SourceDesign], spans: tuple[np.ndarray, np.ndarray] | None,
                 ) -> list[tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]]:
    """Per unit of *slab*: its pairs' columns (with its energy and rise, scalars, and in a long history each
    pair's stretch), cosine matrix and kept sources
    (module-level: it runs on dask workers too).  The units of one design are tested together
    (:func:`conflict_units`), each seeded by its name (:func:`unit_seed`; option ``streams``)."""
    out: list[Any] = [None] * len(slab)
    by_design: dict[bytes, list[int]] = {}
    for i, u in enumerate(slab):
        by_design.setdefault(u.records.tobytes(), []).append(i)
    for key, members in by_design.items():
        units = [slab[i] for i in members]
        done = conflict_units([u.gram for u in units], mix[units[0].records], opts, training,
                              [unit_seed(opts.seed, u.tensor, u.head, opts.streams) for u in units], designs[key])
        for i, u, (cols, cos, idx) in zip(members, units, done, strict=True):
            m = cols["a"].size
            # per-unit values stay scalars here (compute repeats them over the unit's rows, once)
            cols["energy"] = np.array(np.mean(np.diag(u.gram)) if u.n else math.nan)     # 0-d
            cols["rise"] = np.array(rise(u.gram, mix[u.records], int(cols["a"][0]), int(cols["b"][0]))
                                      if idx.size == 2 and m else math.nan)
            if spans is not None:       # long histories: rows are super-records, locate the stretch
                first, last = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
                for k in range(m):
                    first[k], last[k] = _stretch(u, mix, spans, int(cols["a"][k]), int(cols["b"][k]))
                cols["record_first"], cols["record_last"] = first, last
            out[i] = (cols, cos, idx)
    return out


def _compute(ctx: Context, spans: tuple[np.ndarray, np.ndarray] | None,
             losses: list[SourceLoss | None]) -> AnalysisResult:
    opts = ctx.options_for("conflict", ConflictOptions)
    mix = np.asarray(ctx.batches["mixture"], dtype=np.float64)
    training = ctx.meta.mode == "training"
    pack = un.SeriesPack()
    units = un.units(ctx)
    infos = [units.info(i) for i in range(len(units))]        # names and records, no K copied
    designs: dict[bytes, SourceDesign] = {}         # one per distinct record set (a tensor's heads share theirs)
    for u in infos:
        if u.records.tobytes() not in designs:
            designs[u.records.tobytes()] = source_design(mix[u.records], opts, training)
    n_max = max((u.n for u in infos), default=1)
    slab = max(1, min(SLAB_UNITS, SLAB_BYTES // max(8 * n_max * n_max, 1)))
    done = map_slabs(functools.partial(_conflict_of, mix=mix, opts=opts, training=training, designs=designs,
                                       spans=spans), units, size=slab)
    release_freed_memory()          # what the slabs' threads freed (their arenas keep it otherwise)
    for u, (_, cos, idx) in zip(infos, done, strict=True):
        if cos is not None:
            full = np.full((len(ctx.sources),) * 2, np.nan)
            full[np.ix_(idx, idx)] = cos
            pack.add(u.tensor, u.head, full)
    table = _pair_table(infos, done, ctx.sources, ctx.n_records)
    del done
    n_tests = int(table["p_value"].notna().sum())
    table["severity"] = _severities(table, opts.permutations, n_tests)
    weigh_by_energy(table)
    stand_out(table, tuple(ctx.sources), losses)
    series = {**pack.to_series("cosine_matrix"), **_depth_profiles(table),
              "source_names": un.encode_names(ctx.sources)}
    table = keep_rows(table, opts.table_rows)
    return AnalysisResult(table=table, series=series)


def _pair_table(infos: list[un.Unit], done: list[tuple[dict[str, np.ndarray], Any, np.ndarray]],
                sources: tuple[str, ...] | list[str], n_records: int) -> Any:
    """The table's pair columns (:data:`_PAIR_TABLE`), built column by column into their final dtypes.

    A row costs its numbers (float64, int64 and nullable Int64 cells) and one pointer per text cell
    (the tensor's and the sources' names are shared strings, not copies): about 150 bytes.
    """
    import pandas as pd

    m = np.array([cols["a"].size for cols, _, _ in done], dtype=np.int64)
    unit = np.repeat(np.arange(len(infos)), m)          # each row's unit

    def per_unit(values: list[Any], dtype: Any) -> np.ndarray:
        return np.asarray(values, dtype=dtype)[unit]

    def nullable(values: list[int | None]) -> Any:
        v = np.array([-1 if x is None else int(x) for x in values], dtype=np.int64)
        return pd.arrays.IntegerArray(v[unit], (v < 0)[unit])

    def cat(c: str, dtype: Any) -> np.ndarray:        # each unit's column, released once it is in the table's
        parts = [np.asarray(cols.pop(c), dtype=dtype) for cols, _, _ in done]
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)

    names = np.asarray(list(sources), dtype=object)
    out: dict[str, Any] = {
        "tensor": per_unit([u.tensor for u in infos], object), "head": nullable([u.head for u in infos]),
        "layer": nullable([u.layer for u in infos]), "source_a": names[cat("a", np.int64)],
        "source_b": names[cat("b", np.int64)]}
    for c in ("cosine", "p_value", "cosine_debiased", "z", "n_a", "n_b"):
        out[c] = cat(c, np.float64)
    out["n_records"] = per_unit([u.n for u in infos], np.int64)
    out["n_excluded"] = per_unit([u.n_excluded for u in infos], np.int64)
    out["z_cross"] = cat("z_cross", np.float64)
    if all("record_first" in cols for cols, _, _ in done):        # a long history: each pair's stretch
        first, last = cat("record_first", np.int64), cat("record_last", np.int64)
    else:
        first, last = np.zeros(unit.size, dtype=np.int64), np.full(unit.size, n_records - 1, dtype=np.int64)
    out["energy"] = per_unit([float(cols["energy"]) for cols, _, _ in done], np.float64)
    out["rise"] = per_unit([float(cols["rise"]) for cols, _, _ in done], np.float64)
    out["draws"] = cat("draws", np.int64)
    out["record_first"] = pd.arrays.IntegerArray(first, np.zeros(first.size, dtype=bool))
    out["record_last"] = pd.arrays.IntegerArray(last, np.zeros(last.size, dtype=bool))
    # copy=False: the columns become the table's as they are (not copied again into one block)
    return pd.DataFrame({c: out[c] for c in COLUMNS if c in out}, columns=COLUMNS, copy=False)


def _severities(table: Any, B: int, n_tests: int) -> np.ndarray:
    """Each row's severity before the energy weight and the stand-out cap (the module docstring).

    Only rows with a cosine at or below 0 can have one (:func:`effect` is 0 elsewhere, exactly), so only
    they are scored, one by one, with the same scalar functions as one row.
    """
    p, z, zx = (table[c].to_numpy(dtype=float) for c in ("p_value", "z", "z_cross"))
    cdb, c = table["cosine_debiased"].to_numpy(dtype=float), table["cosine"].to_numpy(dtype=float)
    eff = np.where(np.isfinite(cdb), cdb, c)
    out = np.zeros(len(table))
    for i in np.flatnonzero(eff <= 0).tolist():
        out[i] = fl.significance(severity_p(p[i], z[i], B, zx[i]), n_tests) * effect(cdb[i], c[i])
    return out


def keep_rows(table: Any, budget: int | None) -> Any:
    """*table* cut to *budget* rows (option ``table_rows``): all of them when it has no more (or *budget* is
    None), else the rows that can matter, more than *budget* only where these need more.

    Kept whatever the budget: every row at or above the report's floor (a flag), the nominally involved
    head rows (a negative cosine with ``p < 0.05``) of a flagged whole tensor's pair (they decide whether
    its conflict is tensor-wide) and each unit's best-ranked row (the unit stays in the table: its heads
    are counted), so that the flags are those of the whole table.  The rest of the budget goes to
    the other rows in order of severity, then of "nominally involved" (a negative cosine with
    ``p < 0.05``), then of p-value.  Every pair's cosine stays in the unit's cosine matrix and the depth
    profiles (docs/conflict.md, "Memory").
    """
    import pandas as pd

    if budget is None or len(table) <= budget:
        return table
    sev = table["severity"].to_numpy(dtype=float)
    cos = table["cosine_debiased"].where(table["cosine_debiased"].notna(), table["cosine"]).to_numpy(dtype=float)
    p = table["p_value"].to_numpy(dtype=float)
    involved = (cos < 0) & (p < 0.05)
    order = np.lexsort((np.nan_to_num(p, nan=2.0), ~involved, -np.nan_to_num(sev, nan=0.0)))
    keep = np.zeros(len(table), dtype=bool)
    keep[sev >= fl.REPORT_FLOOR] = True
    # the heads that decide whether a flagged whole tensor's conflict is tensor-wide (flags: dedupe_heads)
    head = table["head"].notna().to_numpy()
    key = ["tensor", "source_a", "source_b"]
    flagged_whole = pd.MultiIndex.from_frame(table.loc[keep & ~head, key])
    cand = np.flatnonzero(involved & head)
    keep[cand[pd.MultiIndex.from_frame(table.iloc[cand][key]).isin(flagged_whole)]] = True
    unit = table.groupby(["tensor", "head"], dropna=False, sort=False).ngroup().to_numpy()
    _, first = np.unique(unit[order], return_index=True)
    keep[order[first]] = True
    room = budget - int(keep.sum())
    if room > 0:
        rest = order[~keep[order]]
        keep[rest[:room]] = True
    return table[keep].reset_index(drop=True)


def _stretch(u: un.Unit, mix: np.ndarray, spans: tuple[np.ndarray, np.ndarray], a: int, b: int) -> tuple[int, int]:
    """Long histories: the first and last record of the stretch where sources *a*, *b* point apart in unit *u*."""
    first, last = spans[0][u.records], spans[1][u.records]
    seg = np.minimum((first * SEGMENTS) // max(int(spans[1].max()) + 1, 1), SEGMENTS - 1)
    where = segment_span(u.gram, mix[u.records], seg, a, b)
    if where is None:           # no segment points apart: the whole history (some segments may be empty)
        return int(first.min()), int(last.max())
    lo, hi = where
    return int(first[seg == lo].min()), int(last[seg == hi].max())


def weigh_by_energy(table: Any) -> None:
    """``energy_share`` of each row's unit (whole tensors sum to 1); severity weighted by it (module docstring)."""
    if not len(table):
        table["energy_share"] = []
        return
    whole = table[table["head"].isna()].drop_duplicates("tensor")
    total = float(np.nansum(whole["energy"].to_numpy(dtype=float)))
    share = table["energy"].to_numpy(dtype=float) / total if total > 0 else np.full(len(table), np.nan)
    table["energy_share"] = share
    w = ENERGY_FLOOR + (1 - ENERGY_FLOOR) * np.sqrt(np.clip(np.nan_to_num(share, nan=1.0) / ENERGY_FULL, 0.0, 1.0))
    table["severity"] = table["severity"].to_numpy(dtype=float) * w


def _depth_profiles(table: Any) -> dict[str, np.ndarray]:
    """Per source pair: rows (layer, mean cosine, units flagged above 0.5) over the layered units."""
    out: dict[str, np.ndarray] = {}
    # the rows of each pair by index, over the whole table (a copy of its layered rows would double it)
    layers = table["layer"].to_numpy(dtype=float, na_value=np.nan)
    cosines, hots = table["cosine"].to_numpy(dtype=float), table["severity"].to_numpy(dtype=float) > 0.5
    for (a, b), rows_of in table.groupby(["source_a", "source_b"], sort=True).indices.items():
        rows_of = rows_of[np.isfinite(layers[rows_of])]
        if not rows_of.size:
            continue
        layer, cos, hot = layers[rows_of], cosines[rows_of], hots[rows_of]
        rows = [(L, np.nanmean(cos[layer == L]), hot[layer == L].sum()) for L in np.unique(layer)]
        out[f"depth/{a}|{b}"] = np.asarray(rows, dtype=float)
    return out


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """One flag per conflicting source pair and unit (heads localise it), with its depth band."""
    t = result.table
    floor = 1.0 / (ctx.options_for("conflict", ConflictOptions).permutations + 1)
    out = []
    last = ctx.n_records - 1
    losses = source_losses(ctx.batches.get("loss", np.full(ctx.n_records, np.nan)),
                           np.asarray(ctx.batches["mixture"], dtype=np.float64))
    per_pair: dict[tuple[str, str], tuple[Any, list[int] | None, dict[str, list[int]]]] = {}   # once a pair
    for r in t[t["severity"] >= fl.REPORT_FLOOR].itertuples(index=False):
        head = un.head_of(r.head)
        span = (int(r.record_first), int(r.record_last)) if un.head_of(getattr(r, "record_first", None)) is not None else (0, last)
        if (r.source_a, r.source_b) not in per_pair:
            hot = _hot_units(t[(t.source_a == r.source_a) & (t.source_b == r.source_b) & (t.severity > 0.5)])
            with_head = hot[hot["head"].notna()]
            per_pair[(r.source_a, r.source_b)] = hot, _band(hot["layer"]), {
                str(tn): sorted({int(h) for h in hs}) for tn, hs in with_head.groupby("tensor")["head"]}
        hot, band, heads_of = per_pair[(r.source_a, r.source_b)]
        band = None if band is None else list(band)
        heads = list(heads_of.get(r.tensor, []))
        why = r.why if isinstance(r.why, str) else None
        named = [r.named] if why == "loss" else [r.source_a, r.source_b] if why in ("pair", "rise") else []
        ev = {"cosine": r.cosine, "p_value": r.p_value, "cosine_debiased": r.cosine_debiased, "z": r.z,
              "depth_band": band, "heads": heads, "n_a": r.n_a, "n_b": r.n_b, "energy_share": r.energy_share,
              "standing": float(r.standing), "why": why, "named": named}
        experts = un.is_experts(ctx, r.tensor)
        if experts and head is not None:
            ev["expert"] = head
        out.append(Flag(kind="conflict", tensor=r.tensor, head=head, sources=(r.source_a, r.source_b),
                        severity=float(r.severity), records=span, evidence=ev,
                        summary=_summary(r, head, band, heads, len(hot), floor, experts)
                        + _standing_text(r, why, ctx.sources, losses)))
    cos_eff = t["cosine_debiased"].where(t["cosine_debiased"].notna(), t["cosine"])
    nominal = ((cos_eff < 0) & (t["p_value"] < 0.05)).to_numpy()
    involved = fl.involved_heads(t[nominal], np.ones(int(nominal.sum()), dtype=bool), by_sources=True)
    return fl.dedupe_heads(out, un.heads_per_tensor(t), involved, by_sources=True)


def _hot_units(hot: Any) -> Any:
    """Flagged rows of one pair, without the whole-tensor rows of tensors whose heads are flagged."""
    with_heads = set(hot.loc[hot["head"].notna(), "tensor"])
    return hot[hot["head"].notna() | ~hot["tensor"].isin(with_heads)]


def _band(layers: Any) -> list[int] | None:
    ls = [int(x) for x in layers.dropna()]
    return [min(ls), max(ls)] if ls else None


def _summary(r: Any, head: int | None, band: list[int] | None, heads: list[int], n_hot: int, floor: float,
             experts: bool = False) -> str:
    where = un.where(r.tensor, head, experts)
    way = "point opposite ways" if r.cosine < 0 else "pull against each other once batch noise is removed"
    s = (f"{where}: '{r.source_a}' and '{r.source_b}' gradients {way} (cos {r.cosine:.2f}, "
         f"noise-corrected {r.cosine_debiased:.2f}, {fl.fmt_p(r.p_value, floor)})")
    if band is not None:
        s += f"; across the model this pair conflicts in {n_hot} unit(s), layers {band[0]}-{band[1]}"
    if heads:
        s += f"; in this tensor {'experts' if experts else 'heads'} {', '.join(map(str, heads))}"
    return s + "."


def _standing_text(r: Any, why: str | None, sources: tuple[str, ...], losses: list[SourceLoss | None]) -> str:
    """Why the run singles this conflict out (and the remedy), or why it is context (docs/conflict.md)."""
    if why == "loss" and r.standing >= 0.5:
        k = sources.index(r.named)
        own, others = losses[k], [(s, ls) for s, ls in zip(sources, losses) if s != r.named and ls is not None]
        assert own is not None
        rest = ", ".join(f"'{s}' {ls.early:.2f} → {ls.late:.2f}" for s, ls in others)
        return (f" '{r.named}' stands out: its own loss does not fall ({own.early:.2f} → {own.late:.2f}) while the "
                f"others' do ({rest}). Check that source's data (targets, formatting), or re-weight or drop it.")
    if why == "pair" and r.standing >= 0.5:
        return (f" The pair stands out: '{r.source_a}' and '{r.source_b}' conflict with each other beyond what "
                "either shows with the other sources (contradictory data between the two?). Re-balance or separate "
                "these sources (e.g. per-source loss weights or gradient surgery).")
    if why == "rise" and r.standing >= 0.5:
        return (f" The conflict grew over the run: its late inner product is {r.rise:.1f}× the two sources' early "
                "mean-gradient scale. Re-balance or separate these sources (e.g. per-source loss weights or "
                "gradient surgery), or check what changed in their data.")
    pair = ("its conflict did not grow beyond the two sources' early gradients" if np.isfinite(r.rise) else
            "this pair does not stand out from how its sources relate to the others")
    return (f" Context: sources of different domains disagree (the base rate of a mixture); {pair}, and no "
            "source's loss stalls while the others' fall.")


def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Cosine matrix of the per-source mean gradients of the flagged unit."""
    M = un.unit_series(result.series, "cosine_matrix", flag.tensor, flag.head)
    if M is not None:
        names = un.decode_names(result.series.get("source_names"), M.shape[0])
        # one order whatever order the store lists its sources in (a compare draws two stores side by side):
        # the flagged pair first, as the flag names it, then the others by name
        pair = list(flag.sources)
        keep = np.array(sorted(np.flatnonzero(np.isfinite(np.diag(M))),
                               key=lambda i: (pair.index(names[i]), "") if names[i] in pair else (len(pair), names[i])),
                        dtype=np.intp)
        sub = M[np.ix_(keep, keep)]
        # cells fill the panel (a square matrix in a wide figure left most of it margin)
        ax.imshow(sub, vmin=-1, vmax=1, cmap="RdBu", aspect="auto")
        ax.set_xticks(range(keep.size), [names[i] for i in keep], fontsize=9, rotation=0 if keep.size <= 6 else 45)
        ax.set_yticks(range(keep.size), [names[i] for i in keep], fontsize=9)
        annotate(ax, sub, "RdBu", -1.0, 1.0, fontsize=9 if keep.size <= 8 else 7)   # white on the dark ends
    ax.set_xlabel("source")
    ax.set_ylabel("source")
    where = un.where(flag.tensor, flag.head, "expert" in flag.evidence)
    a, b = (*flag.sources, "", "")[:2]
    ax.set_title(f"conflict: {where}\ncosine of per-source mean gradients (red = {a} and {b} point opposite ways)",
                 fontsize=9)


#: What a ``conflict`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Yu2020] T. Yu et al., "Gradient Surgery for Multi-Task Learning" (PCGrad), NeurIPS 2020.
#: .. [Xie2023] S. M. Xie et al., "DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining",
#:    NeurIPS 2023.
ADVICE = Advice(
    title="Data-source conflict",
    phrase="{sources} gradients point opposite ways",
    evidence_keys={"cosine": "cos", "p_value": "p"},
    remedies=(
        "Re-weight the mixture: lower the share of one of the conflicting sources, or learn the weights "
        "with a small proxy model (DoReMi).",
        "Check the data itself: the same context with different continuations across sources (label noise, "
        "a templating bug, a translation artefact) is the usual cause of a persistent negative cosine.",
        "If both sources must stay, project out the conflicting component per layer (gradient surgery, "
        "PCGrad) on the layers named here only, or give the sources a distinguishing tag token."),
    references=("Yu et al. 2020, Gradient Surgery for Multi-Task Learning (PCGrad)",
                "Xie et al. 2023, DoReMi: Optimizing Data Mixtures Speeds Up LM Pretraining"),
    records_map="two sources pulling this unit opposite ways sit in two separate clouds",
    keyed_by_sources=True,
    cause="data",
)

ANALYSIS = Analysis(name="conflict", needs=(Need.GRAM,), compute=compute, flags=flags, plot=plot,
                    kinds={"conflict": ADVICE}, options=ConflictOptions, long_history=True)
