"""Peaks of a tested periodogram: multiple-testing corrections, refined frequencies, harmonics.

What :func:`~gradforensics.analysis.toolkit.signal.spectrum.line_spectrum` and the coherence
analysis do with the bins once each has its p-value: :func:`adjust_pvalues` corrects them
over the tested band (Benjamini–Hochberg step-up or Bonferroni), :func:`local_maxima` finds the
candidate bins, :func:`refine_frequency`
places a peak on the zero-padded Hann periodogram of the whole series, :func:`group_harmonics`
files peaks under their fundamental, and :class:`Peak` is what is reported of each.

References
----------
Benjamini, Y. & Hochberg, Y. (1995). Controlling the false discovery rate.
    J. R. Stat. Soc. B 57, 289–300.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradforensics.analysis.toolkit.signal.welch import hann

__all__ = ["CORRECTIONS", "Peak", "adjust_pvalues", "group_harmonics", "local_maxima", "refine_frequency"]


CORRECTIONS = ("bh", "bonferroni")


def adjust_pvalues(p: np.ndarray, method: str = "bh") -> np.ndarray:
    """Multiple-testing adjusted p-values (Benjamini–Hochberg step-up or Bonferroni)."""
    p = np.asarray(p, dtype=float)
    m = p.size
    if m == 0:
        return p.copy()
    if method == "bonferroni":
        return np.minimum(1.0, p * m)
    order = np.argsort(p)
    ranked = p[order] * m / np.arange(1, m + 1)
    ranked = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(1.0, ranked)
    return out


def local_maxima(x: np.ndarray) -> np.ndarray:
    """Indices of the local maxima of *x*: every sample, or run of equal samples (its middle, rounded down),
    with a smaller sample on each side; the first and last samples excluded (``scipy.signal.find_peaks(x)[0]``)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 3:
        return np.zeros(0, dtype=np.intp)
    starts = np.flatnonzero(np.r_[True, x[1:] != x[:-1]])         # the runs of equal values
    ends = np.r_[starts[1:], x.size] - 1
    v = x[starts]
    top = np.zeros(v.size, dtype=bool)
    top[1:-1] = (v[1:-1] > v[:-2]) & (v[1:-1] > v[2:])
    return np.asarray((starts[top] + ends[top]) // 2, dtype=np.intp)


@dataclass(frozen=True)
class Peak:
    """One local maximum of ``P/B`` in the tested band (frequencies in cycles/sample)."""

    bin: int
    frequency: float          # refined on the full-length tapered periodogram
    power: float              # Welch density at the peak bin
    background: float
    p_value: float
    p_adjusted: float
    significant: bool
    excess: float             # variance above background in the peak's main lobe (±2 bins)
    amplitude: float          # sinusoid amplitude implied by ``excess``, undone for the detrender's gain
    harmonic_of: int | None = None   # index (in the peak list) of the fundamental
    harmonic_number: int = 1

    @property
    def ratio(self) -> float:
        return self.power / self.background if self.background > 0 else float("inf")


def refine_frequency(r: np.ndarray, f0: float, half_width: float) -> float:
    """Frequency of the maximum of the Hann-tapered, zero-padded periodogram of *r*
    within ``f0 ± half_width`` (parabolic interpolation of log power)."""
    n = r.size
    nfft = 1 << int(np.ceil(np.log2(8 * n)))
    spec = np.abs(np.fft.rfft((r - r.mean()) * hann(n), nfft)) ** 2
    f = np.arange(spec.size) / nfft
    sel = np.flatnonzero((f >= max(f0 - half_width, 0.5 * f0)) & (f <= f0 + half_width))
    if sel.size == 0:
        return f0
    k = int(sel[np.argmax(spec[sel])])
    if 0 < k < spec.size - 1 and np.all(spec[k - 1:k + 2] > 0):
        a, b, c = np.log(spec[k - 1:k + 2])
        den = a - 2 * b + c
        delta = 0.5 * (a - c) / den if den < 0 else 0.0
        return float((k + np.clip(delta, -0.5, 0.5)) / nfft)
    return float(f[k])


def group_harmonics(freqs: list[float], tol: float, max_number: int = 16) -> list[tuple[int | None, int]]:
    """For peaks at *freqs* (any order): ``(index of fundamental or None, harmonic number)``.

    Peak j is harmonic ``n`` (2 ≤ n ≤ *max_number*) of the lowest-frequency
    peak i with ``|f_j − n f_i| ≤ tol`` (half a Welch bin: both frequencies are
    refined well below that).
    """
    order = sorted(range(len(freqs)), key=lambda i: freqs[i])
    out: list[tuple[int | None, int]] = [(None, 1)] * len(freqs)
    fundamentals: list[int] = []
    for j in order:
        for i in fundamentals:
            n = int(np.rint(freqs[j] / freqs[i]))
            if 2 <= n <= max_number and abs(freqs[j] - n * freqs[i]) <= tol:
                out[j] = (i, n)
                break
        else:
            fundamentals.append(j)
    return out
