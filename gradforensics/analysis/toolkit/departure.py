"""When a per-record series leaves its own earlier level: an online departure test, and loss spikes.

Both tests see each record only against the records before it (online: what a monitor watching
the run would have said at that record), and both run on many series at once (rows of a 2-D
array, NaN where a series has no value at a record: they are skipped, not filled).

**Departure** (:func:`departures`): a one-sided CUSUM on robust z-scores.

* Each series is first put on the scale on which its changes are compared: positive,
  scale-like series (loss, gradient norms, logits, ratios) on ``log``; the others as they are
  (shares, entropies, log Z); see :data:`TRANSFORMS`.
* The robust z-score of record ``t`` is ``z_t = d (x_t - m_t) / s_t``, where ``m_t`` is the
  median of the series' last ``window`` finite values before ``t`` and
  ``s_t = max(1.4826 MAD_t, floor)``: the MAD of the same values (1.4826 makes it the standard
  deviation for Gaussian noise), floored at ``floor`` so a series that was constant does not
  divide by zero (on the log scale 0.05 is a 5 % change).  ``d`` is the direction in which
  a departure is trouble (+1: up, -1: down, for an entropy).  ``z_t`` is clipped at
  ``z_clip``: one wild record moves the statistic by at most ``z_clip - allowance``.
* No score before ``burn_in`` finite values: the test needs an earlier level to depart from.
* The CUSUM ``C_t = max(0, C_{t-1} + z_t - allowance)`` accumulates evidence of a sustained
  shift of more than ``allowance`` robust standard deviations; the series **departs** at the
  first record where ``C_t > threshold`` (the *alarm*), and its **onset** is the record after the
  last one where ``C`` was 0 before the alarm (the CUSUM's own change-point estimate: where the
  run of evidence began).
* A share (of dead units, of stale rows, of an expert's load) can jump for one record only (a
  stale row is stale at its first gradient), which the CUSUM would see only after
  ``threshold / (z_clip - allowance)`` records: such series (``shewhart=True``) also depart at the
  first record whose unclipped ``z_t`` exceeds ``limit`` (the combined Shewhart-CUSUM scheme of
  Lucas 1982); the onset is that record, or the CUSUM's start when ``C`` was already above 0.
  The limit is kept off the other series: on heavy-tailed noise (Student t, 3 degrees of
  freedom) one z-score above 9 comes in a fifth of 150-record series, the CUSUM in none.
* Growth that compounds from the run's first records drags the trailing window along with it:
  the trailing median rises with the series and the test sees only a later acceleration.  Series
  whose level at initialisation is their healthy level (``opening=True``: attention logits and
  entropies) are also tested against their **opening** level, frozen: the median / MAD of their
  first ``burn_in`` finite values, its scale floored at ``opening_floor`` times the series' floor
  (a frozen level is left by a healthy drift too: a healthy head's max logit grows by 3 units in
  its first 40 steps), the same clip, allowance and threshold, over the first ``window`` finite
  values after the burn-in only (later, a healthy slow drift would always leave a frozen level).  Its onset is the record after the last one, before its alarm, whose opening
  z-score was within the allowance (where the series left the opening band for good).  The series
  departs at whichever test alarms first (the earlier onset on a tie).  It is kept off the other
  series: a loss, a gradient norm or a log Z moves off its initial value as training starts.

**Loss spikes** (:func:`spikes`): a record whose loss exceeds ``mean + k σ`` of the ``window``
records before it (OLMo-core's stability monitor uses ``k = 6`` over the last 128 steps; a short
run uses a shorter window, :func:`trailing_window`), with at least ``burn_in`` of them finite.
Consecutive spiking records are one spike, at its first record.  An infinite loss is a spike; a NaN
loss is unknown (skipped).  Records a loss scaler skipped (``batches/skipped``, or the run's logs)
may be left out of the trailing window (``history_skip``) while still tested themselves: an
overflowing step's loss is often an outlier, and in the window its σ would hide the next spike.

The defaults (:class:`DepartureTest`) were chosen on the twin zoo's healthy runs: see
``docs/timeline.md`` for the false-alarm rate they give there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

__all__ = ["MAD_SCALE", "TRANSFORMS", "DepartureTest", "Departures", "SpikeTest", "departures", "opening_z",
           "robust_z", "spikes", "trailing_window", "transform"]

#: 1.4826 MAD is the standard deviation of Gaussian noise.
MAD_SCALE = 1.4826
#: How a series is put on the scale its changes are compared on: ``log`` (positive, scale-like values;
#: non-positive values become NaN), ``log3`` (``log(x + 3)``: excess kurtosis, >= -2), ``linear``.
TRANSFORMS = ("log", "log3", "linear")
#: Largest number of cells (series x records x window) a block of :func:`robust_z` holds at once.
_BLOCK_CELLS = 1 << 22


def trailing_window(n_records: int, longest: int = 128, shortest: int = 16, share: int = 4) -> int:
    """The trailing window for a run of *n_records*: ``longest`` (OLMo-core's 128), or a *share*-th of a
    shorter run, at least ``shortest``."""
    return int(max(shortest, min(longest, n_records // share)))


@dataclass(frozen=True)
class DepartureTest:
    """Parameters of :func:`departures` (module docstring).  ``window`` None: :func:`trailing_window`."""

    window: int | None = None
    burn_in: int = 8
    allowance: float = 2.0
    threshold: float = 20.0
    z_clip: float = 8.0
    limit: float = 9.0
    floor: float = 0.05
    opening_floor: float = 2.0

    def window_for(self, n_records: int) -> int:
        return int(self.window) if self.window else trailing_window(n_records)


@dataclass(frozen=True)
class SpikeTest:
    """Parameters of :func:`spikes`: ``mean + k σ`` of the trailing ``window`` (None: :func:`trailing_window`)."""

    k: float = 6.0
    window: int | None = None
    burn_in: int = 8

    def window_for(self, n_records: int) -> int:
        return int(self.window) if self.window else trailing_window(n_records)


@dataclass(frozen=True)
class Departures:
    """What :func:`departures` found, per series (row): ``alarm`` and ``onset`` records (-1: none),
    ``peak`` (the largest CUSUM value) and ``z`` (S, N), the robust z-scores, signed so that trouble is
    positive, unclipped (NaN where not scored)."""

    alarm: np.ndarray
    onset: np.ndarray
    peak: np.ndarray
    z: np.ndarray


def transform(x: np.ndarray, how: str) -> np.ndarray:
    """*x* on the scale named *how* (:data:`TRANSFORMS`), float64; values with no image become NaN."""
    x = np.asarray(x, np.float64)
    if how == "linear":
        return np.where(np.isfinite(x), x, np.nan)
    shift = 3.0 if how == "log3" else 0.0
    if how not in ("log", "log3"):
        raise ValueError(f"transform must be one of {TRANSFORMS}; got {how!r}.")
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(x + shift)
    return np.where(np.isfinite(y), y, np.nan)


def _trailing_finite(x: np.ndarray, window: int) -> np.ndarray:
    """(S, N, window): for each record, the series' last *window* finite values before it (NaN-padded)."""
    s, n = x.shape
    out = np.full((s, n, window), np.nan)
    for i in range(s):
        idx = np.flatnonzero(np.isfinite(x[i]))
        if not idx.size:
            continue
        vals = np.concatenate([np.full(window, np.nan), x[i, idx]])
        # count of finite values strictly before each record
        before = np.searchsorted(idx, np.arange(n), side="left")
        win = np.lib.stride_tricks.sliding_window_view(vals, window)   # win[j] = vals[j : j + window]
        out[i] = win[before]                                         # the `window` values before record t
    return out


def _nanmedian_last(a: np.ndarray) -> np.ndarray:
    """``np.nanmedian(a, axis=-1)`` (NaN where a row holds no finite value, quietly), by one sort of the stack:
    NaN sorts last, so the finite values of a row are its first ``count``; the median is the mean of its
    two middle ones, as NumPy takes it.  ``nanmedian`` of many short rows goes through masked arrays
    (about 20 times slower: most of ``timeline``'s time on a store of many tensors)."""
    if not a.shape[-1]:
        return np.full(a.shape[:-1], np.nan)
    srt = np.sort(a, axis=-1)
    count = np.isfinite(srt).sum(axis=-1)
    lo = np.take_along_axis(srt, (np.maximum(count - 1, 0) // 2)[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(srt, (count // 2)[..., None], axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, (lo + hi) / 2.0, np.nan)


def robust_z(x: np.ndarray, window: int, burn_in: int,
             floor: float | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(z, median, scale)``, each (S, N): each record against the median / MAD of the series' last
    *window* finite values before it; NaN where the record is NaN or fewer than *burn_in* came before.
    *floor*: the least scale, one for all rows or one per row."""
    x = np.atleast_2d(np.asarray(x, np.float64))
    s, n = x.shape
    floors = np.broadcast_to(np.asarray(floor, np.float64), (s,))
    z = np.full((s, n), np.nan)
    med = np.full((s, n), np.nan)
    scale = np.full((s, n), np.nan)
    rows = max(1, _BLOCK_CELLS // max(1, n * window))
    for a in range(0, s, rows):
        blk = x[a:a + rows]
        win = _trailing_finite(blk, window)
        count = np.isfinite(win).sum(axis=2)
        ok = count >= max(1, burn_in)
        m = _nanmedian_last(win)                 # all-NaN windows: NaN, masked below
        mad = _nanmedian_last(np.abs(win - m[..., None]))
        sd = np.maximum(MAD_SCALE * mad, floors[a:a + rows, None])
        zz = (blk - m) / sd
        z[a:a + rows] = np.where(ok & np.isfinite(blk), zz, np.nan)
        med[a:a + rows] = np.where(ok, m, np.nan)
        scale[a:a + rows] = np.where(ok, sd, np.nan)
    return z, med, scale


def opening_z(x: np.ndarray, burn_in: int, horizon: int, floor: float | np.ndarray) -> np.ndarray:
    """(S, N): each record against the median / MAD of the series' first *burn_in* finite values (frozen),
    scored on the *horizon* finite values after them only; NaN elsewhere.  *floor* as in :func:`robust_z`."""
    x = np.atleast_2d(np.asarray(x, np.float64))
    s, n = x.shape
    floors = np.broadcast_to(np.asarray(floor, np.float64), (s,))
    z = np.full((s, n), np.nan)
    for i in range(s):
        idx = np.flatnonzero(np.isfinite(x[i]))
        if idx.size <= burn_in:
            continue
        ref = x[i, idx[:burn_in]]
        m = np.median(ref)
        sd = max(MAD_SCALE * float(np.median(np.abs(ref - m))), float(floors[i]))
        scored = idx[burn_in:burn_in + horizon]
        z[i, scored] = (x[i, scored] - m) / sd
    return z


def _cusum(z: np.ndarray, test: DepartureTest, over: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(alarm, start, peak)`` per row of the signed z-scores *z* (S, N): the CUSUM of the module docstring;
    ``start``: the record after the last zero of C before the alarm (-1: no alarm); *over*: Shewhart hits."""
    s, n = z.shape
    clipped = np.clip(z, -test.z_clip, test.z_clip)
    c = np.zeros(s)
    start = np.zeros(s, np.int64)          # the record after the last zero of C
    alarm = np.full(s, -1, np.int64)
    onset = np.full(s, -1, np.int64)
    peak = np.zeros(s)
    for t in range(n):
        zt = clipped[:, t]
        live = np.isfinite(zt)
        nxt = np.where(live, np.maximum(0.0, c + np.where(live, zt, 0.0) - test.allowance), c)
        start = np.where(live & (c <= 0) & (nxt > 0), t, start)
        c = nxt
        peak = np.maximum(peak, c)
        hit = (alarm < 0) & ((c > test.threshold) | (False if over is None else over[:, t]))
        alarm = np.where(hit, t, alarm)
        onset = np.where(hit, np.where(c > 0, start, t), onset)
    return alarm, onset, peak


def departures(x: np.ndarray, direction: np.ndarray | int = 1, test: DepartureTest | None = None,
               floor: np.ndarray | float | None = None, shewhart: np.ndarray | bool = True,
               opening: np.ndarray | bool = False) -> Departures:
    """The first departure of each row of *x* (S, N) from its own earlier level (module docstring).

    *x* is already on its comparison scale (:func:`transform`); *direction* (+1 up, -1 down) and *floor*
    (the least robust scale, in the units of that scale; None: ``test.floor``) per row or one for all;
    *shewhart*: whether the row also departs on one z-score above ``test.limit`` (per row or one for all);
    *opening*: whether the row is also tested against its frozen opening level (per row or one for all).
    Rows are independent; the work is vectorised over rows (one loop over records).
    """
    test = test or DepartureTest()
    x = np.atleast_2d(np.asarray(x, np.float64))
    s, n = x.shape
    d = np.broadcast_to(np.asarray(direction, np.float64), (s,))
    fl = test.floor if floor is None else floor
    z, _, _ = robust_z(x, test.window_for(n), test.burn_in, fl)
    z = z * d[:, None]
    use = np.broadcast_to(np.asarray(shewhart, bool), (s,))
    over = (np.where(np.isfinite(z), z, -np.inf) > test.limit) & use[:, None]
    alarm, onset, peak = _cusum(z, test, over)
    rows = np.flatnonzero(np.broadcast_to(np.asarray(opening, bool), (s,)))
    if rows.size:
        fr = np.broadcast_to(np.asarray(fl, np.float64), (s,))[rows]
        z0 = opening_z(x[rows], test.burn_in, test.window_for(n), fr * test.opening_floor) * d[rows, None]
        a0, _, p0 = _cusum(z0, test)
        for j, i in enumerate(rows):
            peak[i] = max(peak[i], p0[j])
            if a0[j] < 0:
                continue
            band = np.flatnonzero(np.isfinite(z0[j, :a0[j] + 1]) & (z0[j, :a0[j] + 1] <= test.allowance))
            o0 = int(band[-1]) + 1 if band.size else int(np.flatnonzero(np.isfinite(z0[j]))[0])
            if alarm[i] < 0 or a0[j] < alarm[i] or (a0[j] == alarm[i] and o0 < onset[i]):
                alarm[i], onset[i] = a0[j], o0
    return Departures(alarm, onset, peak, z)


def spikes(loss: np.ndarray, test: SpikeTest | None = None, history_skip: np.ndarray | None = None) -> np.ndarray:
    """Records (int64, ascending) where a loss spike begins: above ``mean + k σ`` of the trailing window.

    *history_skip* (bool, like *loss*): records left out of every later record's window (still tested).
    """
    test = test or SpikeTest()
    y = np.asarray(loss, np.float64)
    n = y.size
    w = test.window_for(n)
    finite = np.isfinite(y)
    hist = finite if history_skip is None else finite & ~np.asarray(history_skip, bool).reshape(n)
    pad = np.concatenate([np.full(w, np.nan), np.where(hist, y, np.nan)])
    win = np.lib.stride_tricks.sliding_window_view(pad, w)[:n]          # win[t] = y[t - w : t]
    count = np.isfinite(win).sum(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(win, axis=1)
        sd = np.nanstd(win, axis=1)
    ok = count >= max(2, test.burn_in)
    up = ok & ((finite & (y > mean + test.k * sd)) | np.isinf(y))
    first = up & ~np.concatenate([[False], up[:-1]])
    return np.flatnonzero(first).astype(np.int64)
