"""Stores with planted truth: build a store whose answer is known, then check the analysis finds it.

:func:`write_store` is the core builder (on top of :class:`gradforensics.Recorder`):
give it a function that returns each record's gradients and it writes a
schema-v1 store.  The factories build on it:

* :func:`healthy_store` - the control: one fixed mean gradient ``G`` per tensor
  plus i.i.d. Gaussian noise, identical for every source, at a chosen per-batch
  SNR; nothing in it should raise a flag above 0.5.
* :func:`noise_store` - known ``G`` and anisotropic diagonal ``Σ`` per tensor, so
  ``B_simple = tr(Σ)/|G|²`` is known exactly; one tensor planted noisy.
* :func:`nonfinite_store` - a healthy store with NaN/Inf planted in chosen records
  of one tensor (optionally one head).

Every factory returns a :class:`PlantedStore` (a path with the planted ``truth``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ACT_MODULE",
    "HEADS",
    "SOURCES",
    "TENSORS",
    "GradsFn",
    "PlantedStore",
    "healthy_activations",
    "healthy_loss",
    "healthy_store",
    "noise_store",
    "nonfinite_store",
    "sgd_weights",
    "unit_mean",
    "write_store",
]


#: The default tensors of a planted store: two layers, attention split into 4 heads.
TENSORS: dict[str, tuple[int, ...]] = {
    "layers.0.attn.q.weight": (32, 16),
    "layers.0.mlp.up.weight": (48, 16),
    "layers.1.attn.q.weight": (32, 16),
    "layers.1.mlp.up.weight": (48, 16),
}
HEADS: dict[str, int] = {"layers.*.attn.q.weight": 4}
ACT_MODULE = "layers.0.mlp.act"
SOURCES = ("a", "b", "c")

GradsFn = Callable[[int, Any, np.random.Generator], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class PlantedStore:
    """Path of a store written by a factory, and what was planted in it."""

    path: str
    truth: dict[str, Any] = field(default_factory=dict)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


def write_store(
    path: str | os.PathLike[str],
    grads_fn: GradsFn,
    n_records: int,
    sources: Sequence[str] = SOURCES,
    *,
    seed: int = 0,
    source_of: Callable[[int], str | Mapping[str, float]] | None = None,
    n_samples: int | Callable[[int], int] = 32,
    loss_fn: Callable[[int, Any, np.random.Generator], float] | None = None,
    activations_fn: Callable[[int, Any, np.random.Generator], Mapping[str, np.ndarray]] | None = None,
    weights_fn: Callable[[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray] | None] | None = None,
    lr: float = 0.1,
    mode: str = "training",
    heads: Mapping[str, Any] | None = None,
    truth: Mapping[str, Any] | None = None,
    **recorder_kwargs: Any,
) -> PlantedStore:
    """Write a store record by record from callables.

    Parameters
    ----------
    grads_fn
        ``grads_fn(i, source, rng) -> {tensor: array}`` for record *i*; *source*
        is a source name or a ``{source: share}`` mixture.
    source_of
        ``i -> source name or mixture``; default: round robin over *sources*.
    n_samples
        Batch size of every record, or ``i -> batch size``.
    loss_fn, activations_fn
        ``(i, source, rng) -> loss`` and ``-> {module: (tokens, units) array}``.
    weights_fn
        ``(i, grads) -> {tensor: weight}`` or None: a snapshot at record *i*.
    recorder_kwargs
        Passed to :class:`gradforensics.Recorder` (``sketch=``, ``dtype=``, ``full=``, ...).
    """
    from gradforensics.recording import Recorder

    rng = np.random.default_rng(seed)
    pick = source_of or (lambda i: sources[i % len(sources)])
    with Recorder(path, sources=list(sources), heads=dict(heads or {}), mode=mode, **recorder_kwargs) as rec:
        for i in range(n_records):
            src = pick(i)
            grads = dict(grads_fn(i, src, rng))
            where = {"source": src} if isinstance(src, str) else {"mixture": dict(src)}
            rec.record(step=i, loss=float(loss_fn(i, src, rng)) if loss_fn else float("nan"),
                       n_samples=int(n_samples(i) if callable(n_samples) else n_samples), lr=lr,
                       grads=grads, activations=dict(activations_fn(i, src, rng)) if activations_fn else None,
                       weights=weights_fn(i, grads) if weights_fn else None, **where)
    return PlantedStore(str(path), dict(truth or {}))


# ------------------------------------------------------------------ pieces
def unit_mean(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A fixed mean gradient with ``|G|² = 1``."""
    g = rng.standard_normal(shape)
    return (g / np.linalg.norm(g)).astype(np.float32)


def healthy_loss(n_records: int) -> Callable[[int, Any, np.random.Generator], float]:
    """Slowly decaying loss plus white noise: no period, no spike."""
    return lambda i, src, rng: float(2.0 + np.exp(-i / max(n_records, 1)) + 0.02 * rng.standard_normal())


def healthy_activations(i: int, src: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """tanh of moderate pre-activations: unimodal, far from both ends of (-1, 1)."""
    return {ACT_MODULE: np.tanh(0.5 * rng.standard_normal((32, 24))).astype(np.float32)}


def sgd_weights(init: Mapping[str, np.ndarray], lr: float, every: int | None) -> Callable[..., Any]:
    """Weights that follow the recorded gradients by SGD; a snapshot every *every* records."""
    state = {k: np.array(v, dtype=np.float32) for k, v in init.items()}

    def fn(i: int, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        snap = {k: v.copy() for k, v in state.items()} if every and i % every == 0 else None
        for k in state:
            if k in grads:
                state[k] -= lr * np.where(np.isfinite(grads[k]), grads[k], 0).astype(np.float32)
        return snap

    return fn


# --------------------------------------------------------------- factories
def healthy_store(
    path: str | os.PathLike[str],
    seed: int = 0,
    snr: float = 4.0,
    *,
    n_records: int = 64,
    sources: Sequence[str] = SOURCES,
    n_samples: int = 32,
    tensors: Mapping[str, tuple[int, ...]] | None = None,
    activations: bool = True,
    weights_every: int | None = 16,
    lr: float = 0.1,
    mode: str = "training",
    grads_hook: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    **kwargs: Any,
) -> PlantedStore:
    """The control store: shared mean gradient + i.i.d. noise, identical across sources.

    Each tensor has a fixed ``G`` with ``|G|² = 1`` and per-record noise
    ``ε ~ N(0, σ² I)`` with ``E|ε|² = 1/snr``, so the per-batch SNR is *snr* and
    ``B_simple = n_samples / snr`` for every tensor, head and source.  Loss,
    activations and (SGD-consistent) weight snapshots are healthy as well.
    ``grads_hook(i, grads) -> grads`` may alter a record (factories plant trouble with it).
    """
    tensors = dict(tensors or TENSORS)
    g_rng = np.random.default_rng([seed, 1])
    means = {t: unit_mean(s, g_rng) for t, s in tensors.items()}
    sigma = {t: np.sqrt(1.0 / (snr * np.prod(s))) for t, s in tensors.items()}

    def grads(i: int, src: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {t: (means[t] + sigma[t] * rng.standard_normal(means[t].shape)).astype(np.float32) for t in tensors}
        return grads_hook(i, out) if grads_hook else out

    init = {t: (np.random.default_rng([seed, 2]).standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
            for t, s in tensors.items()}
    truth = {"snr": snr, "b_simple": n_samples / snr, "tensors": list(tensors), "sources": list(sources)}
    kwargs.setdefault("heads", HEADS)
    return write_store(path, grads, n_records, sources, seed=seed, n_samples=n_samples,
                       loss_fn=healthy_loss(n_records), activations_fn=healthy_activations if activations else None,
                       weights_fn=sgd_weights(init, lr, weights_every) if weights_every else None, lr=lr,
                       mode=mode, truth=truth, act_bounds={ACT_MODULE: (-1.0, 1.0)} if activations else None,
                       **kwargs)


def _truth_entries(truth: dict[str, Any], t: str, mean: np.ndarray, var: np.ndarray, heads: dict[str, Any]) -> None:
    """The truth of tensor *t* and, when *heads* split it, of each ``"<t>#<head>"``."""
    from gradforensics.recording.heads import match_heads

    _truth_entry(truth, t, mean, var)
    spec = match_heads(t, heads)
    if spec is not None:
        for h, (gm, vv) in enumerate(zip(spec.split(mean), spec.split(var))):
            _truth_entry(truth, f"{t}#{h}", gm, vv)


def noise_store(path: str | os.PathLike[str], seed: int = 0, *, b_simple: Mapping[str, float] | None = None,
                noisy: Sequence[str] = ("layers.1.mlp.up.weight",), snr_healthy: float = 8.0, snr_noisy: float = 0.1,
                n_records: int = 64, sources: Sequence[str] = SOURCES, n_samples: int | Callable[[int], int] = 32,
                tensors: Mapping[str, tuple[int, ...]] | None = None, mode: str = "replay",
                source_noise: Mapping[str, float] | None = None,
                source_noise_tensors: Sequence[str] = ("layers.0.mlp.up.weight",), **kwargs: Any) -> PlantedStore:
    """Known ``G`` and diagonal ``Σ`` per tensor, hence known ``|G|²``, ``tr(Σ)`` and ``B_simple``.

    Record *i* is ``G + ε_i`` with ``ε_i ~ N(0, Σ / B_i)``; ``Σ`` is diagonal with
    log-normal variances scaled to ``tr(Σ) = B_simple |G|²`` (``|G|² = 1``).
    By default every tensor has ``B_simple = B / snr_healthy`` except the
    *noisy* ones, at ``B / snr_noisy``; *b_simple* overrides per tensor.
    ``truth`` holds ``b_simple``, ``g2`` and ``trace_sigma`` per tensor and, for
    head-split tensors, per ``"<tensor>#<head>"`` (all sources; values for the
    default sources when *source_noise* is set).  ``source_noise={"c": 25.0}``
    multiplies ``Σ`` by 25 for records of source ``c`` in *source_noise_tensors*.
    """
    tensors = dict(tensors or TENSORS)
    heads = dict(kwargs.pop("heads", HEADS))
    b_ref = float(n_samples if not callable(n_samples) else np.mean([n_samples(i) for i in range(n_records)]))
    target = {t: b_ref / (snr_noisy if t in noisy else snr_healthy) for t in tensors}
    target.update(dict(b_simple or {}))
    g_rng = np.random.default_rng([seed, 1])
    means = {t: unit_mean(s, g_rng) for t, s in tensors.items()}
    var = {}
    for t, s in tensors.items():
        v = np.exp(g_rng.normal(0.0, 0.5, size=s))
        var[t] = v * target[t] / v.sum()
    truth: dict[str, Any] = {"b_simple": {}, "g2": {}, "trace_sigma": {}, "noisy": list(noisy),
                             "batch_size": b_ref, "source_noise": dict(source_noise or {}),
                             "source_noise_tensors": list(source_noise_tensors) if source_noise else []}
    for t in tensors:
        _truth_entries(truth, t, means[t], var[t], heads)
    extra = dict(source_noise or {})

    def scale(t: str, src: Any) -> float:
        hit = t in source_noise_tensors and isinstance(src, str)
        return float(extra.get(src, 1.0)) if hit else 1.0

    def grads(i: int, src: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
        b = n_samples(i) if callable(n_samples) else n_samples
        return {t: (means[t] + np.sqrt(scale(t, src) * var[t] / b) * rng.standard_normal(means[t].shape))
                .astype(np.float32) for t in tensors}

    return write_store(path, grads, n_records, sources, seed=seed, n_samples=n_samples, mode=mode,
                       heads=heads, truth=truth, loss_fn=healthy_loss(n_records), **kwargs)


def _truth_entry(truth: dict[str, Any], key: str, mean: np.ndarray, var: np.ndarray) -> None:
    g2 = float(np.sum(mean.astype(np.float64) ** 2))
    tr = float(np.sum(var))
    truth["g2"][key], truth["trace_sigma"][key], truth["b_simple"][key] = g2, tr, tr / g2


def nonfinite_store(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    tensor: str = "layers.1.mlp.up.weight",
    records: Sequence[int] = (5, 17),
    source: str = "b",
    head: int | None = None,
    values: Sequence[float] = (np.nan, np.inf, -np.inf),
    n_records: int = 32,
    sources: Sequence[str] = SOURCES,
    **kwargs: Any,
) -> PlantedStore:
    """A healthy store with NaN/Inf planted in *records* of *tensor* (only *head*, if given).

    The planted records are from *source*; the others go round robin over the
    other sources.  ``truth``: tensor, head, records, elements, source.
    """
    from gradforensics.recording.heads import match_heads

    planted = sorted(int(r) for r in records)
    others = [s for s in sources if s != source] or [source]
    heads = dict(kwargs.get("heads", HEADS))
    shape = dict(kwargs.get("tensors") or TENSORS)[tensor]
    spec = match_heads(tensor, heads)
    if head is not None and spec is None:
        raise ValueError(f"nonfinite_store: {tensor} is not head-split; head={head} cannot be planted.")
    positions = _plant_positions(shape, spec, head, len(values))

    def source_of(i: int) -> str:
        return source if i in planted else others[i % len(others)]

    def poison(i: int, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if i in planted:
            g = grads[tensor].copy()
            for p, v in zip(positions, values):
                g[p] = v
            grads[tensor] = g
        return grads

    truth = {"tensor": tensor, "head": head, "records": planted, "elements": len(values), "source": source}
    store = healthy_store(path, seed, n_records=n_records, sources=sources, source_of=source_of,
                          grads_hook=poison, **kwargs)
    return PlantedStore(store.path, {**store.truth, **truth})


def _plant_positions(shape: tuple[int, ...], spec: Any, head: int | None, n: int) -> list[tuple[int, ...]]:
    """Flat-index positions (in the unsplit tensor) that fall in *head* (or anywhere)."""
    idx = np.arange(int(np.prod(shape))).reshape(shape)
    if head is not None:
        idx = spec.split(idx)[head]
    flat = idx.reshape(-1)
    picks = flat[np.linspace(0, flat.size - 1, n).astype(int)]
    return [tuple(int(p) for p in np.unravel_index(q, shape)) for q in picks]
