"""The precision analysis's reads: snapshot-pair update counts and per-slab gradient reductions.

:func:`lazy` builds one task per snapshot pair of each tensor with weights but no stored
gradient; :func:`slab_reductions` gives the engine, for every stored gradient, the reductions
it folds into its one read of each slab: the exponent histogram, the largest finite ``|g|``
(the FP8 scale) and, for tensors with weight snapshots, the non-zero masks between snapshots
that :func:`~gradforensics.analysis.kinds.precision.formats.pair_counts` needs.  Hooks of
:mod:`gradforensics.analysis.kinds.precision`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.kinds.precision.formats import BLOCK, exponent_hist, finite_amax, pair_counts, run_counts
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from gradforensics.store.reader import Store

__all__ = ["MAX_PAIRS", "lazy", "nonzero_masks", "slab_reductions", "unit_experts"]


MAX_PAIRS = 32                      # snapshot pairs analysed per tensor (evenly spaced)


def _pair_task(w0: np.ndarray, w1: np.ndarray, gnz: np.ndarray | None, steps: float, spec: Any,
               records: tuple[int, int], experts: int = 0) -> dict[str, Any]:
    """The pair's counts; of a mixture-of-experts unit (*experts* E: weights ``(E, ...)``) each expert's too,
    under ``"experts"`` (a list of E counts)."""
    if gnz is not None and spec is not None:
        gnz = spec.merge(gnz)
    out = pair_counts(w0, w1, gnz, steps)
    out["records"] = records
    out["steps"] = steps
    if experts:
        out["experts"] = [{**pair_counts(w0[e], w1[e], None if gnz is None else gnz[e], steps), "records": records,
                           "steps": steps} for e in range(experts)]
    return out


def unit_experts(store: Store, tensor: str) -> int:
    """E when *tensor* is a mixture-of-experts unit whose weight snapshots hold its experts as its gradient
    does (``(M, E, ...)``, judged expert by expert), else 0."""
    e = store.experts_of(tensor) if tensor in store.grads else None
    if not e or tensor not in store.weights:
        return 0
    return int(e) if tuple(store.weights[tensor].shape[1:]) == tuple(store.grads[tensor].shape[1:]) else 0


def _pairs(n_snapshots: int) -> list[int]:
    """Indices ``t`` of the pairs ``(t, t+1)`` analysed: all, or MAX_PAIRS evenly spaced."""
    if n_snapshots < 2:
        return []
    t = np.arange(n_snapshots - 1)
    if t.size > MAX_PAIRS:
        t = np.unique(np.linspace(0, n_snapshots - 2, MAX_PAIRS).round().astype(int))
    return [int(i) for i in t]


def _pair_specs(store: Store) -> list[tuple[int, int, int, float]]:
    """``(t, r0, r1, steps)`` of every snapshot pair analysed."""
    rec = store.weight_records()
    step = store.read("batches/step").astype(np.float64) if store.n_records else np.zeros(0)
    out = []
    for t in _pairs(len(rec)):
        r0, r1 = int(rec[t]), int(rec[t + 1])
        steps = float(step[r1] - step[r0]) if r1 < step.size and r0 < step.size else float(r1 - r0)
        out.append((t, r0, r1, max(steps, 1.0)))
    return out


def _pair_tasks(store: Store, tensor: str, pairs: list[tuple[int, int, int, float]], gnz: Any = None) -> Any:
    """One task per snapshot pair; *gnz* (a Delayed list of masks, one per pair with ``r1 > r0``) or None."""
    import dask

    w = store.weight(tensor)
    spec = None if gnz is None else HeadSpec.from_attrs(store.grads[tensor].attrs)
    experts = unit_experts(store, tensor)
    tasks, i = [], 0
    for t, r0, r1, steps in pairs:
        g = None
        if gnz is not None and r1 > r0:
            g, i = gnz[i], i + 1
        tasks.append(dask.delayed(_pair_task)(w[t], w[t + 1], g, steps, None if g is None else spec, (r0, r1),
                                              experts))
    return dask.delayed(list)(tasks)


def lazy(store: Store) -> dict[str, Any]:
    """Snapshot-pair update counts of tensors with weights but no stored gradient (the rest: :func:`slab_reductions`),
    and of every tensor with weights the whole run's net update (first snapshot to last)."""
    import dask

    pairs = _pair_specs(store)
    if not pairs:
        return {}
    out = {f"pairs|{t}": _pair_tasks(store, t, pairs) for t in sorted(store.weights) if t not in store.grads}
    for t in sorted(store.weights):
        w = store.weight(t)
        out[f"run|{t}"] = dask.delayed(run_counts)(w[0], w[w.shape[0] - 1])
        if unit_experts(store, t):
            out[f"run_experts|{t}"] = dask.delayed(_run_experts)(w[0], w[w.shape[0] - 1])
    return out


def _run_experts(w0: np.ndarray, w1: np.ndarray) -> list[dict[str, int]]:
    """:func:`run_counts` of each expert of a mixture-of-experts unit (axis 0 of the snapshots)."""
    return [run_counts(w0[e], w1[e]) for e in range(w0.shape[0])]


def nonzero_masks(x: np.ndarray, sel: tuple[slice, ...], spans: list[tuple[int, int]]) -> dict[Any, np.ndarray]:
    """Chunk step: per record span ``[r0, r1)``, where some gradient of the slab's records in it is non-zero."""
    from gradforensics.analysis.toolkit.slabs import feature_blocks

    a = int(sel[0].start)
    out = np.zeros((len(spans), *x.shape[1:]), dtype=bool)
    for j, (r0, r1) in enumerate(spans):
        lo, hi = max(r0 - a, 0), min(r1 - a, x.shape[0])
        if hi > lo:
            out[j] = (x[lo:hi] != 0).any(axis=0)
    return feature_blocks(sel, out)


def _masks(part: dict[Any, np.ndarray], n: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    from gradforensics.analysis.toolkit.slabs import assemble_feature_blocks

    return list(assemble_feature_blocks(part, n, shape, bool))


def _hist_chunk(x: np.ndarray, sel: tuple[slice, ...]) -> np.ndarray:
    """Chunk step: :func:`exponent_hist` of a slab, in blocks of ``BLOCK`` elements (bounds its temporaries)."""
    flat = np.asarray(x).reshape(-1)
    return np.sum([exponent_hist(flat[a:a + BLOCK]) for a in range(0, max(flat.size, 1), BLOCK)], axis=0)


def _amax_chunk(x: np.ndarray, sel: tuple[slice, ...]) -> float:
    """Chunk step: the largest finite ``|g|`` of a slab (the FP8 gradient scale)."""
    return finite_amax(x)


def _by_expert(x: np.ndarray, sel: tuple[slice, ...], stat: Callable[[np.ndarray], Any]) -> dict[int, Any]:
    """Chunk step on a mixture-of-experts unit's slab ``(n, e, ...)``: *stat* of each expert's part, keyed by
    the expert's index in the unit (``sel[1]`` places the slab's experts)."""
    e0 = int(sel[1].start)
    return {e0 + j: stat(x[:, j]) for j in range(x.shape[1])}


def _merge_experts(parts: Sequence[Mapping[int, Any]], op: Callable[[Any, Any], Any]) -> dict[int, Any]:
    """Combine per-expert partials: an expert met in several slabs (its features split) meets by *op*."""
    out: dict[int, Any] = {}
    for part in parts:
        for e, v in part.items():
            out[e] = op(out[e], v) if e in out else v
    return out


def slab_reductions(store: Store) -> dict[str, Any]:
    """Per stored gradient, inside the engine's one read of each slab: the exponent histogram and,
    for tensors with weight snapshots, the non-zero masks between snapshots that the pair counts need."""
    from functools import partial

    from gradforensics.analysis.contract.grams import SlabReduction
    from gradforensics.analysis.toolkit.slabs import merge_feature_blocks

    out: dict[str, Any] = {}
    pairs = _pair_specs(store)
    spans = [(r0, r1) for _, r0, r1, _ in pairs if r1 > r0]
    for tensor, info in sorted(store.grads.items()):
        if tensor in store.weights and pairs:
            shape = tuple(info.shape[1:])
            out[f"pairs|{tensor}"] = SlabReduction(
                tensor=tensor, chunk=partial(nonzero_masks, spans=spans),
                combine=partial(merge_feature_blocks, op=np.logical_or),
                aggregate=partial(_masks, n=len(spans), shape=shape),
                finish=partial(_pair_tasks, store, tensor, pairs))
        if info.attrs.get("experts") and info.split:      # per expert (the whole unit's: their sum, their max)
            out[f"grad_exp_experts|{tensor}"] = SlabReduction(
                tensor=tensor, chunk=partial(_by_expert, stat=partial(_hist_chunk, sel=())),
                combine=partial(_merge_experts, op=np.add))
            out[f"grad_amax_experts|{tensor}"] = SlabReduction(
                tensor=tensor, chunk=partial(_by_expert, stat=finite_amax), combine=partial(_merge_experts, op=max))
            continue
        out[f"grad_exp|{tensor}"] = SlabReduction(tensor=tensor, chunk=_hist_chunk, combine=sum)
        out[f"grad_amax|{tensor}"] = SlabReduction(tensor=tensor, chunk=_amax_chunk, combine=max)
    return out
