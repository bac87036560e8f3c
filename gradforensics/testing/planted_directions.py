"""Planted-truth gradients for the direction analyses (drift, oscillation, conflict).

Each factory returns a :class:`Planted`: per-record gradients of a small
transformer-shaped model with a known trouble planted in known tensors, heads
and sources, and healthy tensors beside it.  ``planted.context()`` builds the
analysis :class:`~gradforensics.analysis.contract.model.Context` directly from the arrays
(``K = X Xᵀ`` in NumPy: an oracle for the engine's Gram pass);
``planted.write(path)`` records the same data through :class:`gf.Recorder` so a
test can run ``gf.analyze`` end to end.

The model: ``n_layers`` layers, each with ``model.layers.L.self_attn.q_proj.weight``
(4 heads of 8×16, split along axis 0) and ``model.layers.L.mlp.up_proj.weight``
(16×16).  A healthy unit's record is ``g_i = G + σ ε_i``: one mean ``G`` (entries
N(0, 1), so ``|G|² ≈ d``) shared by every source, i.i.d. noise with per-record
SNR ``|G|² / E|σε|² = snr``.  ``noise_decay > 0`` makes the noise anisotropic
(variance of coordinate j ∝ (j+1)^-decay), as real gradient noise is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DIRECTION_ANALYSES", "D_HEAD", "MLP_SHAPE", "Planted", "Unit", "healthy_directions", "healthy_severities",
           "mlp_name", "planted_conflict", "planted_drift", "planted_mixture", "planted_oscillation", "q_name",
           "round_robin", "square_wave", "with_nonfinite"]


HEADS, HEAD_ROWS, COLS = 4, 8, 16
D_HEAD = HEAD_ROWS * COLS
MLP_SHAPE = (16, 16)
Unit = tuple[str, int | None]


def q_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.q_proj.weight"


def mlp_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.up_proj.weight"


@dataclass
class Planted:
    """Gradients with known truth.  ``grads[tensor]``: (N, *shape) float32."""

    grads: dict[str, np.ndarray]
    heads: dict[str, int]
    mixture: np.ndarray
    sources: tuple[str, ...]
    mode: str
    truth: dict[str, Any] = field(default_factory=dict)
    step: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.mixture.shape[0])

    def unit_matrix(self, tensor: str, head: int | None) -> np.ndarray:
        """Flattened (N, d) gradients of one unit (what the Gram pass sees)."""
        g = self.grads[tensor]
        if head is None:
            return g.reshape(self.n, -1).astype(np.float64)
        rows = g.shape[1] // self.heads[tensor]
        return g[:, head * rows:(head + 1) * rows].reshape(self.n, -1).astype(np.float64)

    def context(self, options: dict[str, Any] | None = None) -> Any:
        """The analysis context, Gram matrices computed directly in NumPy."""
        from gradforensics.analysis.contract.grams import GramResult
        from gradforensics.analysis.contract.model import Context
        from gradforensics.analysis.contract.registry import REGISTRY
        from gradforensics.store.schema import StoreMeta

        grams = {}
        for tensor in self.grads:
            for head in [None, *range(self.heads.get(tensor, 0))]:
                X = self.unit_matrix(tensor, head)
                bad = (~np.isfinite(X)).sum(axis=1)
                X = np.where((bad > 0)[:, None], 0.0, X)
                grams[(tensor, head)] = GramResult(tensor, head, X @ X.T, bad, X.shape[1])
        meta = StoreMeta(sources=self.sources, mode=self.mode, n_records=self.n)
        batches = {"step": self.steps(), "loss": np.full(self.n, np.nan, np.float32),
                   "mixture": self.mixture.astype(np.float32), "n_samples": np.full(self.n, 32, np.int32)}
        return Context(store=None, meta=meta, batches=batches, grams=grams,  # type: ignore[arg-type]
                       options={k: REGISTRY[k].options.parse(v, k) for k, v in (options or {}).items()})

    def steps(self) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64) if self.step is None else self.step

    def write(self, path: str | os.PathLike[str]) -> Any:
        """Record the gradients into a store at *path* (``.zarr`` or ``.h5``): a ``PlantedStore``."""
        from gradforensics.recording import Recorder
        from gradforensics.testing.planted import PlantedStore

        heads = {t: h for t, h in self.heads.items()}
        with Recorder(path, sources=self.sources, heads=heads, mode=self.mode, background=False) as rec:
            for i in range(self.n):
                mix = {s: float(v) for s, v in zip(self.sources, self.mixture[i]) if v > 0}
                rec.record(step=int(self.steps()[i]), loss=float("nan"), mixture=mix, n_samples=32,
                           grads={t: g[i] for t, g in self.grads.items()})
        return PlantedStore(str(path), dict(self.truth))


# ------------------------------------------------------------------ builders
def round_robin(n: int, n_sources: int) -> np.ndarray:
    """One-hot mixture rows, sources interleaved 0, 1, ..., S-1, 0, 1, ..."""
    A = np.zeros((n, n_sources), np.float32)
    A[np.arange(n), np.arange(n) % n_sources] = 1.0
    return A


def _noise(rng: np.random.Generator, n: int, d: int, snr: float, decay: float) -> np.ndarray:
    """Noise with E|ε_i|² = d / snr (so SNR = |G|²/E|ε|² with |G|² ≈ d)."""
    scale = np.ones(d) if decay <= 0 else (np.arange(1, d + 1) ** (-decay / 2.0))
    scale = scale * np.sqrt(d / (snr * np.sum(scale**2)))
    return rng.standard_normal((n, d)) * scale[rng.permutation(d)]


def _model(rng: np.random.Generator, n: int, n_layers: int, snr: float, decay: float,
           means: dict[Unit, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Healthy per-unit matrices keyed (tensor, head|None for mlp): (N, d) each.

    *means* overrides the mean of a unit with an (N, d) per-record mean.
    """
    out: dict[Unit, np.ndarray] = {}
    for layer in range(n_layers):
        for h in range(HEADS):
            out[(q_name(layer), h)] = np.broadcast_to(rng.standard_normal(D_HEAD), (n, D_HEAD)).copy()
        out[(mlp_name(layer), None)] = np.broadcast_to(rng.standard_normal(int(np.prod(MLP_SHAPE))),
                                                       (n, int(np.prod(MLP_SHAPE)))).copy()
    for key, mean in (means or {}).items():
        out[key] = mean
    for key, m in out.items():
        out[key] = m + _noise(rng, n, m.shape[1], snr, decay)
    return _assemble(out, n, n_layers)


def _assemble(units: dict[Unit, np.ndarray], n: int, n_layers: int) -> dict[str, np.ndarray]:
    grads: dict[str, np.ndarray] = {}
    for layer in range(n_layers):
        q = np.stack([units[(q_name(layer), h)].reshape(n, HEAD_ROWS, COLS) for h in range(HEADS)], axis=1)
        grads[q_name(layer)] = q.reshape(n, HEADS * HEAD_ROWS, COLS).astype(np.float32)
        grads[mlp_name(layer)] = units[(mlp_name(layer), None)].reshape(n, *MLP_SHAPE).astype(np.float32)
    return grads


def _heads(n_layers: int) -> dict[str, int]:
    return {q_name(layer): HEADS for layer in range(n_layers)}


def _unit_dim(tensor: str) -> int:
    return D_HEAD if "q_proj" in tensor else int(np.prod(MLP_SHAPE))


def _orthogonal_to(rng: np.random.Generator, v: np.ndarray) -> np.ndarray:
    """A random vector orthogonal to *v* with the same norm."""
    w = rng.standard_normal(v.size)
    w -= (w @ v) / (v @ v) * v
    return w * np.linalg.norm(v) / np.linalg.norm(w)


# ----------------------------------------------------------------- factories
def healthy_directions(seed: int = 0, snr: float = 1.0, n: int = 128, n_layers: int = 2, mode: str = "training",
                       sources: tuple[str, ...] = ("zh", "en", "code"), noise_decay: float = 0.0,
                       mixed: bool = False) -> Planted:
    """Shared mean + i.i.d. noise, identical across sources: nothing should be flagged.

    ``mixed=True`` draws Dirichlet(1) mixtures instead of round-robin pure batches.
    """
    rng = np.random.default_rng([seed, 11])
    A = rng.dirichlet(np.ones(len(sources)), size=n).astype(np.float32) if mixed else round_robin(n, len(sources))
    return Planted(_model(rng, n, n_layers, snr, noise_decay), _heads(n_layers), A, tuple(sources), mode,
                   truth={"kind": "healthy", "snr": snr})


def planted_drift(seed: int = 0, snr: float = 1.0, n: int = 128, n_layers: int = 2, since: int = 64,
                  cause: str = "rotation", layer: int = 1, mode: str = "training",
                  sources: tuple[str, ...] = ("web", "code")) -> Planted:
    """The mean gradient of ``mlp_name(layer)`` (and every head of ``q_name(layer)``) turns 90°.

    ``cause="rotation"``: from record *since* the shared mean rotates linearly
    from G to an orthogonal G' (reached at the last record), every source alike.
    ``cause="source"``: records before *since* are pure ``sources[0]``; after it
    the share of ``sources[1]`` ramps to 0.9, and in the planted tensors that
    source's mean is orthogonal to the first's (elsewhere they share G): the
    drift is a change of data mix and ``sources[1]`` is the new direction.
    """
    rng = np.random.default_rng([seed, 22])
    ramp = np.clip((np.arange(n) - since) / max(n - 1 - since, 1), 0.0, 1.0)
    if cause == "source":
        A = np.zeros((n, len(sources)), np.float32)
        A[:, 1] = 0.9 * ramp
        A[:, 0] = 1.0 - A[:, 1]
    elif cause == "rotation":
        A = round_robin(n, len(sources))
    else:
        raise ValueError(f"cause must be 'rotation' or 'source'; got {cause!r}.")
    planted = [(mlp_name(layer), None)] + [(q_name(layer), h) for h in range(HEADS)]
    means: dict[Unit, np.ndarray] = {}
    for key in planted:
        G = rng.standard_normal(_unit_dim(key[0]))
        G2 = _orthogonal_to(rng, G)
        if cause == "rotation":
            th = ramp * np.pi / 2
            means[key] = np.cos(th)[:, None] * G + np.sin(th)[:, None] * G2
        else:
            means[key] = A[:, :1] * G + A[:, 1:2] * G2
    grads = _model(rng, n, n_layers, snr, 0.0, means)
    truth = {"kind": "drift", "tensors": [mlp_name(layer), q_name(layer)], "since": since,
             "aligned_source": sources[1] if cause == "source" else None}
    return Planted(grads, _heads(n_layers), A, tuple(sources), mode, truth)


def square_wave(n: int, period: int) -> np.ndarray:
    """±1 with the given period (half a period +1, half -1); period 2 is +1, -1, +1, ..."""
    return np.where((np.arange(n) % period) < period / 2, 1.0, -1.0)


def planted_oscillation(seed: int = 0, snr: float = 1.0, n: int = 128, n_layers: int = 2, period: int = 2,
                        amplitude: float = 2.0, tensor: str | None = None, heads: tuple[int, ...] | None = (1,),
                        mode: str = "training", sources: tuple[str, ...] = ("zh", "en", "code")) -> Planted:
    """Records flip along a direction A: ``g_i = G + s_i · amplitude · A + noise``.

    ``s_i`` is a square wave of *period* records; ``|A| = |G|`` (A ⟂ G), so with
    amplitude > 1 the gradient component along A reverses sign.  Planted in
    *heads* of ``tensor`` (default ``q_name(0)``; ``heads=None`` for the whole
    tensor or an unsplit one); sources interleave round-robin, so the flip is
    not explained by them unless ``period == len(sources)``.
    """
    rng = np.random.default_rng([seed, 33])
    tensor = tensor or q_name(0)
    keys = [(tensor, h) for h in heads] if heads is not None and "q_proj" in tensor else (
        [(tensor, h) for h in range(HEADS)] if "q_proj" in tensor else [(tensor, None)])
    s = square_wave(n, period)
    means: dict[Unit, np.ndarray] = {}
    for key in keys:
        G = rng.standard_normal(_unit_dim(key[0]))
        means[key] = G[None, :] + amplitude * s[:, None] * _orthogonal_to(rng, G)[None, :]
    grads = _model(rng, n, n_layers, snr, 0.0, means)
    truth = {"kind": "oscillation", "tensor": tensor, "heads": None if heads is None else list(heads),
             "period": period}
    return Planted(grads, _heads(n_layers), round_robin(n, len(sources)), tuple(sources), mode, truth)


def planted_conflict(seed: int = 0, snr: float = 1.0, n: int = 128, n_layers: int = 3,
                     where: dict[str, tuple[int, ...] | None] | None = None, pair: tuple[str, str] = ("zh", "en"),
                     strength: float = 2.0, mode: str = "replay",
                     sources: tuple[str, ...] = ("zh", "en", "code"), mixed: bool = False) -> Planted:
    """Two sources pull opposite ways in some heads of some layers; a third agrees with neither pole.

    In the planted units the source means are ``G - strength·A`` (``pair[0]``),
    ``G + strength·A`` (``pair[1]``) and ``G`` (every other source), with
    ``A ⟂ G``, ``|A| = |G|``: ``cos(pair) = (1 - s²)/(1 + s²)`` (-0.6 at s = 2) and
    every other pair stays positively aligned.  Default *where*: heads 1 and 2 of
    ``q_name(1)`` and the whole ``mlp_name(2)``; everything else is healthy.
    ``mixed=True`` uses Dirichlet mixtures (least-squares source means).
    """
    rng = np.random.default_rng([seed, 44])
    where = {q_name(1): (1, 2), mlp_name(2): None} if where is None else where
    S = len(sources)
    A = rng.dirichlet(np.ones(S), size=n).astype(np.float32) if mixed else round_robin(n, S)
    sign = np.zeros(S)
    sign[sources.index(pair[0])], sign[sources.index(pair[1])] = -1.0, 1.0
    means: dict[Unit, np.ndarray] = {}
    for tensor, hs in where.items():
        keys = [(tensor, None)] if hs is None else [(tensor, h) for h in hs]
        for key in keys:
            G = rng.standard_normal(_unit_dim(tensor))
            D = _orthogonal_to(rng, G)
            means[key] = G[None, :] + strength * (A @ sign)[:, None] * D[None, :]
    grads = _model(rng, n, n_layers, snr, 0.0, means)
    truth = {"kind": "conflict", "where": {t: (None if h is None else list(h)) for t, h in where.items()},
             "pair": list(pair), "cosine": (1 - strength**2) / (1 + strength**2)}
    return Planted(grads, _heads(n_layers), A, tuple(sources), mode, truth)


def planted_mixture(seed: int = 0, snr: float = 4.0, n: int = 96, n_layers: int = 1,
                    sources: tuple[str, ...] = ("zh", "en", "code")) -> Planted:
    """Dirichlet-mixed batches over sources with distinct known means (for least squares).

    Every unit's record is ``Σ_s a_is M_s + noise``; ``truth["means"][(tensor, head)]``
    holds the (S, d) true source means ``M``.
    """
    rng = np.random.default_rng([seed, 55])
    S = len(sources)
    A = rng.dirichlet(np.ones(S) * 0.7, size=n).astype(np.float32)
    means: dict[Unit, np.ndarray] = {}
    truth: dict[Unit, np.ndarray] = {}
    for layer in range(n_layers):
        for key in [(q_name(layer), h) for h in range(HEADS)] + [(mlp_name(layer), None)]:
            M = rng.standard_normal((S, _unit_dim(key[0])))
            truth[key] = M
            means[key] = A.astype(np.float64) @ M
    grads = _model(rng, n, n_layers, snr, 0.0, means)
    return Planted(grads, _heads(n_layers), A, tuple(sources), "replay", {"kind": "mixture", "means": truth})


def with_nonfinite(p: Planted, tensor: str, records: list[int]) -> Planted:
    """Copy of *p* with NaN written into *records* of *tensor*."""
    grads = {t: g.copy() for t, g in p.grads.items()}
    grads[tensor][records, 0, 0] = np.nan
    return Planted(grads, p.heads, p.mixture, p.sources, p.mode, dict(p.truth), p.step)


# ---------------------------------------------------------------- calibration
DIRECTION_ANALYSES = ("drift", "oscillation", "conflict")


def healthy_severities(seeds: range | list[int], snrs: tuple[float, ...] = (0.05, 0.3, 1.0, 5.0),
                       modes: tuple[str, ...] = ("training", "replay"), analyses: tuple[str, ...] = DIRECTION_ANALYSES,
                       **kwargs: Any) -> Any:
    """Largest severity and number of flags above 0.5 per healthy store and analysis.

    Returns a DataFrame with columns ``seed, snr, mode, analysis, max_severity,
    n_units, n_flags_above_half``: the false-alarm measurement (a flag above 0.5
    on a healthy store is a false alarm).  *kwargs* go to :func:`healthy_directions`.
    """
    import importlib

    import pandas as pd

    mods = {a: importlib.import_module(f"gradforensics.analysis.{a}").ANALYSIS for a in analyses}
    rows = []
    for seed in seeds:
        for snr in snrs:
            for mode in modes:
                ctx = healthy_directions(seed=seed, snr=snr, mode=mode, **kwargs).context()
                for name, a in mods.items():
                    res = a.compute(ctx)
                    fl = a.flags(res, ctx)
                    rows.append({"seed": seed, "snr": snr, "mode": mode, "analysis": name,
                                 "max_severity": float(res.table["severity"].max()) if len(res.table) else 0.0,
                                 "n_units": len(res.table),
                                 "n_flags_above_half": sum(f.severity > 0.5 for f in fl)})
    return pd.DataFrame(rows)
