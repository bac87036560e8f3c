"""The band statistics of the long-history regime: banded Gram products and the band test's window moments.

:func:`band_products` forms ``B[l, j] = <x_j, x_{j-l}>`` of a run of records;
:func:`block_moments` reduces one unit's :class:`BandBlock` to the
:class:`~gradforensics.analysis.contract.grams.WindowMoments` that oscillation's band
test reads (per window of :func:`oscillation_edges`: count, mean and centred sum of
squares of ``z = h_P · B[1:]`` for each period, ``Σ B[0]``, lag-1 cosine sums).  The
pass (:mod:`gradforensics.analysis.engine.longhistory`) calls them on
:data:`SUB_RECORDS` records at a time, so the band never outlives the task that read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gradforensics.analysis.contract.grams import Design, WindowMoments

__all__ = ["SUB_RECORDS", "BandBlock", "band_block", "band_products", "block_moments", "dense_moments",
           "lag_design", "oscillation_edges", "periods_of"]

_ROW_BLOCK = 64
SUB_RECORDS = 64 * _ROW_BLOCK
"""Records whose banded Gram is formed at once in a task (then reduced to window moments): memory per task."""


def band_products(x: np.ndarray, prev: np.ndarray | None, band: int) -> np.ndarray:
    """``B[l, j] = <x_j, x_{j-l}>`` (``0 ≤ l ≤ band``) in float64; rows before ``x`` come from *prev*.

    *x* is ``(n, f)``; *prev* the ``p ≤ band`` records just before it (or None);
    entries whose partner precedes both are 0.  Narrow rows use shifted products;
    wide rows BLAS products of ``_ROW_BLOCK`` rows against the band before them.
    """
    n = x.shape[0]
    z = x if prev is None or prev.shape[0] == 0 else np.concatenate([prev, x])
    p = z.shape[0] - n
    out = np.zeros((band + 1, n))
    if z.shape[1] <= 64:
        zz = z.astype(np.float64)
        for lag in range(band + 1):
            lo = max(0, lag - p)            # first j whose partner j - lag is in z
            if lo < n:
                out[lag, lo:] = np.einsum("ij,ij->i", zz[p + lo:], zz[p + lo - lag:p + n - lag])
        return out
    for j0 in range(0, n, _ROW_BLOCK):
        j1 = min(n, j0 + _ROW_BLOCK)
        c0 = max(0, p + j0 - band)
        P = _product(z[p + j0:p + j1], z[c0:p + j1])        # rows j0..j1 against z[c0 : p+j1]
        rows = np.arange(j0, j1)
        for lag in range(band + 1):
            cols = rows + p - lag - c0
            ok = cols >= 0
            out[lag, rows[ok]] = P[rows[ok] - j0, cols[ok]]
    return out


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ bᵀ`` in float32 over feature blocks, accumulated in float64."""
    from gradforensics.analysis.engine.gramkernel import SUB_BLOCK

    acc = np.zeros((a.shape[0], b.shape[0]))
    for s in range(0, a.shape[1], SUB_BLOCK):
        acc += a[:, s:s + SUB_BLOCK] @ b[:, s:s + SUB_BLOCK].T
    return acc


def lag_design(band: int, periods: np.ndarray) -> np.ndarray:
    """Rows ``h_P`` (one per period) of the least-squares weights of ``cos(2πl/P)`` over lags ``l = 1..band``.

    The regression of the lagged products on ``[1, l, l², cos(2πl/P)]``: ``h_P · c`` is
    the cosine coefficient of ``c(l)``, orthogonal to a constant, linear and quadratic
    trend in the lag (a mean gradient, a drifting one and a changing norm).  Built once
    per (band, periods) and shared by every unit (a read-only array).
    """
    return _lag_design(int(band), tuple(int(P) for P in np.asarray(periods).ravel()))


# kept: block_moments takes it for every unit and every SUB_RECORDS block of a long pass (tens of
# thousands of calls on a 7B-shaped store); built, it costs 1.2 ms (31 pinv at band 32), cached 4 µs
@functools.lru_cache(maxsize=16)
def _lag_design(band: int, periods: tuple[int, ...]) -> np.ndarray:
    lag = np.arange(1, band + 1, dtype=np.float64)
    x = lag / band
    out = np.zeros((len(periods), band))
    for k, P in enumerate(periods):
        X = np.c_[np.ones(band), x, x * x, np.cos(2 * np.pi * lag / P)]
        out[k] = np.linalg.pinv(X)[3]
    out.flags.writeable = False
    return out


def oscillation_edges(n: int, band: int, edges: np.ndarray) -> np.ndarray:
    """Windows of the band test: the pass's windows, merged to at least ``4 · band`` records each."""
    size = max(int(edges[1] - edges[0]) if edges.size > 1 else n, 4 * band)
    return np.unique(np.r_[np.arange(0, n, size), n]).astype(np.int64)


def periods_of(band: int) -> np.ndarray:
    """The periods the band test tries: ``2 .. band`` records."""
    return np.arange(2, int(band) + 1)


@dataclass(frozen=True)
class BandBlock:
    """The banded Gram of one unit over a run of consecutive records, with what its statistics need before it.

    ``band`` ``(L+1, n)`` (lags whose partner precedes the records the pass read are 0);
    ``nf`` the records' non-finite counts; ``nf_prev`` those of the ``≤ L`` records
    before them; ``b0_prev`` the squared norm of the record just before (0 if none).
    Partial blocks of one unit's feature columns add with ``+``.
    """

    band: np.ndarray
    nf: np.ndarray
    nf_prev: np.ndarray
    b0_prev: float

    def __add__(self, other: BandBlock) -> BandBlock:
        return BandBlock(self.band + other.band, self.nf + other.nf, self.nf_prev + other.nf_prev,
                         self.b0_prev + other.b0_prev)

    def copy(self) -> BandBlock:
        return self


def block_moments(blk: BandBlock, r0: int, d: Design) -> WindowMoments:
    """The band test's :class:`WindowMoments` of the records ``r0 ..`` of *blk* (a whole unit's band).

    A record enters a window's moments when it and its ``L`` predecessors are
    finite (``r0 + j ≥ L``); its lag-1 cosine when it and its predecessor are.
    """
    L, band = d.band, blk.band
    n, p = band.shape[1], blk.nf_prev.size
    edges = oscillation_edges(d.n, L, d.edges)
    H = lag_design(L, periods_of(L))
    bad = np.r_[blk.nf_prev > 0, blk.nf > 0]
    cum = np.r_[0, np.cumsum(bad)]
    rec = r0 + np.arange(n)
    j = np.arange(n) + p
    ok = (rec >= L) & (cum[j + 1] - cum[np.maximum(j - L, 0)] == 0)
    prev_n2 = np.r_[blk.b0_prev, band[0, :-1]]
    with np.errstate(invalid="ignore", divide="ignore"):
        den = np.sqrt(np.maximum(band[0], 0.0)) * np.sqrt(np.maximum(prev_n2, 0.0))
        cc_ok = (rec >= 1) & ~bad[j] & ~bad[np.maximum(j - 1, 0)] & (den > 1e-300)
        cc = np.clip(np.where(cc_ok, band[1] / np.where(cc_ok, den, 1.0), 0.0), -1.0, 1.0)
    nw = edges.size - 1
    out = WindowMoments.zeros(nw, H.shape[0])
    count, mean, m2, e0 = out.count.copy(), out.mean.copy(), out.m2.copy(), out.e0.copy()
    first = int(np.searchsorted(edges, r0, side="right")) - 1
    rel = np.searchsorted(edges, rec, side="right") - 1 - first        # window of each record, from *first*
    here = int(rel[-1]) + 1
    cc_sum, cc_n = out.cc_sum.copy(), out.cc_n.copy()
    cc_sum[first:first + here] = np.bincount(rel, weights=np.where(cc_ok, cc, 0.0), minlength=here)
    cc_n[first:first + here] = np.bincount(rel, weights=cc_ok.astype(np.float64), minlength=here)
    cols = np.flatnonzero(ok)
    if cols.size:                       # per window: two-pass mean and centred sum of squares of z
        present, starts = np.unique(rel[cols], return_index=True)
        k = np.diff(np.r_[starts, cols.size])
        Z = H @ band[1:, cols]
        mu = np.add.reduceat(Z, starts, axis=1) / k
        D = Z - np.repeat(mu, k, axis=1)
        at = first + present
        count[at], mean[at] = k, mu.T
        m2[at] = np.add.reduceat(D * D, starts, axis=1).T
        e0[at] = np.add.reduceat(band[0, cols], starts)
    return WindowMoments(count, mean, m2, e0, cc_sum, cc_n)


def dense_moments(band: np.ndarray, nonfinite: np.ndarray, d: Design) -> WindowMoments:
    """:func:`block_moments` of a whole unit's band over all ``d.n`` records (e.g. computed outside the pass)."""
    return block_moments(BandBlock(np.nan_to_num(np.asarray(band, dtype=np.float64)),
                                   np.asarray(nonfinite, dtype=np.int64), np.zeros(0, np.int64), 0.0), 0, d)


def _before(pv: np.ndarray, x: np.ndarray, s0: int, L: int) -> np.ndarray:
    """The ``≤ L`` rows before row *s0* of *x* (*pv*: the rows the pass read before *x*)."""
    k = min(s0, L)
    own = x[s0 - k:s0]
    rest = L - k
    if rest and pv.shape[0]:
        own = np.concatenate([pv[max(0, pv.shape[0] - rest):], own])
    return own


def band_block(xf: np.ndarray, nf: np.ndarray, pv: np.ndarray, pnf: np.ndarray, s0: int, s1: int,
                L: int, b0_prev: float | None) -> BandBlock:
    prev = _before(pv, xf, s0, L)
    nprev = _before(pnf, nf, s0, L)
    if b0_prev is None:
        b0_prev = float(band_products(prev[-1:], None, 0)[0, 0]) if prev.shape[0] else 0.0
    return BandBlock(band_products(xf[s0:s1], prev, L), nf[s0:s1], nprev, b0_prev)
