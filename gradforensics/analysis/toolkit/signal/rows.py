"""The per-series library calls of the loss-curve analyses, over many same-length series at once.

A store of thousands of tensors has thousands of gradient-norm series of one length, each
detrended by the same Savitzky–Golay window, transformed by the same Welch segments and
fitted against the same gain grid.  Each function here runs one step for a whole stack
of such series (one row a series) and gives every row the floats the single call gives
it, bit for bit:

* :func:`savgol_rows` - ``scipy.signal.savgol_filter(z, w, 3, mode="interp")`` per row:
  SciPy's interior correlation (``scipy.ndimage.convolve1d`` along the last axis, which
  filters each row as the 1-d call does) and its edge fits (``polyfit`` of a cubic on the
  first and last *w* samples, the least squares by
  :func:`~gradforensics.analysis.toolkit.stacked.lstsq_each`, equal to SciPy's ``lstsq`` to
  rounding, then Horner's rule as SciPy's ``polyval``);
* :func:`welch_rows` - ``scipy.signal.welch`` of the stack along its last axis;
* :func:`ar1_roots` - :func:`~gradforensics.analysis.toolkit.signal.background.fit_ar1`'s
  root search for every row: Brent's method as SciPy's ``brentq`` steps it (its
  compiled ``brentq.c``), all rows in lockstep, the model evaluated for every row still
  searching in one ``irfft`` of a 2-d array (NumPy transforms each row as the 1-d call).

Each caller checks the first row of a stack against the single call and keeps the
single calls if they differ (another SciPy, another LAPACK); ``tests/test_series_batched.py``
holds every function against the library over thousands of random rows and the edge cases.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from gradforensics.analysis.toolkit.stacked import lstsq_each

__all__ = ["ar1_roots", "brentq_rows", "lstsq_items", "savgol_rows", "welch_rows"]


# ------------------------------------------------------------ Savitzky-Golay
def savgol_rows(Z: np.ndarray, coeffs: np.ndarray) -> np.ndarray | None:
    """``savgol_filter(z, w, 3, mode="interp")`` for every row *z* of *Z* ``(U, n)`` (``w = coeffs.size``);
    None where a fit fails (a series holding a non-finite value)."""
    from scipy.ndimage import convolve1d

    Z = np.ascontiguousarray(Z, dtype=np.float64)
    U, n = Z.shape
    w = coeffs.size
    half = w // 2
    out = convolve1d(Z, coeffs, axis=-1, mode="constant")
    lhs, scale = _edge_design(w)
    rcond = w * np.finfo(np.float64).eps           # polyfit's default: len(x) * eps
    for start, lo, hi in ((0, 0, half), (n - w, n - half, n)):
        c = lstsq_each(lhs, Z[:, start:start + w], rcond) / scale
        i = np.arange(lo - start, hi - start, dtype=np.float64)
        v = np.zeros((U, i.size))
        for j in range(4):                          # polyval: y = y * x + p[j], highest power first
            v = v * i + c[:, j:j + 1]
        out[:, lo:hi] = v / 1.0                     # SciPy divides by delta ** deriv = 1.0
    return np.asarray(out)


def lstsq_items(A: np.ndarray, B: np.ndarray, rcond: float) -> np.ndarray | None:
    """``[np.linalg.lstsq(A, b, rcond)[0] for b in B]`` for one design *A* ``(m, k)`` and rows *B* ``(U, m)``:
    None where a row is not finite (``lstsq`` would fail on it)."""
    B = np.asarray(B, dtype=np.float64)
    if not np.isfinite(B).all():
        return None
    return lstsq_each(A, B, rcond)


@lru_cache(maxsize=64)
def _edge_design(w: int) -> tuple[np.ndarray, np.ndarray]:
    """SciPy polyfit's scaled Vandermonde matrix of ``x = 0..w-1`` (degree 3) and its column scale."""
    x = np.arange(0, w, dtype=np.float64)
    powers = np.flip(np.arange(4, dtype=np.float64))
    lhs = x[:, None] ** powers[None, :]
    scale = np.sqrt(np.sum(lhs * lhs, axis=0))
    lhs /= scale
    lhs.setflags(write=False)
    scale.setflags(write=False)
    return lhs, scale


# --------------------------------------------------------------------- Welch
def welch_rows(R: np.ndarray, window: np.ndarray, nperseg: int) -> tuple[np.ndarray, np.ndarray]:
    """``scipy.signal.welch(r, fs=1, window=window, nperseg, noverlap=nperseg // 2, detrend=False)`` of every row
    (:func:`~gradforensics.analysis.toolkit.signal.replicas.welch_density` on the stack)."""
    from gradforensics.analysis.toolkit.signal.replicas import welch_density

    return welch_density(np.ascontiguousarray(R, dtype=np.float64), window, nperseg)


# ------------------------------------------------------------------- brentq
def brentq_rows(f: Callable[[np.ndarray, np.ndarray], np.ndarray], xa: float, xb: float, fa: np.ndarray,
                fb: np.ndarray, xtol: float, rtol: float = 4 * np.finfo(float).eps, maxiter: int = 100,
                on_swap: Callable[[np.ndarray, str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Brent's root search of SciPy's ``brentq`` for many functions at once: ``(roots, converged)``.

    Row *u* searches ``f_u`` on ``[xa, xb]`` with ``f_u(xa) = fa[u]``, ``f_u(xb) = fb[u]`` of
    opposite signs, both non-zero.  ``f(x, rows)`` evaluates ``f_u(x[k])`` for ``u = rows[k]``.
    Every step is the compiled ``brentq``'s, in its order of floating-point operations, so
    each root is the one ``brentq(f_u, xa, xb, xtol=xtol, rtol=rtol, maxiter=maxiter)``
    returns; a row that has not converged after *maxiter* steps (where ``brentq`` raises)
    or whose function gave NaN is returned with ``converged`` False.  *on_swap(mask, what)*
    is told of every move of the three points (``"blk=pre"``, ``"swap"``, ``"pre=cur"``,
    ``"cur"``), so a caller can carry what it keeps of each point along.
    """
    U = fa.size
    xpre, xcur = np.full(U, float(xa)), np.full(U, float(xb))
    fpre, fcur = np.array(fa, dtype=np.float64), np.array(fb, dtype=np.float64)
    xblk, fblk, spre, scur = np.zeros(U), np.zeros(U), np.zeros(U), np.zeros(U)
    root, ok = np.full(U, np.nan), np.zeros(U, dtype=bool)
    live = ~(np.isnan(fpre) | np.isnan(fcur))
    note = on_swap or (lambda mask, what: None)
    with np.errstate(all="ignore"):
        for _ in range(int(maxiter)):
            if not live.any():
                break
            m = live & (fpre * fcur < 0)
            xblk, fblk = np.where(m, xpre, xblk), np.where(m, fpre, fblk)
            spre, scur = np.where(m, xcur - xpre, spre), np.where(m, xcur - xpre, scur)
            note(m, "blk=pre")
            s = live & (np.abs(fblk) < np.abs(fcur))
            xpre, xcur, xblk = np.where(s, xcur, xpre), np.where(s, xblk, xcur), np.where(s, xcur, xblk)
            fpre, fcur, fblk = np.where(s, fcur, fpre), np.where(s, fblk, fcur), np.where(s, fcur, fblk)
            note(s, "swap")
            delta = (xtol + rtol * np.abs(xcur)) / 2
            sbis = (xblk - xcur) / 2
            done = live & ((fcur == 0) | (np.abs(sbis) < delta))
            root[done], ok[done] = xcur[done], True
            live &= ~done
            if not live.any():
                break
            stry = np.where(xpre == xblk, -fcur * (xcur - xpre) / (fcur - fpre), _extrapolated(
                xpre, xcur, xblk, fpre, fcur, fblk))
            cap = 3 * np.abs(sbis) - delta
            cap = np.where(np.abs(spre) < cap, np.abs(spre), cap)        # C's MIN(a, b): a < b ? a : b
            try_step = (np.abs(spre) > delta) & (np.abs(fcur) < np.abs(fpre))
            good = try_step & (2 * np.abs(stry) < cap)
            spre, scur = np.where(good, scur, sbis), np.where(good, stry, sbis)
            xpre, fpre = np.where(live, xcur, xpre), np.where(live, fcur, fpre)
            note(live, "pre=cur")
            step = np.where(np.abs(scur) > delta, scur, np.where(sbis > 0, delta, -delta))
            xcur = np.where(live, xcur + step, xcur)
            rows = np.flatnonzero(live)
            fcur[rows] = f(xcur[rows], rows)
            note(live, "cur")
            live &= ~np.isnan(fcur)
    return root, ok


def _extrapolated(xpre, xcur, xblk, fpre, fcur, fblk):  # type: ignore[no-untyped-def]
    """brentq.c's inverse quadratic extrapolation step (its operations, in its order)."""
    dpre = (fpre - fcur) / (xpre - xcur)
    dblk = (fblk - fcur) / (xblk - xcur)
    return -fcur * (fblk * dblk - fpre * dpre) / (dblk * dpre * (fblk - fpre))


# ---------------------------------------------------------------- AR(1) fit
def ar1_roots(rho: np.ndarray, grid, lo: float, hi: float, keep: int, xtol: float = 1e-6
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``fit_ar1``'s α for every lag-1 autocorrelation in *rho*: ``(alpha, acov, converged)``.

    The model ``ρ(α) = γ(1)/γ(0)`` is *grid*'s
    (:class:`~gradforensics.analysis.toolkit.signal.background.GainGrid`) autocovariance,
    ``grid.acov(α, ·)`` bit for bit, evaluated for all rows still searching in one 2-d
    inverse FFT.  ``acov[u]`` holds lags ``0..keep-1`` at ``alpha[u]`` (the ones the
    root's own evaluation gave); ``rho`` outside ``(ρ(lo), ρ(hi))`` takes the bracket end,
    as :func:`fit_ar1` does.
    """
    keep = max(int(keep), 2)
    g_lo, g_hi = grid.acov(lo, keep), grid.acov(hi, keep)
    m_lo, m_hi = float(g_lo[1] / g_lo[0]), float(g_hi[1] / g_hi[0])
    alpha = np.where(rho <= m_lo, lo, hi).astype(np.float64)
    acov = np.where((rho <= m_lo)[:, None], g_lo, g_hi)
    ok = ~np.isnan(rho)                # fit_ar1 searches with a NaN ρ and brentq raises: the caller's single call
    inside = np.flatnonzero((rho > m_lo) & (rho < m_hi))
    if inside.size == 0:
        return alpha, acov, ok
    r_in = rho[inside]
    pts = {"pre": np.tile(g_lo, (inside.size, 1)), "cur": np.tile(g_hi, (inside.size, 1)),
           "blk": np.zeros((inside.size, keep))}
    fresh: dict[str, np.ndarray] = {}

    def model(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        full = _acov_rows(grid, x)
        fresh["rows"], fresh["acov"] = rows, full[:, :keep]
        return full[:, 1] / full[:, 0] - r_in[rows]

    def carry(mask: np.ndarray, what: str) -> None:
        p = pts
        if what == "blk=pre":
            p["blk"] = np.where(mask[:, None], p["pre"], p["blk"])
        elif what == "swap":
            pre, cur, blk = p["pre"], p["cur"], p["blk"]
            p["pre"], p["cur"], p["blk"] = (np.where(mask[:, None], cur, pre), np.where(mask[:, None], blk, cur),
                                            np.where(mask[:, None], cur, blk))
        elif what == "pre=cur":
            p["pre"] = np.where(mask[:, None], p["cur"], p["pre"])
        else:
            p["cur"][fresh["rows"]] = fresh["acov"]

    root, conv = brentq_rows(model, lo, hi, m_lo - r_in, m_hi - r_in, xtol, on_swap=carry)
    alpha[inside], acov[inside], ok[inside] = root, pts["cur"], conv
    return alpha, acov, ok


def _acov_rows(grid, alpha: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """``GainGrid.acov``'s full autocovariance for each α (its three operations, then one 2-d ``irfft``)."""
    alpha = np.asarray(alpha, dtype=np.float64)[:, None]
    den = np.multiply(2.0 * alpha, grid.cos)
    np.subtract(1.0 + alpha * alpha, den, out=den)
    return np.fft.irfft(np.divide(grid.gain, den, out=den), n=grid.m, axis=-1)
