"""The spectral analysis's reads: weight-snapshot spectra, window-mean gradients, q/k logit scales.

What the pass hands :func:`~gradforensics.analysis.kinds.spectral.compute`: the spectra of chosen
weight snapshots (:func:`lazy`), the window-mean gradients summed in the engine's one read of each slab
(:func:`slab_reductions`) and their spectra, and the largest attention logit of each q/k pair's weights
(:func:`qk_logit_scale`).  Names of query/key projections: :func:`role_of`, :func:`partner_of`.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.kinds.spectral.spectra import (
    Spectrum,
    block_matrices,
    block_spectra,
    stacked_singular_values,
)
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from gradforensics.store.reader import ArrayInfo, Store

__all__ = ["MAX_SNAPSHOTS", "WINDOWS", "is_matrix", "lazy", "partner_of", "qk_logit_scale", "role_of",
           "slab_reductions", "unit_spec", "window_means", "window_spectra", "window_sums"]

MAX_SNAPSHOTS = 16
WINDOWS = 8


def _snapshots(m: int) -> list[int]:
    """Snapshot indices analysed: all, or MAX_SNAPSHOTS evenly spaced including first and last."""
    if m <= MAX_SNAPSHOTS:
        return list(range(m))
    return [int(i) for i in np.unique(np.linspace(0, m - 1, MAX_SNAPSHOTS).round().astype(int))]


def is_matrix(attrs: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """Whether a stored gradient is of a 2-D tensor (its per-record shape, before any head split), or a
    mixture-of-experts unit of 2-D experts (``(N, E, a, b)``, attribute ``experts``)."""
    orig = attrs.get("shape")
    if attrs.get("experts"):
        return len(orig) == 3 if orig is not None else len(shape) == 4
    return len(orig) == 2 if orig is not None else len(shape) == 3


def unit_spec(info: ArrayInfo) -> HeadSpec | None:
    """How one record of a stored gradient splits into the units :attr:`ArrayInfo.split` counts: a head-split
    tensor's own :class:`HeadSpec`; the E experts ``(E, a, b)`` of a mixture-of-experts unit as E blocks along
    axis 0 (the whole unit's matrix is the experts stacked, ``(E·a, b)``); None for a whole tensor."""
    spec = HeadSpec.from_attrs(info.attrs)
    if spec is None and info.split:
        return HeadSpec(int(info.split), 0)
    return spec


def lazy(store: Store) -> dict[str, Any]:
    """Per 2-D tensor: spectra of chosen weight snapshots (window-mean gradients: :func:`slab_reductions`)."""
    import dask

    out: dict[str, Any] = {}
    wrec = store.weight_records()
    for tensor, info in sorted(store.weights.items()):
        experts = store.experts_of(tensor) if tensor in store.grads else None
        if len(info.shape) != (4 if experts else 3):        # a snapshot of an experts unit: (E, a, b), split already
            continue
        spec = unit_spec(store.grads[tensor]) if tensor in store.grads else None
        handle = store.handle(info)         # read inside each task (no dask array: no metadata reads here)
        idx = _snapshots(info.shape[0])
        out[f"weight|{tensor}"] = dask.delayed(list)([dask.delayed(_snapshot_spectra)(handle, t, spec, bool(experts))
                                                      for t in idx])
        out[f"weight_records|{tensor}"] = dask.delayed(np.asarray)([int(wrec[t]) for t in idx])
        qk = _qk_lazy(store, tensor, idx)
        if qk is not None:
            out[f"qk_logit|{tensor}"] = qk
    edges = window_edges(store.n_records, WINDOWS)
    for tensor, info in sorted(store.grads.items()):
        if is_matrix(info.attrs, info.shape):
            out[f"gradient_records|{tensor}"] = dask.delayed(np.asarray)([int(b) - 1 for b in edges[1:]])
    return out


def _head_rows(blocks: np.ndarray, axis: int) -> np.ndarray:
    """Head blocks as ``(H, d_head, d_in)``: a split along axis 0 is ``(d_head, d_in)`` already."""
    return blocks if axis == 0 else np.swapaxes(blocks, 1, 2)


def qk_logit_scale(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per query head ``h``: ``‖W_Qʰᵀ W_Kᵍ‖₂ · d_in / √d_head``, the largest attention logit its q/k weights
    give two inputs of unit RMS (``‖x‖ = √d_in``, what the pre-attention norm makes of them at gain 1);
    *q*, *k*: ``(H_q, d_head, d_in)``, ``(H_kv, d_head, d_in)``; query head ``h`` reads key head
    ``g = h // (H_q / H_kv)`` (grouped-query attention).  ``σ₁(W_Qᵀ W_K)² = λ_max((W_K W_Kᵀ)(W_Q W_Qᵀ))``,
    a ``d_head × d_head`` product."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    hq, d, d_in = q.shape
    group = max(hq // max(k.shape[0], 1), 1)
    out = np.empty(hq)
    for h in range(hq):
        kk = k[min(h // group, k.shape[0] - 1)]
        m = (kk @ kk.T) @ (q[h] @ q[h].T)
        out[h] = math.sqrt(max(float(np.max(np.linalg.eigvals(m).real)), 0.0)) * d_in / math.sqrt(d)
    return out


def _qk_point(qh: Any, kh: Any, t: int, qspec: Any, kspec: Any) -> np.ndarray:
    """Logit scales of snapshot *t* (fused q|k|v: *kh* is None and the k blocks follow the q blocks)."""
    rest = (slice(None),) * (len(qh.shape) - 1)
    wq = np.asarray(qh[(slice(t, t + 1), *rest)][0])
    blocks = qspec.split(wq)
    if kh is None:
        n = qspec.heads
        return qk_logit_scale(_head_rows(blocks[:n], qspec.axis), _head_rows(blocks[n:2 * n], qspec.axis))
    wk = np.asarray(kh[(slice(t, t + 1), *rest)][0])
    return qk_logit_scale(_head_rows(blocks, qspec.axis), _head_rows(kspec.split(wk), kspec.axis))


def _qk_lazy(store: Store, tensor: str, idx: list[int]) -> Any:
    """The delayed per-snapshot logit scales of q tensor (or fused qkv) *tensor*, or None without its k."""
    import dask

    attrs = store.grads[tensor].attrs if tensor in store.grads else {}
    qspec = HeadSpec.from_attrs(attrs)
    role = role_of(tensor, str(attrs.get("role", "")))
    if qspec is None or role not in ("q", "qkv") or (role == "qkv" and qspec.fused < 2):
        return None
    kh = kspec = None
    if role == "q":
        partner = partner_of(tensor)
        if partner is None or partner not in store.weights or partner not in store.grads:
            return None
        kspec = HeadSpec.from_attrs(store.grads[partner].attrs)
        if kspec is None or store.weights[partner].shape[0] != store.weights[tensor].shape[0]:
            return None
        kh = store.handle(store.weights[partner])
    qh = store.handle(store.weights[tensor])
    return dask.delayed(list)([dask.delayed(_qk_point)(qh, kh, t, qspec, kspec) for t in idx])


def _snapshot_spectra(handle: Any, t: int, spec: Any, split: bool = False) -> dict[int | None, Spectrum]:
    """Spectra of weight snapshot *t*, read in the task (*split*: it is stored as its blocks already)."""
    rest = (slice(None),) * (len(handle.shape) - 1)
    return block_spectra(handle[(slice(t, t + 1), *rest)][0], spec, split)


def window_sums(x: np.ndarray, sel: tuple[slice, ...], edges: np.ndarray) -> dict[Any, np.ndarray]:
    """Chunk step of the window means: ``Wᵀ X_b`` for one slab, non-finite values as 0, in float64.

    ``W[i, w] = 1`` when record *i* lies in window *w*; *sel* places the slab (its
    records may be a part of all records when the record axis is split).
    """
    from gradforensics.analysis.toolkit.slabs import feature_blocks

    r0 = int(sel[0].start)
    n_win = len(edges) - 1
    if x.dtype == np.float32 and x.ndim >= 2:
        # One float32 product ``Wᵀ X`` (BLAS; a window holds a few records, so float32 sums are exact to
        # ~1e-7 relative, and the spectra are taken in float32); a non-finite sum (a non-finite element,
        # or an overflow) falls back to the float64 sums below.
        w = np.zeros((n_win, x.shape[0]), dtype=np.float32)
        for k, (a, b) in enumerate(itertools.pairwise(edges)):
            w[k, max(int(a) - r0, 0):max(min(int(b) - r0, x.shape[0]), 0)] = 1.0
        with np.errstate(over="ignore", invalid="ignore"):
            prod = w @ x.reshape(x.shape[0], -1)
        if np.isfinite(prod).all():
            return feature_blocks(sel, prod.astype(np.float64).reshape(n_win, *x.shape[1:]))
    if not np.isfinite(x).all():
        x = np.where(np.isfinite(x), x, 0.0)
    out = np.zeros((n_win, *x.shape[1:]), dtype=np.float64)
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        lo, hi = max(int(a) - r0, 0), min(int(b) - r0, x.shape[0])
        if hi > lo:
            out[k] = x[lo:hi].sum(axis=0, dtype=np.float64)
    return feature_blocks(sel, out)


def window_means(part: dict[Any, np.ndarray], edges: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    from gradforensics.analysis.toolkit.slabs import assemble_feature_blocks

    sums = assemble_feature_blocks(part, len(edges) - 1, shape, np.float64)
    counts = np.maximum(np.diff(edges), 1).astype(np.float64)
    return sums / counts.reshape(-1, *([1] * len(shape)))


def window_tasks(means: Any, n_windows: int, spec: Any) -> Any:
    """The window spectra of one tensor (``finish`` of the slab reduction): one task, a graph of its own.

    The task takes the window means by key and loops over the windows
    (:func:`window_spectra`); a ``dask.delayed`` call per window with *means* as
    argument cost dask's argument unpacking and tokenizing of the whole collection each
    time (1,848 calls, ~2 s of the client's thread, on a store of 168 tensors).
    """
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    key = means.key
    name = "window-spectra-" + ("-".join(map(str, key)) if isinstance(key, tuple) else str(key))
    layer: dict[Any, Any] = {name: (window_spectra, means.key, n_windows, spec)}
    deps: list[Any] = [means]
    return Delayed(name, HighLevelGraph.from_collections(name, layer, dependencies=deps), layer=name)


def window_spectra(means: np.ndarray, n_windows: int, spec: Any) -> list[dict[int | None, Spectrum]]:
    """The spectra of every window mean (whole matrix and heads), in order, in one stacked call; in float32 like
    the gradients they average.  Every window but the last needs only ``σ_1`` and ``‖W‖_F²`` (the stable-rank
    series and the first window's ``σ_1``); the last one's whole spectrum feeds the effective rank, the top-k
    share and alpha."""
    keys, mats, tops = [], [], []
    for w in range(n_windows):
        k, ms = block_matrices(np.asarray(means[w], dtype=np.float32), spec, spec is not None)
        keys.append(k)
        mats += ms
        tops += [w < n_windows - 1] * len(ms)
    spectra = iter(stacked_singular_values(mats, tops))
    return [{key: next(spectra) for key in k} for k in keys]



def slab_reductions(store: Store) -> dict[str, Any]:
    """Per 2-D stored gradient: the window-mean gradients, summed in the engine's one read of each slab."""
    from functools import partial

    from gradforensics.analysis.contract.grams import SlabReduction
    from gradforensics.analysis.toolkit.slabs import merge_feature_blocks

    edges = window_edges(store.n_records, WINDOWS)
    out: dict[str, Any] = {}
    for tensor, info in sorted(store.grads.items()):
        if not is_matrix(info.attrs, info.shape):
            continue
        spec = unit_spec(info)
        out[f"gradient|{tensor}"] = SlabReduction(
            tensor=tensor, chunk=partial(window_sums, edges=edges), combine=merge_feature_blocks,
            aggregate=partial(window_means, edges=edges, shape=tuple(info.shape[1:])),
            finish=partial(window_tasks, n_windows=len(edges) - 1, spec=spec))
    return out



_Q = re.compile(r"(^|[._])(q|query|q_proj|wq|to_q|q_lin)([._]|$)")
_K = re.compile(r"(^|[._])(k|key|k_proj|wk|to_k|k_lin)([._]|$)")
_PAIRS = (("q_proj", "k_proj"), ("query", "key"), (".wq.", ".wk."), ("to_q", "to_k"), ("q_lin", "k_lin"),
          (".q.", ".k."))


def role_of(tensor: str, attrs_role: str = "", head_label: str | None = None) -> str:
    """``q``, ``k``, ``qkv`` (fused) or ``""``, from the stored role, the head label or the name."""
    if head_label and head_label[0] in "qk" and head_label[1:].isdigit():
        return head_label[0]
    if attrs_role in ("q", "k", "qkv"):
        return attrs_role
    low = tensor.lower()
    if _Q.search(low):
        return "q"
    if _K.search(low):
        return "k"
    if any(s in low for s in ("qkv", "c_attn", "query_key_value", "in_proj")):
        return "qkv"
    return ""


def partner_of(tensor: str) -> str | None:
    """The key projection of a query projection and vice versa (by name), or None."""
    for q, k in _PAIRS:
        if q in tensor:
            return tensor.replace(q, k)
        if k in tensor:
            return tensor.replace(k, q)
    return None

