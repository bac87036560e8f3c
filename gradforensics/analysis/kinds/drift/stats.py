"""Drift's statistics: window cosines to the opening mean, their rank trend, the debiased rotation, the change point.

The maths of :mod:`gradforensics.analysis.kinds.drift` (its docstring states them and their
references) for a slab of units, from each unit's Gram matrix ``K`` (rows in time order) and
mixture rows.  Every function over ``K`` takes one matrix or a stack ``(U, N, N)``;
:func:`drift_slab` stacks the units of one record count and mixture and runs each statistic
once over the stack, then the rank trends
(:func:`~gradforensics.analysis.toolkit.stats.rank_trends`) and the change points
(:func:`hinge_changepoints`) of the whole slab at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradforensics.analysis.toolkit import kspace as ks
from gradforensics.analysis.toolkit.stats import finite_mean, rank_trends

__all__ = ["STACK_BYTES", "UnitDrift", "cosines", "debiased_cosines", "drift_slab", "hinge_changepoints",
           "mean_coefficients", "opening_cosines", "record_cosines", "u_statistic_norms", "window_coefficients"]

STACK_BYTES = 32 * 2**20
"""Bytes of Gram matrices one stacked pass of a slab copies, at most (one unit a pass above it)."""


# ------------------------------------------------------------ coefficients
def window_coefficients(n: int, size: int) -> np.ndarray:
    """Coefficient rows (W×n) of the means of consecutive windows of *size* rows.

    A last window shorter than half a window is merged into the one before.
    """
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] < size / 2:
        starts.pop()
    bounds = [*starts, n]
    W = np.zeros((len(starts), n))
    for w in range(len(starts)):
        W[w, bounds[w]:bounds[w + 1]] = 1.0 / (bounds[w + 1] - bounds[w])
    return W


def mean_coefficients(n: int, rows: np.ndarray) -> np.ndarray:
    """Coefficient vector of the mean of the given rows."""
    a = np.zeros(n)
    rows = np.asarray(rows)
    if rows.size:
        a[rows] = 1.0 / rows.size
    return a


# ------------------------------------------------------------------ cosines
def cosines(K: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """Cosines between the vectors ``Xᵀa_i`` and ``Xᵀb_j`` (``(..., p, q)``; NaN where a norm is 0) of coefficient
    rows *A* (p×N) and *B* (q×N; None: *A*), for one K or a stack ``(..., N, N)``."""
    A = np.atleast_2d(A)
    same = B is None or B is A
    B = A if B is None else np.atleast_2d(B)
    AK = A @ K
    num = AK @ B.T
    na = np.sqrt(np.maximum(np.einsum("...ij,ij->...i", AK, A), 0.0))      # diag(A K Aᵀ) without A K Aᵀ
    nb = na if same else np.sqrt(np.maximum(np.einsum("...ij,ij->...i", B @ K, B), 0.0))
    return ks.safe_div(num, na[..., :, None] * nb[..., None, :])


def record_cosines(K: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Cosine of each record ``g_i`` with the vector ``Xᵀa`` (``(..., N)``), for one K or a stack."""
    num = K @ a
    aKa = num @ a                                                            # aᵀ K a (K symmetric)
    diag = np.diagonal(K, axis1=-2, axis2=-1)
    return ks.safe_div(num, np.sqrt(np.maximum(diag, 0.0) * np.maximum(aKa, 0.0)[..., None]))


def opening_cosines(K: np.ndarray, open_rows: np.ndarray) -> np.ndarray:
    """Per-record cosine to the opening mean; leave-one-out for the opening records (one K or a stack).

    For an opening record ``i`` the reference is the mean of the other ``w-1``
    opening records: ``cos = (S_i - K_ii) / sqrt(K_ii (T - 2 S_i + K_ii))`` with
    ``S_i = Σ_{j∈open} K_ij`` and ``T = Σ_{j,k∈open} K_jk``.
    """
    cos = record_cosines(K, mean_coefficients(K.shape[-1], open_rows))
    if open_rows.size > 1:
        sub = ks.block(K, open_rows)
        S = sub.sum(axis=-1)
        T = S.sum(axis=-1)[..., None]
        d = np.diagonal(sub, axis1=-2, axis2=-1)
        cos[..., open_rows] = ks.safe_div(S - d, np.sqrt(np.maximum(d * (T - 2 * S + d), 0.0)))
    return cos


def u_statistic_norms(K: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Unbiased ``|E g|²`` from independent records: ``Σ_{i≠j} K_ij / (n(n-1))`` (``(...)``; NaN below 2 rows).

    Equals ``|mean|² - tr(Σ̂)/n`` with the unbiased sample covariance, i.e. the
    squared norm of the window mean with the noise floor removed (Hoeffding 1948).
    """
    n = np.asarray(rows).size
    if n < 2:
        return np.full(K.shape[:-2], np.nan)
    sub = ks.block(K, rows)
    return (sub.sum(axis=(-2, -1)) - np.trace(sub, axis1=-2, axis2=-1)) / (n * (n - 1))


def debiased_cosines(K: np.ndarray, rows_a: np.ndarray, rows_b: np.ndarray) -> np.ndarray:
    """Cosine between the *population* means of two disjoint record sets (``(...)``, one K or a stack).

    ``mean_{i∈a, j∈b} K_ij / sqrt(U_a U_b)`` with U-statistic norms: free of the
    attenuation noise puts on the cosine of sample means (the disattenuated
    correlation of Spearman 1904).  NaN where either U is not positive.
    """
    ua, ub = u_statistic_norms(K, rows_a), u_statistic_norms(K, rows_b)
    cross = ks.block(K, rows_a, rows_b).mean(axis=(-2, -1))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        root = np.sqrt(ua * ub)
        ok = (ua > 0) & (ub > 0) & (root > 0)
        return np.where(ok, np.clip(cross / np.where(ok, root, 1.0), -1.0, 1.0), np.nan)


# ------------------------------------------------------------- change point
def hinge_changepoints(ys: list[np.ndarray]) -> list[tuple[int | None, float]]:
    """Least-squares fit of ``y_t = a`` (t < k), ``a + b (t - k)`` (t ≥ k), ``b < 0``, of every series of *ys*.

    Returns ``(k, b)`` minimising the residual sum of squares over every
    candidate ``k`` in ``1 .. n-2`` (NaNs are skipped), or ``(None, nan)`` when no
    candidate has a falling slope (or fewer than 4 finite values).  O(n) via suffix sums: for the
    regressor ``z_t = max(0, t - t_k)``, ``Σz``, ``Σz²`` and ``Σzy`` over ``t > t_k`` are
    polynomials in ``t_k`` of the suffix sums of ``1, t, t², y, t·y``.  The series with the same
    finite positions are fitted in one stacked pass.
    """
    out: list[tuple[int | None, float]] = [(None, math.nan)] * len(ys)
    groups: dict[bytes, list[int]] = {}
    finite = [np.isfinite(y) for y in ys]
    for i, f in enumerate(finite):
        if int(np.count_nonzero(f)) >= 4:
            groups.setdefault(np.packbits(f).tobytes() + f.size.to_bytes(8, "little"), []).append(i)
    for members in groups.values():
        t = np.flatnonzero(finite[members[0]]).astype(np.float64)
        V = np.stack([np.asarray(ys[i], dtype=np.float64)[finite[i]] for i in members])
        for i, res in zip(members, _hinge_stack(t, V), strict=True):
            out[i] = res
    return out


def _suffix(a: np.ndarray) -> np.ndarray:
    """``Σ_{j > k} a_j`` for every k along the last axis."""
    zero = np.zeros((*a.shape[:-1], 1))
    return np.concatenate((np.cumsum(a[..., ::-1], axis=-1)[..., ::-1][..., 1:], zero), axis=-1)


def _hinge_stack(t: np.ndarray, V: np.ndarray) -> list[tuple[int | None, float]]:
    """The hinge fit of every row of *V* (``(U, n)``, finite) at positions *t*."""
    n = t.size
    m, st, stt = _suffix(np.ones(n)), _suffix(t), _suffix(t * t)
    sy, sty = _suffix(V), _suffix(t * V)
    sz = st - m * t
    szz = stt - 2 * t * st + m * t * t
    szy = sty - t * sy
    vc = V - V.mean(axis=-1)[:, None]
    var_z = szz - sz**2 / n
    cov_zy = szy - sz * V.sum(axis=-1)[:, None] / n
    ok = np.zeros(n, bool)
    ok[1:n - 1] = var_z[1:n - 1] > 1e-12
    slope = np.where(ok, cov_zy / np.where(ok, var_z, 1.0), 0.0)
    ss = np.einsum("ij,ij->i", vc, vc)[:, None]
    sse = np.where(ok & (slope < 0), ss - cov_zy**2 / np.where(ok, var_z, 1.0), np.inf)
    j = np.argmin(sse, axis=-1)
    live = np.asarray(np.isfinite(sse).any(axis=-1))
    return [(int(t[k]), float(slope[u, k])) if live[u] else (None, math.nan) for u, k in enumerate(j.tolist())]


# ------------------------------------------------------------------ the slab
@dataclass
class UnitDrift:
    row: dict[str, Any]
    record_cos: np.ndarray
    window_cos: np.ndarray        # W×2: centre position, cosine


def drift_slab(slab: list[tuple[np.ndarray, np.ndarray]], window: int | None) -> list[UnitDrift]:
    """All drift statistics of every ``(K, mixture)`` of *slab* (K in time order, mixture rows alike; a single
    unit is a slab of one)."""
    out: list[UnitDrift | None] = [None] * len(slab)
    trends: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    groups: dict[tuple[int, bytes], list[int]] = {}
    for i, (K, mix) in enumerate(slab):
        n = K.shape[0]
        w = ks.window_size(n, window)
        if _windows(n, w)[0].shape[0] >= 4:
            groups.setdefault((n, np.ascontiguousarray(mix, dtype=np.float64).tobytes()), []).append(i)
        else:
            out[i] = UnitDrift({"n_records": n, "window": w}, np.full(n, np.nan), np.zeros((0, 2)))
    for (n, _), members in groups.items():
        w = ks.window_size(n, window)
        W, rows_of = _windows(n, w)
        open_rows, k = rows_of[0], max(1, (W.shape[0] - 1) // 3)
        late = np.concatenate(rows_of[-k:])
        fit = ks.shared_fit(slab[members[0]][1])
        d = (mean_coefficients(n, late) - mean_coefficients(n, open_rows))[None, :]
        step = max(1, STACK_BYTES // max(1, 8 * n * n))
        for at in range(0, len(members), step):
            part = members[at:at + step]
            Ks = np.stack([np.asarray(slab[i][0], dtype=np.float64) for i in part])
            rec = opening_cosines(Ks, open_rows)
            wcos = cosines(Ks, W, W[:1])[:, :, 0]
            wcos[:, 0] = np.nan
            align = cosines(Ks, fit.C, d)[:, :, 0] if fit.index.size >= 2 and fit.rank_ok else None
            c_db = debiased_cosines(Ks, late, open_rows)
            for j, i in enumerate(part):
                row = _row(n, w, k, wcos[j], float(c_db[j]))
                row.update(_alignment(fit, None if align is None else align[j]))
                out[i] = UnitDrift(row, rec[j], np.column_stack((_centres(n, w), wcos[j])))
                trends[i] = (rec[j, open_rows.size:], wcos[j, 1:])
    live = list(trends)
    rec_t = rank_trends([trends[i][0] for i in live], min_n=4, alternative="less", skip_nonfinite=True)
    win_t = rank_trends([trends[i][1] for i in live], min_n=4, alternative="less", skip_nonfinite=True)
    since = hinge_changepoints([out[i].record_cos for i in live])    # type: ignore[union-attr]
    for i, (rho, p), (rho_w, _), (pos, _) in zip(live, rec_t, win_t, since, strict=True):
        out[i].row.update(rho=rho, p_value=p, rho_windows=rho_w, since_pos=pos)    # type: ignore[union-attr]
    return out    # type: ignore[return-value]


def _row(n: int, w: int, k: int, wcos: np.ndarray, c_db: float) -> dict[str, Any]:
    """A tested unit's row but its trends and alignment, from its window cosines and debiased late cosine."""
    c_early, c_late = finite_mean(wcos[1:1 + k]), finite_mean(wcos[-k:])
    rotation = 1.0 - c_db if np.isfinite(c_db) else (1.0 - c_late / c_early if c_early > 0.1 else math.nan)
    return {"n_records": n, "window": w, "cos_early": c_early, "cos_late": c_late, "cos_late_debiased": c_db,
            "rotation": rotation, "rho": math.nan, "p_value": math.nan, "rho_windows": math.nan, "since_pos": None}


@functools.lru_cache(maxsize=32)
def _centres(n: int, w: int) -> np.ndarray:
    """Each window's mean row position, once per ``(n, w)``."""
    out = np.array([r.mean() for r in _windows(n, w)[1]])
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=32)
def _windows(n: int, w: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The window-mean coefficients (W×n) of *n* records in windows of *w* and each window's rows, built once
    per ``(n, w)`` for every unit (read-only)."""
    W = window_coefficients(n, w) if n else np.zeros((0, 0))
    rows_of = tuple(np.flatnonzero(W[i] > 0) for i in range(W.shape[0]))
    for a in (W, *rows_of):
        a.flags.writeable = False
    return W, rows_of


def _alignment(fit: ks.SourceFit, c: np.ndarray | None) -> dict[str, Any]:
    """Which source's mean gradient points most along the new direction (*c*: the sources' cosines to it; None
    where the mixture does not identify the sources)."""
    if c is None or not np.isfinite(c).any():
        return {"align_idx": None, "aligned_cosine": math.nan, "align_margin": math.nan}
    order = np.argsort(-np.nan_to_num(c, nan=-2.0))
    margin = float(c[order[0]] - c[order[1]]) if np.isfinite(c[order[1]]) else math.inf
    return {"align_idx": int(fit.index[order[0]]), "aligned_cosine": float(c[order[0]]), "align_margin": margin}
