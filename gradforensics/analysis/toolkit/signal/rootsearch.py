"""Brent's root search stepped for many functions at once: the AR(1) fits of many series.

:func:`~gradforensics.analysis.toolkit.signal.background.fit_ar1` finds each series'
AR(1) coefficient with ``scipy.optimize.brentq``, one 16,384-point inverse FFT per
step; a store of 2,000 tensors ran 2,000 of those searches one after the other,
each step a Python call.  :func:`brentq_many` runs the same searches side by side:
every step evaluates all the unfinished ones in one batched call (one inverse FFT of
many rows), and each search takes exactly the steps SciPy's ``brentq`` takes (its C
code, ``scipy/optimize/Zeros/brentq.c``, transcribed operation by operation in
float64), so each root is the one ``brentq`` returns, bit for bit
(``tests/test_small_tensor_costs.py`` compares them).

A search that has converged is frozen: later steps of the others never touch it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["RTOL", "brentq_many"]

#: SciPy's default (and smallest allowed) relative tolerance, ``4 · eps``.
RTOL = 4 * float(np.finfo(float).eps)


def brentq_many(f: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], lo: float, hi: float,
                f_lo: np.ndarray, f_hi: np.ndarray, extra_lo: np.ndarray, extra_hi: np.ndarray,
                xtol: float, maxiter: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Roots in ``[lo, hi]`` of K functions, as ``scipy.optimize.brentq(f_k, lo, hi, xtol=xtol)`` finds each.

    Parameters
    ----------
    f
        ``f(x, which) -> (values, extra)``: the functions numbered *which* at the points
        *x* (one each), and a row of extra numbers per point (kept for the root).
    f_lo, f_hi
        The K functions' values at *lo* and *hi* (of opposite signs, or zero).
    extra_lo, extra_hi
        The extra rows at *lo* and *hi* (K × L).

    Returns
    -------
    roots, extra
        The K roots and the extra row of each root's own evaluation.

    Raises
    ------
    ValueError
        ``f(lo)`` and ``f(hi)`` have the same sign, or a value is NaN (as ``brentq``).
    RuntimeError
        A search did not converge in *maxiter* steps (as ``brentq``).
    """
    xpre, xcur = np.full(f_lo.shape, float(lo)), np.full(f_lo.shape, float(hi))
    fpre, fcur = np.array(f_lo, dtype=float), np.array(f_hi, dtype=float)
    epre, ecur = np.array(extra_lo, dtype=float), np.array(extra_hi, dtype=float)
    root, eroot = np.zeros_like(xpre), np.zeros_like(epre)
    done = (fpre == 0) | (fcur == 0)
    at_lo = fpre == 0
    at_hi = (fcur == 0) & ~at_lo
    root[at_lo], eroot[at_lo] = xpre[at_lo], epre[at_lo]
    root[at_hi], eroot[at_hi] = xcur[at_hi], ecur[at_hi]
    if np.any(~done & (fpre * fcur > 0)):
        raise ValueError("f(a) and f(b) must have different signs")
    xblk, fblk, eblk = np.zeros_like(xpre), np.zeros_like(fpre), np.zeros_like(epre)
    spre, scur = np.zeros_like(xpre), np.zeros_like(xpre)
    for _ in range(maxiter):
        act = ~done
        if not act.any():
            return root, eroot
        rebr = act & (fpre * fcur < 0)
        xblk[rebr], fblk[rebr], eblk[rebr] = xpre[rebr], fpre[rebr], epre[rebr]
        spre[rebr] = scur[rebr] = xcur[rebr] - xpre[rebr]
        sw = act & (np.abs(fblk) < np.abs(fcur))
        xpre[sw], xcur[sw], xblk[sw] = xcur[sw], xblk[sw], xcur[sw]
        fpre[sw], fcur[sw], fblk[sw] = fcur[sw], fblk[sw], fcur[sw]
        epre[sw], ecur[sw], eblk[sw] = ecur[sw], eblk[sw], ecur[sw]
        delta = (xtol + RTOL * np.abs(xcur)) / 2
        sbis = (xblk - xcur) / 2
        conv = act & ((fcur == 0) | (np.abs(sbis) < delta))
        root[conv], eroot[conv] = xcur[conv], ecur[conv]
        done |= conv
        act &= ~conv
        if not act.any():
            return root, eroot
        _step(act, xpre, xcur, xblk, fpre, fcur, fblk, spre, scur, delta, sbis)
        epre[act] = ecur[act]
        which = np.flatnonzero(act)
        fx, ex = f(xcur[which], which)
        if np.any(np.isnan(fx)):
            raise ValueError(f"The function value at x={xcur[which][np.isnan(fx)][0]:f} is NaN; solver cannot "
                             "continue.")
        fcur[which], ecur[which] = fx, ex
    if np.any(~done):
        raise RuntimeError(f"Failed to converge after {maxiter} iterations, value is {xcur[~done][0]}.")
    return root, eroot


def _step(act: np.ndarray, xpre: np.ndarray, xcur: np.ndarray, xblk: np.ndarray, fpre: np.ndarray,
          fcur: np.ndarray, fblk: np.ndarray, spre: np.ndarray, scur: np.ndarray, delta: np.ndarray,
          sbis: np.ndarray) -> None:
    """One Brent step of the searches in *act*, in place: inverse quadratic / secant step or bisection."""
    use = act & (np.abs(spre) > delta) & (np.abs(fcur) < np.abs(fpre))
    with np.errstate(all="ignore"):          # lanes not taken may divide by zero; their values are discarded
        s_int = -fcur * (xcur - xpre) / (fcur - fpre)
        dpre = (fpre - fcur) / (xpre - xcur)
        dblk = (fblk - fcur) / (xblk - xcur)
        s_ext = -fcur * (fblk * dblk - fpre * dpre) / (dblk * dpre * (fblk - fpre))
        stry = np.where(xpre == xblk, s_int, s_ext)
        bound = np.minimum(np.abs(spre), 3 * np.abs(sbis) - delta)
        good = use & (2 * np.abs(stry) < bound)
    new_spre = np.where(good, scur, sbis)
    new_scur = np.where(good, stry, sbis)
    spre[act], scur[act] = new_spre[act], new_scur[act]
    xpre[act], fpre[act] = xcur[act], fcur[act]
    move = np.where(np.abs(scur) > delta, scur, np.where(sbis > 0, delta, -delta))
    xcur[act] = xcur[act] + move[act]
