"""Long training-mode stores with planted truth: what the long-history regime must find.

:func:`long_history_store` writes ``n`` records (up to hundreds of thousands:
each tensor holds a few floats) through :class:`gradforensics.Recorder`, in
training mode, with two sources drawn at random per record (so a source
conflict is not also a period-2 alternation of the record sequence):

* ``layers.0.osc.weight`` - a period-``periods[0]`` square-wave flip along a
  fixed direction, only over records ``[0.40 n, 0.60 n)``;
* ``layers.1.osc.weight`` - the same at period ``periods[1]`` over ``[0.70 n, 0.80 n)``;
* ``layers.2.drift.weight`` - a slowly rotating mean: the mean turns by 90°
  from the first record to the last (a drift, never an oscillation);
* ``layers.3.conflict.weight`` - a shared mean until ``0.5 n``, then source
  ``a`` adds ``+c`` and ``b`` adds ``-c`` (``|c| = 3 |m|``, orthogonal to the mean);
* ``layers.4.healthy.weight``, ``layers.5.healthy.weight`` - a fixed mean plus
  i.i.d. noise: nothing to find.

Every tensor carries i.i.d. Gaussian noise of per-record SNR ``snr``
(``|m|² / E|e|²``).  ``truth`` says where each planted effect is.
"""

from __future__ import annotations

import os

import numpy as np

from gradforensics.testing.planted import PlantedStore, write_store

__all__ = ["HEALTHY", "long_history_store"]

D = 8
OSC = ("layers.0.osc.weight", "layers.1.osc.weight")
DRIFT = "layers.2.drift.weight"
CONFLICT = "layers.3.conflict.weight"
HEALTHY = ("layers.4.healthy.weight", "layers.5.healthy.weight")
SOURCES = ("a", "b")


def _unit(rng: np.random.Generator, d: int = D) -> np.ndarray:
    v = rng.standard_normal(d)
    return v / np.linalg.norm(v)


def _square(n: int, period: int) -> np.ndarray:
    return np.where((np.arange(n) % period) < period / 2, 1.0, -1.0)


def long_history_arrays(n: int, seed: int = 0, snr: float = 0.5,
                        periods: tuple[int, int] = (2, 8)) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """The planted per-record gradients ``{tensor: (n, D)}``, the source of each record and the truth."""
    rng = np.random.default_rng(seed)
    sigma = 1.0 / np.sqrt(snr * D)              # |m| = 1, E|e|² = D σ² = 1/snr
    src = rng.integers(0, 2, n)
    out: dict[str, np.ndarray] = {}
    truth: dict = {"n": n, "snr": snr, "oscillation": {}, "healthy": list(HEALTHY)}
    for k, (name, lo, hi) in enumerate(((OSC[0], 0.40, 0.60), (OSC[1], 0.70, 0.80))):
        m, v = _unit(rng), _unit(rng)
        wave = np.zeros(n)
        a, b = int(lo * n), int(hi * n)
        wave[a:b] = _square(b - a, periods[k])
        out[name] = m + 2.0 * wave[:, None] * v
        truth["oscillation"][name] = {"period": periods[k], "records": (a, b - 1)}
    u, w = _unit(rng), _unit(rng)
    w = w - (w @ u) * u
    w /= np.linalg.norm(w)
    theta = np.linspace(0.0, np.pi / 2, n)
    out[DRIFT] = np.cos(theta)[:, None] * u + np.sin(theta)[:, None] * w
    truth["drift"] = DRIFT
    m, c = _unit(rng), _unit(rng)
    c = 3.0 * (c - (c @ m) * m) / np.linalg.norm(c - (c @ m) * m)
    sign = np.where(src == 0, 1.0, -1.0)
    late = np.arange(n) >= n // 2
    out[CONFLICT] = m + (late * sign)[:, None] * c
    truth["conflict"] = {"tensor": CONFLICT, "since": n // 2, "sources": SOURCES}
    for name in HEALTHY:
        out[name] = np.broadcast_to(_unit(rng), (n, D)).copy()
    for name in out:
        out[name] = (out[name] + sigma * rng.standard_normal((n, D))).astype(np.float32)
    return out, src, truth


def long_history_store(path: str | os.PathLike[str], n: int = 100_000, seed: int = 0, snr: float = 0.5,
                       periods: tuple[int, int] = (2, 8)) -> PlantedStore:
    """Write the planted long training-mode store (see the module docstring) at *path*."""
    grads, src, truth = long_history_arrays(n, seed, snr, periods)
    return write_store(path, lambda i, s, rng: {t: g[i] for t, g in grads.items()}, n, SOURCES,
                       seed=seed, source_of=lambda i: SOURCES[int(src[i])], truth=truth,
                       records_per_chunk=min(4096, max(64, n // 16)))
