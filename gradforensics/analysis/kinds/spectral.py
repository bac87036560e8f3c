"""SVD spectra of weight snapshots and window-mean gradients, whole tensors and per head.

For every 2-D matrix ``W`` (a weight snapshot, the mean gradient of a window of
records, or one head's block of either) with singular values ``σ_1 ≥ σ_2 ≥ …``:

* stable rank ``‖W‖_F² / ‖W‖_2² = Σσ_i² / σ_1²`` (Rudelson & Vershynin 2007);
* effective rank ``exp(H(p))``, ``p_i = σ_i / Σσ_j`` (Roy & Vetterli 2007, eq. 1);
* top-k share ``Σ_{i≤k} σ_i² / Σσ_i²``;
* spectral-norm growth ``σ_1(last) / σ_1(first)`` across snapshots; in query/key
  projections it is the attention-logit-growth symptom (logits scale with
  ``‖W_q‖ ‖W_k‖``; Dehghani et al. 2023, Wortsman et al. 2023);
* ``alpha``, the power-law exponent of the empirical spectral density of ``WᵀW``
  (eigenvalues ``λ_i = σ_i²``), fitted as WeightWatcher does (Martin & Mahoney
  2021): eigenvalues above 1e-5 are sorted, and for every candidate ``xmin`` the
  continuous maximum-likelihood exponent ``α̂ = 1 + n / Σ ln(λ_i / xmin)``
  (Clauset, Shalizi & Newman 2009, eq. 3.1) and the Kolmogorov–Smirnov distance
  between the tail and the fitted law are computed; the ``xmin`` with the smallest
  distance wins (their §3.3).  Well-trained layers sit in roughly ``2 ≤ α ≤ 6``;
  ``α < 2`` is a very heavy tail (over-fit, ill-conditioned), ``α > 6`` a
  random-like, under-trained layer.

Flags: fast spectral-norm growth in q/k projections, collapse of the stable rank of
window-mean gradients over the run (training mode), alpha outside ``[2, 6]``.

The spectra themselves (singular values, ranks, the power-law fit) are
:mod:`gradforensics.analysis.toolkit.matrix_spectra`'s, re-exported here.

Exact versus approximate: a matrix whose smaller side is at most
:data:`EXACT_MAX_DIM` (4096) gets all its singular values (eigenvalues of its smaller
Gram side, LAPACK, float64; :func:`singular_values`), except the window-mean gradients
before the last window, which need only ``σ_1`` and ``‖W‖_F²`` and get ``σ_1`` by
Lanczos (saved series: ``sv/...`` rows hold ``σ_1`` alone there, ``fro2/...`` every
window's ``‖W‖_F²``); a larger one gets a randomized SVD of its top :data:`RANDOMIZED_K` singular values
(Halko, Martinsson & Tropp 2011, via ``sklearn.utils.extmath.randomized_svd``).
There ``‖W‖_F`` is still exact (sum of squares), so the stable rank is exact up to
the error of ``σ_1``; the effective rank and alpha use the top-k values only, and
the table's ``exact`` column says so.

References
----------
Martin, C. H. & Mahoney, M. W. (2021). Implicit self-regularization in deep neural
    networks. JMLR 22(165); Martin, Peng & Mahoney (2021), Nat. Commun. 12, 4122.
Clauset, A., Shalizi, C. R. & Newman, M. E. J. (2009). Power-law distributions in
    empirical data. SIAM Review 51, 661–703.
Roy, O. & Vetterli, M. (2007). The effective rank. EUSIPCO.
Rudelson, M. & Vershynin, R. (2007). Sampling from large matrices. J. ACM 54(4).
Dehghani, M. et al. (2023). Scaling vision transformers to 22 billion parameters. ICML.
Wortsman, M. et al. (2023). Small-scale proxies for large-scale transformer training
    instabilities. arXiv:2309.14322.
Halko, N., Martinsson, P.-G. & Tropp, J. A. (2011). SIAM Review 53, 217–288.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradforensics.analysis.contract.advice import Advice, Finding
from gradforensics.analysis.contract.checks import Constraints, Interval
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.contract.options import Options
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.analysis.toolkit.matrix_spectra import (
    EVALS_THRESH,
    EXACT_MAX_DIM,
    MIN_EVALS,
    NO_FIT,
    RANDOMIZED_K,
    TOP_MIN_DIM,
    TOP_TOL,
    PowerLawFit,
    Spectrum,
    block_matrices,
    block_spectra,
    effective_rank,
    powerlaw_fit,
    singular_values,
    stable_rank,
    stable_ranks,
    stacked_singular_values,
    top_share,
)
from gradforensics.analysis.toolkit.stats import rank_trend, rank_trends
from gradforensics.analysis.toolkit.units import head_of
from gradforensics.errors import SpecError
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context
    from gradforensics.store.reader import Store

__all__ = [
    "ADVICE",
    "ANALYSIS",
    "COLUMNS",
    "EVALS_THRESH",
    "EXACT_MAX_DIM",
    "MAX_SNAPSHOTS",
    "MIN_EVALS",
    "MIN_TAIL",
    "NAME",
    "NO_FIT",
    "RANDOMIZED_K",
    "TOP_MIN_DIM",
    "TOP_TOL",
    "WINDOWS",
    "PowerLawFit",
    "SpectralAdvice",
    "SpectralOptions",
    "Spectrum",
    "alpha_severity",
    "block_matrices",
    "block_spectra",
    "collapse_severity",
    "compute",
    "effective_rank",
    "flags",
    "growth_severity",
    "lazy",
    "logit_columns",
    "logit_severity",
    "matrix_row",
    "partner_of",
    "plot",
    "powerlaw_fit",
    "qk_logit_scale",
    "qk_severity",
    "role_of",
    "singular_values",
    "slab_reductions",
    "stable_rank",
    "stable_ranks",
    "stacked_singular_values",
    "top_share",
    "window_sums",
]


NAME = "spectral"
MIN_TAIL = 10              # alpha with a shorter tail is not flagged
MAX_SNAPSHOTS = 16
WINDOWS = 8


@dataclass(frozen=True)
class SpectralOptions(Options):
    """Options of the spectral analysis's flags.

    Parameters
    ----------
    alpha_range
        Healthy range of alpha; outside it a flag is raised (mild above, stronger below).
    growth_half
        Spectral-norm growth ratio (last / first snapshot) of a q/k projection that
        scores severity 0.5; its square scores 1.  Default 3: a q and a k that both
        grow 3-fold let the attention logits grow 9-fold.  Weights that merely
        double from their initialisation stay below 0.5.
    top_k
        ``k`` of the top-k share column.
    min_severity
        Flags below this severity are not emitted.
    """

    alpha_range: tuple[float, float] = (2.0, 6.0)
    growth_half: float = 3.0
    top_k: int = 5
    min_severity: float = 0.1

    analysis_name = NAME
    constraints: ClassVar[Constraints] = {"growth_half": Interval(float, 1, None, "neither"), "top_k": Interval(int, 1, None)}

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = self.alpha_range                   # a pair in order: not a simple range
        if not 1.0 < lo < hi:
            raise SpecError(f"spectral: alpha_range must be (lo, hi) with 1 < lo < hi; got {self.alpha_range!r}.")



# ---------------------------------------------------------------------- lazy pass
def _snapshots(m: int) -> list[int]:
    """Snapshot indices analysed: all, or MAX_SNAPSHOTS evenly spaced including first and last."""
    if m <= MAX_SNAPSHOTS:
        return list(range(m))
    return [int(i) for i in np.unique(np.linspace(0, m - 1, MAX_SNAPSHOTS).round().astype(int))]


def _is_matrix(attrs: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """Whether a stored gradient is of a 2-D tensor (its per-record shape, before any head split)."""
    orig = attrs.get("shape")
    return len(orig) == 2 if orig is not None else len(shape) == 3


def lazy(store: Store) -> dict[str, Any]:
    """Per 2-D tensor: spectra of chosen weight snapshots (window-mean gradients: :func:`slab_reductions`)."""
    import dask

    out: dict[str, Any] = {}
    wrec = store.weight_records()
    for tensor, info in sorted(store.weights.items()):
        if len(info.shape) != 3:
            continue
        spec = HeadSpec.from_attrs(store.grads[tensor].attrs) if tensor in store.grads else None
        handle = store.handle(info)         # read inside each task (no dask array: no metadata reads here)
        idx = _snapshots(info.shape[0])
        out[f"weight|{tensor}"] = dask.delayed(list)([dask.delayed(_snapshot_spectra)(handle, t, spec) for t in idx])
        out[f"weight_records|{tensor}"] = dask.delayed(np.asarray)([int(wrec[t]) for t in idx])
        qk = _qk_lazy(store, tensor, idx)
        if qk is not None:
            out[f"qk_logit|{tensor}"] = qk
    edges = window_edges(store.n_records, WINDOWS)
    for tensor, info in sorted(store.grads.items()):
        if _is_matrix(info.attrs, info.shape):
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


def _snapshot_spectra(handle: Any, t: int, spec: Any) -> dict[int | None, Spectrum]:
    """Spectra of weight snapshot *t*, read in the task."""
    rest = (slice(None),) * (len(handle.shape) - 1)
    return block_spectra(handle[(slice(t, t + 1), *rest)][0], spec, False)


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


def _window_means(part: dict[Any, np.ndarray], edges: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    from gradforensics.analysis.toolkit.slabs import assemble_feature_blocks

    sums = assemble_feature_blocks(part, len(edges) - 1, shape, np.float64)
    counts = np.maximum(np.diff(edges), 1).astype(np.float64)
    return sums / counts.reshape(-1, *([1] * len(shape)))


def _window_spectra(means: Any, n_windows: int, spec: Any) -> Any:
    """The window spectra of one tensor (``finish`` of the slab reduction): one task, a graph of its own.

    The task takes the window means by key and loops over the windows
    (:func:`_all_window_spectra`); a ``dask.delayed`` call per window with *means* as
    argument cost dask's argument unpacking and tokenizing of the whole collection each
    time (1,848 calls, ~2 s of the client's thread, on a store of 168 tensors).
    """
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    key = means.key
    name = "window-spectra-" + ("-".join(map(str, key)) if isinstance(key, tuple) else str(key))
    layer: dict[Any, Any] = {name: (_all_window_spectra, means.key, n_windows, spec)}
    deps: list[Any] = [means]
    return Delayed(name, HighLevelGraph.from_collections(name, layer, dependencies=deps), layer=name)


def _all_window_spectra(means: np.ndarray, n_windows: int, spec: Any) -> list[dict[int | None, Spectrum]]:
    """:func:`_window_spectrum` of every window, in order: their matrices' spectra in one stacked call."""
    keys, mats, tops = [], [], []
    for w in range(n_windows):
        k, ms = block_matrices(np.asarray(means[w], dtype=np.float32), spec, spec is not None)
        keys.append(k)
        mats += ms
        tops += [w < n_windows - 1] * len(ms)
    spectra = iter(stacked_singular_values(mats, tops))
    return [{key: next(spectra) for key in k} for k in keys]


def _window_spectrum(means: np.ndarray, w: int, spec: Any, top_only: bool = False) -> dict[int | None, Spectrum]:
    """Spectra of window mean *w*, in float32 like the gradients it averages (a float32 Gram product).

    Every window but the last needs only ``σ_1`` and ``‖W‖_F²`` (the stable-rank
    series and the first window's ``σ_1``); the last one's whole spectrum feeds the
    effective rank, the top-k share and alpha.
    """
    return block_spectra(np.asarray(means[w], dtype=np.float32), spec, spec is not None, top_only)


def slab_reductions(store: Store) -> dict[str, Any]:
    """Per 2-D stored gradient: the window-mean gradients, summed in the engine's one read of each slab."""
    from functools import partial

    from gradforensics.analysis.contract.grams import SlabReduction
    from gradforensics.analysis.toolkit.slabs import merge_feature_blocks

    edges = window_edges(store.n_records, WINDOWS)
    out: dict[str, Any] = {}
    for tensor, info in sorted(store.grads.items()):
        if not _is_matrix(info.attrs, info.shape):
            continue
        spec = HeadSpec.from_attrs(info.attrs)
        out[f"gradient|{tensor}"] = SlabReduction(
            tensor=tensor, chunk=partial(window_sums, edges=edges), combine=merge_feature_blocks,
            aggregate=partial(_window_means, edges=edges, shape=tuple(info.shape[1:])),
            finish=partial(_window_spectra, n_windows=len(edges) - 1, spec=spec))
    return out


# ------------------------------------------------------------------------ compute
_Q = re.compile(r"(^|[._])(q|query|q_proj|wq|to_q|q_lin)([._]|$)")
_K = re.compile(r"(^|[._])(k|key|k_proj|wk|to_k|k_lin)([._]|$)")
# Embedding tables are lookups, not linear maps: the 2-6 range is not theirs (a healthy
# BERT position-embedding table has alpha 1.55).  Reported, never flagged on alpha.
_EMBEDDING = re.compile(r"embed|(^|[._])(wte|wpe|tok_embeddings)([._]|$)")
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


def matrix_row(tensor: str, head: int | None, matrix: str, spectra: list[Spectrum], records: np.ndarray,
               role: str, top_k: int, trend: tuple[float, float] | None = None) -> dict[str, Any]:
    """One table row: the last point's spectrum, growth and stable rank against the first (*trend*: the stable
    ranks' :func:`rank_trend`, when the caller has it)."""
    first, last = spectra[0], spectra[-1]
    rel = EVALS_THRESH if matrix == "weight" else EVALS_THRESH * (last.sv[0] ** 2 if last.sv.size else 1.0)
    fit = powerlaw_fit(last.sv ** 2, rel)
    srs = stable_ranks(spectra)
    rho, p = rank_trend(srs, min_n=3) if trend is None else trend
    half = srs[: max(1, srs.size // 2)]
    ref = float(np.median(half))
    steady = srs.size >= 4 and bool(np.all(srs[-2:] < np.min(half)))
    return {
        "tensor": tensor, "head": head, "matrix": matrix, "role": role, "exact": bool(last.exact),
        "n_points": len(spectra), "record_first": int(records[0]), "record_last": int(records[-1]),
        "sigma_max": float(last.sv[0]) if last.sv.size else np.nan,
        "sigma_max_first": float(first.sv[0]) if first.sv.size else np.nan,
        "norm_growth": float(last.sv[0] / first.sv[0]) if first.sv.size and first.sv[0] > 0 else np.nan,
        "stable_rank": float(srs[-1]), "stable_rank_first": float(srs[0]),
        "stable_rank_trend": rho, "stable_rank_trend_p": p,
        "stable_rank_drop": ref / float(srs[-1]) if steady and srs[-1] > 0 else 1.0,
        "effective_rank": effective_rank(last.sv), "top_share": top_share(last, top_k),
        "alpha": fit.alpha, "alpha_xmin": fit.xmin, "alpha_ks": fit.ks, "alpha_n_tail": fit.n_tail,
    }


#: Logit scale (largest attention logit the q/k weights give inputs of unit RMS) below which growth is no flag,
#: and at which the severity is 1 (healthy tiny models trained at ordinary learning rates end near 3-10;
#: their twins at 10x the learning rate at 80-150: docs/calibration.md).
LOGIT_OK, LOGIT_FULL = 20.0, 200.0

COLUMNS = ["tensor", "head", "matrix", "role", "exact", "n_points", "record_first", "record_last", "sigma_max",
           "sigma_max_first", "norm_growth", "stable_rank", "stable_rank_first", "stable_rank_trend",
           "stable_rank_trend_p", "stable_rank_drop", "effective_rank", "top_share", "alpha", "alpha_xmin", "alpha_ks", "alpha_n_tail"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, SpectralOptions)
    lz = ctx.computed.get(NAME, {})
    todo: list[tuple[str, int | None, str, list[Spectrum], np.ndarray, str, int]] = []
    series: dict[str, np.ndarray] = {}
    for key in sorted(k for k in lz if "_records|" not in k and not k.startswith("qk_logit|")):
        matrix, tensor = key.split("|", 1)
        points: list[dict[int | None, Spectrum]] = lz[key]
        if not points:
            continue
        records = np.asarray(lz[f"{matrix}_records|{tensor}"])
        grads = ctx.require_store().grads
        attrs = grads[tensor].attrs if tensor in grads else {}
        labels = attrs.get("head_labels") or []
        series[f"records/{matrix}/{tensor}"] = records
        for head in points[0]:
            spectra = [pt[head] for pt in points]
            label = labels[head] if head is not None and head < len(labels) else None
            todo.append((tensor, head, matrix, spectra, records,
                         role_of(tensor, str(attrs.get("role", "")), label), opt.top_k))
            tag = "all" if head is None else head
            series[f"sv/{matrix}/{tensor}/{tag}"] = _stack([s.sv for s in spectra])
            series[f"fro2/{matrix}/{tensor}/{tag}"] = np.array([s.fro2 for s in spectra], dtype=np.float64)
    # the stable-rank trends of every row in one stacked pass (each pair rank_trend's, bit for bit)
    trends = rank_trends([stable_ranks(args[3]) for args in todo], min_n=3)
    rows = [matrix_row(t, h, m, sp, rec, role, k, trend=tr) for (t, h, m, sp, rec, role, k), tr in zip(todo, trends, strict=True)]
    table = pd.DataFrame(rows, columns=COLUMNS)
    logit_columns(table, {k.split("|", 1)[1]: lz[k] for k in lz if k.startswith("qk_logit|")}, series)
    return AnalysisResult(table=table, series=series)


def logit_columns(table: Any, scales: dict[str, list[np.ndarray]], series: dict[str, np.ndarray]) -> None:
    """``logit_scale`` (last snapshot), ``logit_scale_first`` and ``logit_scale_mid`` of the q rows (whole
    tensor: the largest head's); ``qk_pair``: the row's q/k pair has logit scales (k rows too)."""
    for c in ("logit_scale", "logit_scale_first", "logit_scale_mid"):
        table[c] = np.nan
    table["qk_pair"] = False
    for tensor, pts in scales.items():
        arr = np.asarray(pts, dtype=np.float64)
        if arr.ndim != 2 or not arr.size:
            continue
        series[f"logit_scale/{tensor}"] = arr
        pair = {tensor, partner_of(tensor) or tensor}
        table.loc[table["tensor"].isin(pair) & (table["matrix"] == "weight"), "qk_pair"] = True
        for i in table.index[(table["tensor"] == tensor) & (table["matrix"] == "weight")]:
            h = head_of(table.at[i, "head"])
            if h is not None and h >= arr.shape[1]:
                continue
            vals = arr.max(axis=1) if h is None else arr[:, h]
            table.loc[i, ["logit_scale", "logit_scale_first", "logit_scale_mid"]] = (
                vals[-1], vals[0], vals[len(vals) // 2])


def _stack(svs: list[np.ndarray]) -> np.ndarray:
    r = max(s.size for s in svs)
    out = np.full((len(svs), r), np.nan, dtype=np.float32)
    for i, s in enumerate(svs):
        out[i, : s.size] = s
    return out


# -------------------------------------------------------------------------- flags
def growth_severity(ratio: float, half: float = 3.0) -> float:
    """0 at no growth, 0.5 at *half*-fold growth, 1 at its square (log scale in between)."""
    if not np.isfinite(ratio) or ratio <= 1.0:
        return 0.0
    return float(min(1.0, 0.5 * np.log(ratio) / np.log(half)))


def logit_severity(scale: float, first: float = math.nan, mid: float = math.nan) -> float:
    """Severity of a q/k pair's logit scale: 0 up to :data:`LOGIT_OK`, 1 at :data:`LOGIT_FULL` (log scale),
    times ``0.7 + 0.3 t`` with ``t`` the trend (1 when it still grew by 25 % or more over the second half of
    the snapshots, 0 when it stopped growing)."""
    if not np.isfinite(scale) or scale <= LOGIT_OK:
        return 0.0
    level = min(1.0, math.log(scale / LOGIT_OK) / math.log(LOGIT_FULL / LOGIT_OK))
    trend = 1.0
    if np.isfinite(mid) and mid > 0:
        trend = float(np.clip(math.log(max(scale / mid, 1e-12)) / math.log(1.25), 0.0, 1.0))
    return level * (0.7 + 0.3 * trend)


def qk_severity(r: dict[str, Any], growth_half: float = 3.0) -> float:
    """A q/k row's growth severity: on the absolute logit scale where its pair has one (the k side of such a
    pair is judged with its q), else on the fold change of its spectral norm (a q/k without its partner)."""
    if r["role"] not in ("q", "k", "qkv"):
        return 0.0
    if bool(r.get("qk_pair", False)):
        return logit_severity(r.get("logit_scale", math.nan), r.get("logit_scale_first", math.nan),
                              r.get("logit_scale_mid", math.nan))
    return growth_severity(r["norm_growth"], growth_half)


def collapse_severity(drop: float) -> float:
    """0.5 when the gradient's stable rank fell 2^1.5 ≈ 2.8-fold, 1 at 8-fold.

    *drop* is the median stable rank of the first half of the windows over the
    last one, counted only when the last two windows both sit below every window
    of the first half (1 otherwise).
    """
    if not np.isfinite(drop) or drop <= 1.0:
        return 0.0
    return float(min(1.0, np.log2(drop) / 3.0))


def alpha_severity(alpha: float, lo: float = 2.0, hi: float = 6.0) -> float:
    """Below *lo*: 0.5 at ``lo - 1/3``, 0.9 at most; above *hi*: mild (at most 0.3, under-trained)."""
    if not np.isfinite(alpha):
        return 0.0
    if alpha < lo:
        return float(min(0.9, 1.5 * (lo - alpha)))
    if alpha > hi:
        return float(min(0.3, 0.05 * (alpha - hi)))
    return 0.0


def _rows(table: Any, matrix: str) -> list[dict[str, Any]]:
    return [r for r in table.to_dict("records") if r["matrix"] == matrix]


def _head(r: dict[str, Any]) -> int | None:
    return head_of(r["head"])


def flags(result: AnalysisResult, ctx: Context) -> list[Flag]:
    """Norm growth in q/k projections, gradient rank collapse, alpha outside the healthy range."""
    opt = ctx.options_for(NAME, SpectralOptions)
    table = result.table
    out: list[Flag] = []
    weights = _rows(table, "weight")
    whole = {r["tensor"]: r for r in weights if _head(r) is None}
    for r in weights:
        sev = qk_severity(r, opt.growth_half)
        if _head(r) is not None:   # a head only when it grows clearly faster than its tensor
            sev = sev if sev - qk_severity(whole[r["tensor"]], opt.growth_half) >= 0.15 else 0
        if sev >= opt.min_severity:
            out.append(_growth_flag(r, sev, whole))
        a_sev = alpha_severity(r["alpha"], *opt.alpha_range) if r["alpha_n_tail"] >= MIN_TAIL else 0.0
        a_sev = 0.0 if _EMBEDDING.search(r["tensor"].lower()) else a_sev
        if _head(r) is None and a_sev >= opt.min_severity:
            out.append(_flag(r, a_sev, "alpha", (
                f"{r['tensor']}: the eigenvalue spectrum of WᵀW has power-law exponent alpha={r['alpha']:.2f} at "
                f"record {r['record_last']}, outside the healthy {opt.alpha_range[0]:g}-{opt.alpha_range[1]:g}: "
                + ("a very heavy tail, typical of an over-fit or ill-conditioned layer."
                   if r["alpha"] < opt.alpha_range[0] else "a random-like, under-trained layer."))))
    if ctx.meta.mode == "training":
        for r in _rows(table, "gradient"):
            sev = collapse_severity(r["stable_rank_drop"])
            if sev >= opt.min_severity and _head(r) is None:
                out.append(_flag(r, sev, "rank_collapse", (
                    f"{r['tensor']}: the window-mean gradient's stable rank fell "
                    f"{r['stable_rank_drop']:.1f}-fold, to {r['stable_rank']:.1f}, between records {r['record_first']} and {r['record_last']}: its "
                    f"updates collapse onto {max(1, round(r['stable_rank']))} direction(s).")))
    return out


def _flag(r: dict[str, Any], sev: float, reason: str, summary: str) -> Flag:
    ev = {k: r[k] for k in ("matrix", "sigma_max", "norm_growth", "stable_rank", "stable_rank_first", "alpha",
                            "alpha_ks", "exact")}
    ev["reason"] = reason
    return Flag(kind="spectral", tensor=r["tensor"], head=_head(r), sources=(), severity=float(sev),
                records=(int(r["record_first"]), int(r["record_last"])), evidence=ev, summary=summary)


def _growth_flag(r: dict[str, Any], sev: float, whole: dict[str, dict[str, Any]]) -> Flag:
    partner = partner_of(r["tensor"])
    pr = whole.get(partner) if partner else None
    where = r["tensor"] + (f" head {_head(r)}" if _head(r) is not None else "")
    text = (f"{where}: spectral norm grew x{r['norm_growth']:.2f} ({r['sigma_max_first']:.3g} -> {r['sigma_max']:.3g}) "
            f"between records {r['record_first']} and {r['record_last']}")
    if np.isfinite(r.get("logit_scale", math.nan)):
        text += (f"; its q/k weights can now give an attention logit of {r['logit_scale']:.3g} to inputs of unit RMS "
                 f"(‖W_Qᵀ W_K‖₂ d/√d_head; {r['logit_scale_mid']:.3g} half-way, {r['logit_scale_first']:.3g} at "
                 f"the start): softmax saturates there, watch for entropy collapse, consider QK-norm")
        f = _flag(r, sev, "norm_growth", text + ".")
        return replace(f, evidence={**f.evidence, "logit_scale": r["logit_scale"], "cause": "attention"})
    if pr is not None and np.isfinite(pr["norm_growth"]):
        text += (f"; with {partner} (x{pr['norm_growth']:.2f}) the attention logits can grow "
                 f"x{r['norm_growth'] * pr['norm_growth']:.2f}: watch for entropy collapse, consider QK-norm")
    f = _flag(r, sev, "norm_growth", text + ".")
    f = replace(f, evidence={**f.evidence, "cause": "attention"})
    if pr is not None:
        return replace(f, evidence={**f.evidence, "partner": partner, "partner_growth": pr["norm_growth"]})
    return f


# --------------------------------------------------------------------------- plot
def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Spectral-norm history (growth), stable rank per window (collapse) or the ESD with its fit (alpha)."""
    reason = flag.evidence.get("reason")
    head = "all" if flag.head is None else flag.head
    matrix = flag.evidence.get("matrix", "weight")
    sv = np.asarray(result.series[f"sv/{matrix}/{flag.tensor}/{head}"], dtype=float)
    rec = np.asarray(result.series[f"records/{matrix}/{flag.tensor}"])
    if reason == "norm_growth":
        ax.plot(rec, sv[:, 0], "o-", label=flag.tensor)
        partner = flag.evidence.get("partner")
        key = f"sv/weight/{partner}/all"
        if partner and key in result.series:
            ax.plot(np.asarray(result.series[f"records/weight/{partner}"]),
                    np.asarray(result.series[key], dtype=float)[:, 0], "s--", label=str(partner))
        ax.set_yscale("log")
        ax.set(xlabel="record", ylabel="spectral norm σ_max",
               title=f"{flag.tensor}: spectral norm grows x{flag.evidence['norm_growth']:.2f} (attention-logit growth)")
        ax.legend(fontsize=7)
    elif reason == "rank_collapse":
        fro2 = result.series.get(f"fro2/{matrix}/{flag.tensor}/{head}")
        # fro2 saved: the rows of sv hold sigma_1 alone for all windows but the last (older stores: every value)
        sr = (np.asarray(fro2, dtype=float) if fro2 is not None else np.nansum(sv ** 2, axis=1)) / sv[:, 0] ** 2
        ax.plot(rec, sr, "o-")
        ax.set(xlabel="record (end of window)", ylabel="stable rank of window-mean gradient",
               title=f"{flag.tensor}: gradient stable rank falls to {sr[-1]:.1f}: updates collapse to few directions")
    else:
        ev = sv[-1][np.isfinite(sv[-1])] ** 2
        ev = ev[ev > EVALS_THRESH]
        bins = np.logspace(np.log10(ev.min()), np.log10(ev.max()), 40)
        h, e = np.histogram(ev, bins=bins, density=True)
        ax.loglog(np.sqrt(e[:-1] * e[1:]), np.where(h > 0, h, np.nan), "o", ms=3, label="ESD of WᵀW")
        fit = powerlaw_fit(ev)
        if np.isfinite(fit.alpha):
            x = np.logspace(np.log10(fit.xmin), np.log10(ev.max()), 20)
            share = fit.n_tail / ev.size
            ax.loglog(x, share * (fit.alpha - 1) / fit.xmin * (x / fit.xmin) ** -fit.alpha, "r-",
                      label=f"power law, alpha={fit.alpha:.2f}")
            ax.axvline(fit.xmin, color="0.5", ls=":", label="xmin")
        ax.set(xlabel="eigenvalue λ = σ²", ylabel="density",
               title=f"{flag.tensor}: ESD tail slope alpha={flag.evidence['alpha']:.2f} (healthy 2-6)")
        ax.legend(fontsize=7)
    ax.title.set_fontsize(9)


@dataclass(frozen=True)
class SpectralAdvice(Advice):
    """Spectral remedies: QK-norm first only for a finding on query/key projections."""

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        items = list(self.remedies)
        if flags and not any(_on_query_or_key(f) for f in flags):
            items = items[1:] + items[:1]           # QK-norm is not the first thing to try on an MLP
        return items


def _on_query_or_key(flag: Finding) -> bool:
    """Whether *flag* is on a query or key projection (its evidence's role, else its module name)."""
    parts = flag.tensor.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return flag.evidence.get("role") in ("q", "k") or parts[-1] in ("q_proj", "k_proj", "query", "key", "wq", "wk")


#: What a ``spectral`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Dehghani2023] M. Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", ICML 2023
#:    (QK-norm).
#: .. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training
#:    instabilities", 2023.
#: .. [Chowdhery2022] A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (z-loss).
#: .. [Martin2021] C. H. Martin and M. W. Mahoney, "Implicit Self-Regularization in Deep Neural Networks",
#:    JMLR 2021.
ADVICE = SpectralAdvice(
    title="Spectral growth / rank collapse",
    phrase="the spectrum concentrates in a few directions",
    evidence_keys={"norm_growth": "spectral-norm growth", "stable_rank": "stable rank", "alpha": "α",
                   "stable_rank_first": "opening stable rank", "sigma_max": "σ_max"},
    remedies=(
        "For attention q/k weights: normalise queries and keys (QK-norm) or add the auxiliary z-loss; "
        "growing q/k spectra precede attention-logit blow-up.",
        "Otherwise: more weight decay on the named tensors, a lower peak LR, or a smaller LR for them.",
        "A heavy-tailed ESD (alpha < 2) is over-fit/over-trained; alpha > 6 is under-trained (WeightWatcher)."),
    references=("Dehghani et al. 2023, Scaling Vision Transformers to 22B Parameters (QK-norm)",
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
                "Chowdhery et al. 2022, PaLM (z-loss)",
                "Martin & Mahoney 2021, Implicit Self-Regularization in Deep Neural Networks"),
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRADS, Need.WEIGHTS), compute=compute, flags=flags, plot=plot,
                    kinds={"spectral": ADVICE}, options=SpectralOptions, lazy=lazy, long_history=True,
                    slab_reductions=slab_reductions)
