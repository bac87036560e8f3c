"""Gradient-noise estimators over a Gram matrix: ``|G|²``, ``tr(Σ)``, ``B_simple``, SNR (McCandlish et al. 2018).

Record *i* is the mean gradient of a batch of ``B_i`` samples:
``g_i = G + ε_i`` with ``Cov(ε_i) = Σ / B_i``, so (McCandlish et al. 2018, eq. A.1)

    E|g_i|² = |G|² + tr(Σ)/B_i,          E<g_i, g_j> = |G|²  (i ≠ j).

**Pooled** (:func:`noise_parts_stack`), with ``w_i = B_i``:

    |G|²^ = (Σ_{i≠j} w_i w_j K_ij) / (Σ_{i≠j} w_i w_j),
    tr(Σ)^ = (1/n) Σ_i B_i (K_ii - |G|²^).

For equal ``B`` these are the paper's two-batch-size estimators (eq. A.2-A.3, with
``B_small = B``, ``B_big = N B``), and ``tr(Σ)^ = B Σ_i |g_i - ḡ|² / (n - 1)``.

**Within sources** (:func:`mixture_parts`): when every batch is pure (one source) the
sources' own means ``G_s`` differ, and pooling counts their spread as noise.  Then

    <G_s, G_t>^ = Σ_{i∈s, j∈t, i≠j} w_i w_j K_ij / (same sum of w_i w_j),
    tr(Σ_s)^   = (1/n_s) Σ_{i∈s} B_i (K_ii - |G_s|²^),

and a batch of the training mixture (shares ``π_s``, stratified) has
``G = Σ π_s G_s``, ``|G|² = πᵀ [<G_s, G_t>] π`` and ``tr(Σ) = Σ π_s tr(Σ_s)``: the
noise around each source's own mean (the residual of the per-source fit,
:func:`~gradforensics.analysis.toolkit.kspace.noise_energy`; equal for equal ``B``).
``trace_between = Σ π_s |G_s|² - |G|²`` is what a batch drawn i.i.d. from the
mixture would add to ``tr(Σ)``.

Then ``B_simple = tr(Σ)/|G|²`` (eq. 2.8) and ``SNR = |G|²/(tr(Σ)/B) = B/B_simple``.
Uncertainty: a delete-one jackknife in closed form (O(n²) pooled, O(n S²) within
sources); ``snr_lo``/``snr_hi`` are two-sided 90% bounds.  **Resolution**: an SNR not
more than one standard error above 0 (or with ``|G|²^ <= 0``) is not a number the data
support: it is reported as NaN with ``snr_note = "below resolution"`` and its upper
bound ``snr_upper`` (one-sided 95%), never as a negative SNR.

References
----------
McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch
Training", arXiv:1812.06162.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BELOW_RESOLUTION",
    "FIELDS",
    "Z90",
    "Parts",
    "mixture_parts",
    "noise_estimate",
    "noise_parts",
    "noise_parts_stack",
    "robust_z",
    "summaries",
    "summarize",
]


Z90 = 1.6448536269514722
BELOW_RESOLUTION = "below resolution"
#: Columns of one estimate, in table order.
FIELDS = ("n", "batch_size", "estimator", "g2", "trace_sigma", "trace_sigma_se", "trace_between", "b_simple", "snr",
          "snr_note", "snr_upper", "snr_se", "snr_lo", "snr_hi", "b_simple_lo", "b_simple_hi")


@dataclass(frozen=True)
class Parts:
    """``|G|²^`` and ``tr(Σ)^`` and their delete-one values (``None`` below 3 records)."""

    g2: float
    trace: float
    g2_loo: np.ndarray | None
    trace_loo: np.ndarray | None
    between: float = math.nan

    def __add__(self, other: Parts) -> Parts:
        """Sum of two tensors' parts over the same records (the whole model's |G|² and tr Σ)."""
        loo = None if self.g2_loo is None or other.g2_loo is None else (self.g2_loo + other.g2_loo)
        tloo = None if self.trace_loo is None or other.trace_loo is None else (self.trace_loo + other.trace_loo)
        return Parts(self.g2 + other.g2, self.trace + other.trace, loo, tloo, self.between + other.between)


def noise_parts(gram: np.ndarray, n_samples: np.ndarray) -> Parts:
    """Pooled ``|G|²^``, ``tr(Σ)^`` of the records of *gram* (batch sizes *n_samples*), with delete-one values."""
    return noise_parts_stack(np.asarray(gram, dtype=np.float64)[None], n_samples)[0]


def noise_parts_stack(grams: np.ndarray, n_samples: np.ndarray) -> list[Parts]:
    """Pooled ``|G|²^``, ``tr(Σ)^`` and their delete-one values of every Gram matrix of the stack *grams*
    (``(m, n, n)``, the same records: batch sizes *n_samples*) in one vectorised pass (module docstring)."""
    k = np.asarray(grams, dtype=np.float64)
    b = np.asarray(n_samples, dtype=np.float64)
    m, n = k.shape[0], b.size
    if n < 2:
        return [Parts(math.nan, math.nan, None, None) for _ in range(m)]
    d = np.ascontiguousarray(np.diagonal(k, axis1=1, axis2=2))
    v = k @ b                                                        # (m, n): K b per item
    w1, w2 = b.sum(), (b * b).sum()
    bd = d @ b
    bv = v @ b
    bbd = d @ (b * b)
    g2 = (bv - bbd) / (w1 * w1 - w2)
    tr = (bd - g2 * w1) / n
    if n < 3:
        return [Parts(float(g2[i]), float(tr[i]), None, None) for i in range(m)]
    with np.errstate(divide="ignore", invalid="ignore"):
        g2_m = ((bv - bbd)[:, None] - 2 * b * (v - b * d)) / ((w1 - b) ** 2 - (w2 - b * b))
        tr_m = (bd[:, None] - b * d - g2_m * (w1 - b)) / (n - 1)
    return [Parts(float(g2[i]), float(tr[i]), g2_m[i], tr_m[i]) for i in range(m)]


def _source_stats(P: np.ndarray, Q: np.ndarray, D: np.ndarray, W1: np.ndarray, W2: np.ndarray, ns: np.ndarray,
                  pi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(|G|² of the mixture, Σ π_s tr Σ_s, Σ π_s |G_s|²) from block sums; leading axes broadcast."""
    with np.errstate(divide="ignore", invalid="ignore"):
        G = P / (W1[..., :, None] * W1[..., None, :])
        diag = (np.diagonal(P, axis1=-2, axis2=-1) - Q) / (W1 * W1 - W2)
        idx = np.arange(P.shape[-1])
        G[..., idx, idx] = diag
        tr = (D - diag * W1) / ns
    return np.einsum("s,...st,t->...", pi, G, pi), tr @ pi, diag @ pi


def mixture_parts(gram: np.ndarray, n_samples: np.ndarray, source: np.ndarray, shares: np.ndarray) -> Parts:
    """Within-source ``tr(Σ)`` and the ``|G|²`` of a batch of the mixture *shares* (module docstring).

    Parameters
    ----------
    gram, n_samples
        Gram matrix and batch sizes of the n records (all pure).
    source
        (n,) source index of each record, ``0 .. S-1``; every source needs >= 2 records.
    shares
        (S,) the mixture's share of each source (normalised here).
    """
    k = np.asarray(gram, dtype=np.float64)
    b = np.asarray(n_samples, dtype=np.float64)
    pi = np.asarray(shares, dtype=np.float64)
    pi = pi / pi.sum()
    H = np.eye(pi.size)[np.asarray(source)]                   # n×S one-hot
    d = np.diag(k)
    U = b[:, None] * (k @ (b[:, None] * H))                   # U[m, t] = b_m Σ_{j∈t} b_j K_mj
    P = H.T @ U
    bbd, bdd = b * b * d, b * d
    Q, D, W1, W2, ns = H.T @ bbd, H.T @ bdd, H.T @ b, H.T @ (b * b), H.sum(axis=0)
    g2, tr, own = _source_stats(P, Q, D, W1, W2, ns, pi)
    if ns.min() < 3:
        return Parts(float(g2), float(tr), None, None, float(own - g2))
    Pm = (P[None] - H[:, :, None] * U[:, None, :] - U[:, :, None] * H[:, None, :]
          + bbd[:, None, None] * H[:, :, None] * H[:, None, :])
    g2_m, tr_m, _ = _source_stats(Pm, Q - H * bbd[:, None], D - H * bdd[:, None], W1 - H * b[:, None],
                                  W2 - H * (b * b)[:, None], ns - H, pi)
    return Parts(float(g2), float(tr), g2_m, tr_m, float(own - g2))


def _jackknife_se(loo: np.ndarray) -> np.ndarray:
    """The delete-one standard error ``sqrt((n-1)/n Σ (x - x̄)²)`` of every row of *loo* (``(m, n)``)."""
    n = loo.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        return np.sqrt((n - 1) / n * ((loo - loo.mean(axis=-1)[:, None]) ** 2).sum(axis=-1))


def summarize(parts: Parts, batch_size: float, n: int, estimator: str = "pooled") -> dict[str, float | str]:
    """The table fields of one estimate (see :data:`FIELDS`), the resolution rule applied."""
    return summaries([(parts, batch_size, n, estimator)])[0]


def summaries(items: list[tuple[Parts, float, int, str]]) -> list[dict[str, float | str]]:
    """The table fields of every ``(parts, batch_size, n, estimator)`` of *items* (:func:`summarize` is a stack
    of one): the jackknife standard errors of all delete-one values of one length in one stacked pass
    (:func:`_jackknife_se`; ``g2_loo · B / trace_loo`` elementwise), the rest item by item."""
    trace_se: dict[int, float] = {}
    snr_se: dict[int, float] = {}         # only where every delete-one SNR is finite (else no bounds)
    by_len: dict[int, list[int]] = {}
    for i, (p, _, n, _) in enumerate(items):
        if n >= 2 and math.isfinite(p.g2) and p.g2_loo is not None and p.trace_loo is not None:
            by_len.setdefault(p.trace_loo.size, []).append(i)
    for members in by_len.values():
        tr = np.stack([items[i][0].trace_loo for i in members])      # type: ignore[misc]
        g2 = np.stack([items[i][0].g2_loo for i in members])         # type: ignore[misc]
        bs = np.array([items[i][1] for i in members], dtype=np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            snr_m = g2 * bs / tr
        for i, ok, se in zip(members, np.isfinite(tr).all(axis=-1), _jackknife_se(tr), strict=True):
            if ok:
                trace_se[i] = float(se)
        for i, ok, se in zip(members, np.isfinite(snr_m).all(axis=-1), _jackknife_se(snr_m), strict=True):
            if ok:
                snr_se[i] = float(se)
    return [_summary(p, b, n, how, trace_se.get(i), snr_se.get(i)) for i, (p, b, n, how) in enumerate(items)]


def _summary(parts: Parts, batch_size: float, n: int, estimator: str, trace_se: float | None,
             snr_se: float | None) -> dict[str, float | str]:
    """One estimate's fields, given its jackknife standard errors (None: none)."""
    out: dict[str, float | str] = dict.fromkeys(FIELDS, math.nan)
    out.update(n=n, batch_size=batch_size, estimator=estimator, snr_note="", g2=parts.g2, trace_sigma=parts.trace,
               trace_between=parts.between)
    if n < 2 or not math.isfinite(parts.g2):
        return out
    snr = parts.g2 * batch_size / parts.trace if parts.trace > 0 else (math.inf if parts.g2 > 0 else math.nan)
    se = lo = hi = math.nan
    if trace_se is not None:
        out["trace_sigma_se"] = trace_se
    if snr_se is not None:
        se = snr_se
        lo, hi = snr - Z90 * se, snr + Z90 * se
    resolved = snr > 0 and not (se >= snr)            # more than one standard error above 0 (or no se)
    upper = max(hi, 0.0) if math.isfinite(hi) else math.nan
    out.update(snr_se=se, snr_upper=upper)
    if not resolved:
        out.update(snr_note=BELOW_RESOLUTION, snr_lo=0.0, snr_hi=upper, b_simple_lo=_b_simple(batch_size, upper),
                   b_simple_hi=math.inf)
        return out
    lo = max(lo, 0.0) if math.isfinite(lo) else lo
    out.update(snr=snr, b_simple=_b_simple(batch_size, snr), snr_lo=lo, snr_hi=hi,
               b_simple_lo=_b_simple(batch_size, hi), b_simple_hi=_b_simple(batch_size, lo))
    return out


def _b_simple(batch: float, snr: float) -> float:
    """B_simple = B / SNR; inf where the SNR is 0."""
    if math.isnan(snr):
        return math.nan
    return batch / snr if snr > 0 else math.inf


def noise_estimate(gram: np.ndarray, n_samples: np.ndarray) -> dict[str, float | str]:
    """Pooled estimate from a Gram matrix: ``n, batch_size, g2, trace_sigma, b_simple, snr, …`` (:data:`FIELDS`)."""
    b = np.asarray(n_samples, dtype=np.float64)
    return summarize(noise_parts(gram, b), float(b.mean()) if b.size else math.nan, int(b.size))


def robust_z(values: np.ndarray, x: float | np.ndarray) -> float | np.ndarray:
    """``(x - median)/(1.4826 MAD)`` of *values* (Iglewicz & Hoaglin 1993); NaN with < 3 values or MAD 0."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < 3:
        return np.nan * np.asarray(x) if np.ndim(x) else math.nan
    med = float(np.median(v))
    scale = 1.4826 * float(np.median(np.abs(v - med)))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (np.asarray(x, dtype=np.float64) - med) / scale if scale > 0 else np.nan * np.asarray(x, dtype=np.float64)
    return float(z) if np.ndim(z) == 0 else z
