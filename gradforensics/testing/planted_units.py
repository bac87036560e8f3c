"""Planted-truth stores for the saturation, spectral and precision analyses.

Each factory writes a small store through :class:`gradforensics.Recorder` in which
exactly the named modules or tensors are sick, among healthy ones, and returns a
:class:`Planted` that says which.  With the trouble switched off the same factory
writes a healthy control.  :func:`run_analysis` runs one analysis the way the
engine does (its lazy graph in one ``dask.compute``, then ``compute`` and
``flags``), without the Gram pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ACTIVATIONS", "BOUNDS", "PUSH", "Planted", "activation", "planted_precision_store", "planted_saturation_store",
           "planted_spectral_store", "powerlaw_matrix", "run_analysis"]


ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")
BOUNDS = {"tanh": (-1.0, 1.0), "sigmoid": (0.0, 1.0)}
#: The planted push per activation: 6, plus about 2.5 per unit of depth of its floor (the pre-activation
#: below which its output is near zero on every token: ReLU 0, GELU -1.5, SiLU -3.3).
PUSH = {"relu": 6.0, "gelu": 10.0, "silu": 14.0, "tanh": 6.0, "sigmoid": 6.0}


@dataclass(frozen=True)
class Planted:
    """Where the trouble was planted: the names that must be flagged, and the healthy ones."""

    path: str
    sick: tuple[str, ...]
    healthy: tuple[str, ...]
    onset: int | None = None
    sources: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The activation *name* applied to pre-activations *x*."""
    from scipy.special import erf, expit

    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))
    if name == "silu":
        return x * expit(x)
    if name == "tanh":
        return np.tanh(x)
    if name == "sigmoid":
        return expit(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}.")


# ------------------------------------------------------------------ saturation
def planted_saturation_store(path: str | os.PathLike[str], act: str = "gelu", *, polarise: bool = True,
                             n_records: int = 96, onset: int = 40, units: int = 64, tokens: int = 128,
                             sources: tuple[str, ...] = ("en", "zh", "code"), culprit: str = "code",
                             healthy: tuple[str, ...] = ("relu", "gelu", "silu", "tanh", "sigmoid"),
                             push: float | None = None, others: float = 0.4, drift: float = 0.0,
                             mode: str = "training", seed: int = 0, dying: float | None = None) -> Planted:
    """One module (activation *act*) whose units are pushed to its poles after *onset*.

    Pre-activations are ``z + b_u (+ m_t c_u)``, ``z ~ N(0, 1)`` per token, fixed
    biases ``b_u ~ N(0, 0.5²)``; in the sick module ``c_u = -U(1, 1.5)`` for a share *dying* of
    the units (pushed down: dead) and ``+U(1, 1.5)`` for the rest (pushed up), and ``m_t`` ramps
    from 0 at *onset* to *push* at the last record on the *culprit* source's batches (``others x``
    that on the rest).  *dying* defaults to half (two camps, at both bounds of a bounded activation);
    for an unbounded one (ReLU, GELU, SiLU), whose only fault is a dead unit - one pushed up sits in
    the linear part and passes its gradient - to three quarters.  *push* defaults to :data:`PUSH` of
    the activation: a dead unit's output must reach the activation's floor (within 5 % of the healthy
    scale of zero) on *every* token, which ReLU's does at 0, GELU's below about -1.5 and SiLU's only
    below about -3.3 (at a push of 6 the other sources' batches leave SiLU units near its minimum,
    -0.28, which is not zero); the deeper the floor, the larger the push.  Healthy modules, one per name in
    *healthy*, keep their biases; with *drift* their pre-activations grow by ``1 + drift`` over the
    run (healthy scale drift).
    """
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    sick_name = f"layers.{len(healthy)}.mlp.act_fn"
    names = {f"layers.{i}.mlp.act_fn": a for i, a in enumerate(healthy)} | {sick_name: act}
    bias = {n: rng.normal(0.0, 0.5, units) for n in names}
    down = (0.5 if act in BOUNDS else 0.75) if dying is None else dying
    push = PUSH.get(act, 6.0) if push is None else push
    sign = np.where(rng.permutation(units) < round(units * down), -1.0, 1.0) * rng.uniform(1.0, 1.5, units)
    bounds = {n: BOUNDS[a] for n, a in names.items() if a in BOUNDS}
    with gf.Recorder(path, sources=sources, act_bounds=bounds, mode=mode, background=False) as rec:
        for i in range(n_records):
            src = sources[i % len(sources)]
            ramp = push * max(0.0, (i - onset) / max(n_records - 1 - onset, 1)) if polarise else 0.0
            m = ramp * (1.0 if src == culprit else others)
            acts = {}
            grow = 1.0 + drift * i / max(n_records - 1, 1)
            for n, a in names.items():
                pre = (rng.normal(size=(tokens, units)) + bias[n]) * grow + (m * sign if n == sick_name else 0.0)
                acts[n] = activation(a, pre).astype(np.float32)
            rec.record(step=i, loss=2.0, source=src, n_samples=tokens, activations=acts)
    return Planted(str(path), (sick_name,) if polarise else (), tuple(n for n in names if n != sick_name or not polarise),
                   onset if polarise else None, (culprit,) if polarise else (), {"activation": act})


# --------------------------------------------------------------------- precision
def planted_precision_store(path: str | os.PathLike[str], *, swamped: bool = True, pure_bf16: bool = False,
                            n_records: int = 16, snapshot_every: int = 1, scale: float = 0.05,
                            healthy_rel: float = 0.02, swamped_rel: float = 1e-4, seed: int = 0) -> Planted:
    """Weights updated by SGD; one tensor's updates are far below half a bf16 ULP of its weights.

    ``w ← w - lr g`` with ``lr`` chosen so that ``|Δ| ≈ healthy_rel · scale`` for the
    healthy tensors and ``swamped_rel · scale`` for ``layers.0.mlp.down.weight``.
    With *pure_bf16* the weights themselves are kept in bfloat16 (rounded every
    step), so swamped updates vanish from the snapshots: ``lost_share`` sees them.
    """
    import gradforensics as gf
    from gradforensics.analysis.kinds.precision.formats import round_to

    rng = np.random.default_rng(seed)
    shapes = {"layers.0.attn.q_proj.weight": (32, 32), "layers.0.mlp.up.weight": (64, 32),
              "layers.0.mlp.down.weight": (32, 64)}
    sick = "layers.0.mlp.down.weight"
    w = {n: (rng.normal(0.0, scale, s)).astype(np.float32) for n, s in shapes.items()}
    if pure_bf16:
        w = {n: round_to(v, "bf16").astype(np.float32) for n, v in w.items()}
    with gf.Recorder(path, sources=("a", "b"), mode="training", background=False) as rec:
        for i in range(n_records):
            g = {n: rng.normal(0.0, 1.0, s).astype(np.float32) for n, s in shapes.items()}
            snap = {n: v.copy() for n, v in w.items()} if i % snapshot_every == 0 else None
            rec.record(step=i, loss=1.0, source="ab"[i % 2], grads=g, weights=snap, lr=1.0)
            for n in shapes:
                lr = (swamped_rel if (swamped and n == sick) else healthy_rel) * scale
                new = w[n].astype(np.float64) - lr * g[n]
                w[n] = (round_to(new, "bf16") if pure_bf16 else new).astype(np.float32)
    return Planted(str(path), (sick,) if swamped else (), tuple(n for n in shapes if n != sick or not swamped))


# ---------------------------------------------------------------------- spectral
def powerlaw_matrix(rows: int, cols: int, alpha: float, rng: np.random.Generator, xmin: float = 1.0) -> np.ndarray:
    """A matrix whose ``WᵀW`` eigenvalues are a sample of ``p(λ) ∝ λ^-alpha`` on ``[xmin, ∞)``."""
    r = min(rows, cols)
    lam = np.sort(xmin * (1.0 - rng.random(r)) ** (-1.0 / (alpha - 1.0)))[::-1]
    u, _ = np.linalg.qr(rng.normal(size=(rows, r)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, r)))
    return (u * np.sqrt(lam)) @ v.T


def _growth_directions(w0: dict[str, np.ndarray], growing: tuple[str, ...], logit: float,
                       growth: float) -> dict[str, np.ndarray]:
    """Each weight's top rank-1 part; with ``logit > 0`` the *growing* ones share q's top direction instead."""
    top = {}
    for n in w0:
        u, sv, vt = np.linalg.svd(w0[n], full_matrices=False)
        top[n] = sv[0] * np.outer(u[:, 0], vt[0])
    if logit > 0 and growing:
        uq, _, vq = np.linalg.svd(w0[growing[0]], full_matrices=False)
        for n in growing:
            top[n] = logit / max(growth - 1.0, 1e-9) * np.outer(uq[:, 0], vq[0])
    return top


def planted_spectral_store(path: str | os.PathLike[str], *, grow: bool = True, collapse: bool = False,
                           n_records: int = 32, snapshot_every: int = 4, d: int = 96, heads: int = 4,
                           growth: float = 4.0, alpha: float = 3.5, seed: int = 0, logit: float = 0.0,
                           model_info: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                           attention: bool = False) -> Planted:
    """Two attention layers and an MLP; layer 0's q/k spectral norm grows *growth*-fold.

    ``logit > 0``: layer 0's q and k grow along one shared rank-1 direction (``u_q v_qᵀ``) of
    amplitude ``logit`` times the step, so ``W_Qᵀ W_K`` aligns and the attention-logit scale
    grows large in absolute terms (what the q/k growth flag judges); with the default 0 the
    growth of each is along its own top direction and the logit scale stays small.

    Weights are heavy-tailed (ESD exponent *alpha*) and drift slowly; in layer 0
    the top singular value of ``q_proj`` and ``k_proj`` is scaled from 1 to
    *growth* across the run.  With *collapse*, ``layers.1.mlp.up.weight``'s
    gradients go from a rank-8 mean to a single direction after half the run.
    *model_info* and *extra* go to the store as the recorder's (e.g. ``{"qk_norm": [...]}``,
    ``{"qk_clip": 100}``); *attention*: per-head attention statistics of ``layers.0.attn`` (flat
    logits near 3) are recorded too, as a capture with ``attention=`` would.
    """
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    shapes = {f"layers.{i}.attn.{p}_proj.weight": (d, d) for i in (0, 1) for p in "qkv"}
    shapes |= {f"layers.{i}.mlp.up.weight": (2 * d, d) for i in (0, 1)}
    w0 = {n: powerlaw_matrix(*s, alpha, rng) * 0.05 for n, s in shapes.items()}
    growing: tuple[str, ...] = ("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight") if grow else ()
    top = _growth_directions(w0, growing, logit, growth)
    collapsing = "layers.1.mlp.up.weight"
    means = {n: sum(np.outer(rng.normal(size=s[0]), rng.normal(size=s[1])) for _ in range(8)) / 8
             for n, s in shapes.items()}
    direction = np.outer(rng.normal(size=shapes[collapsing][0]), rng.normal(size=shapes[collapsing][1]))
    drift = {n: np.zeros(s) for n, s in shapes.items()}
    with gf.Recorder(path, sources=("a", "b"), heads={"*_proj.weight": heads}, mode="training",
                     background=False, model_info=model_info, extra=extra) as rec:
        for i in range(n_records):
            t = i / max(n_records - 1, 1)
            grads = {n: (means[n] + 0.3 * rng.normal(size=s)).astype(np.float32) for n, s in shapes.items()}
            if collapse and i >= n_records // 2:
                grads[collapsing] = (3.0 * direction + 0.02 * rng.normal(size=shapes[collapsing])).astype(np.float32)
            snap = None
            if i % snapshot_every == 0 or i == n_records - 1:
                snap = {}
                for n in shapes:
                    lift = (growth - 1.0) * t * top[n] if n in growing else 0.0
                    snap[n] = (w0[n] + drift[n] + lift).astype(np.float32)
            for n, s in shapes.items():
                drift[n] += 0.0005 * rng.normal(size=s)
            att = None
            if attention:
                mx = (3.0 + 0.1 * rng.random(heads)).astype(np.float32)
                ent = np.full(heads, 0.7, np.float32)
                att = {"layers.0.attn": {"max_logit": mx, "entropy_mean": ent, "entropy_min": ent - 0.1,
                                         "onehot_frac": np.zeros(heads, np.float32)}}
            rec.record(step=i, loss=1.0, source="ab"[i % 2], grads=grads, weights=snap, attention=att)
    # a q/k pair's logit scale is judged on its q (the k side of the pair is read with it)
    sick = (growing[:1] if logit > 0 else growing) + ((collapsing,) if collapse else ())
    return Planted(str(path), sick, tuple(n for n in shapes if n not in sick))


# ---------------------------------------------------------------------- running
def run_analysis(path: str | os.PathLike[str], name: str, options: dict[str, Any] | None = None) -> tuple[Any, list]:
    """Run analysis *name* on the store at *path* as the engine does; returns ``(result, flags)``."""
    from gradforensics.analysis import REGISTRY, Context
    from gradforensics.analysis.engine.options import EngineOptions
    from gradforensics.analysis.engine.run import compute_pass
    from gradforensics.store.reader import Store

    a = REGISTRY[name]
    store = Store(path)
    _, computed = compute_pass(store, [a], EngineOptions(persist=False), None, False, grams=False)
    ctx = Context(store=store, meta=store.meta, batches=store.batches(), grams={},
                  computed={name: computed.get(name, {})}, options={name: a.options.parse(options, name)})
    result = a.compute(ctx)
    return result, a.flags(result, ctx)
