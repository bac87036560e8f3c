"""The zoo's families built on :mod:`gradforensics.testing.real_runs`: the tiny HF LLaMA and GPT-2, and the digits MLP.

* ``llama``: the tiny LLaMA (GQA, RoPE, eager attention) under AdamW on bytes of real text,
  arm ``llama-high-lr`` at lr 3e-2 (sick: its attention logits grow and its heads go one-hot) beside
  ``llama`` at lr 3e-3 (real_runs ``llama-adamw``), same data, same seed, same batches.
* ``gpt2``: the same with the tiny GPT-2 (fused Conv1D ``c_attn``), arms ``gpt2-high-lr`` / ``gpt2``.
* ``mlp-eos``: the tanh MLP on digits under full-batch GD, arm ``mlp-eos`` at eta 0.4 (past the edge of
  stability) beside ``mlp-gd`` at eta 0.1.

The truth of a transformer arm is measured here, in plain torch, by forward hooks on each layer's
attention module (:func:`real_runs.train`'s ``watch``): its own q.k computation from the layer's
input (the q/k projections, RoPE for LLaMA, GQA's shared k heads, the 1/sqrt(d) scale, the causal
mask), independent of the recorder's taps.  Per layer ``i``:

``max_logit_first_i`` / ``max_logit_last_i``
    the largest causal attention logit over batch, heads and positions at the first / last step;
``max_logit_peak_i``
    its largest value over the run;
``entropy_last_i``
    the smallest head's mean normalised entropy at the last step (each query row's entropy over
    the ``t + 1`` keys it sees, divided by ``log(t + 1)``, rows ``t >= 1``; 1 = uniform, 0 = one-hot);

and over the layers ``max_logit_peak`` and ``entropy_min``, plus ``loss_first`` (the first step's
loss) and ``loss_last`` (the mean of the last ten, mini-batches differ).  The MLP's truth is
:func:`real_runs.truths` (lambda_max * eta by power iteration, the consecutive-gradient cosine,
the loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradforensics.testing import real_runs

__all__ = ["ARMS", "STEPS", "attention_truth", "train"]

#: arm -> (real_runs run, learning rate; the MLP arms run at real_runs' own eta)
ARMS: dict[str, tuple[str, float]] = {
    "llama-high-lr": ("llama-adamw", 3e-2),
    "llama": ("llama-adamw", 3e-3),
    "gpt2-high-lr": ("gpt2-adamw", 3e-2),
    "gpt2": ("gpt2-adamw", 3e-3),
    "mlp-eos": ("mlp-eos", 0.4),
    "mlp-gd": ("mlp-gd", 0.1),
}

#: Steps per arm (real_runs' own: 100 for the transformers, 120 for the MLP).
STEPS: dict[str, int | None] = {arm: None for arm in ARMS}

_LAST = 10        # loss_last: the mean of this many last steps


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record *arm* at *path* (real_runs' recorder options) and return its truth, measured in plain torch."""
    import torch

    if arm not in ARMS:
        raise ValueError(f"hf_runs: arm must be one of {', '.join(ARMS)}; got {arm!r}.")
    name, lr = ARMS[arm]
    torch.set_num_threads(1)
    if real_runs.RUNS[name].model == "mlp":        # its truth replays the run in plain torch, at its own eta
        real_runs.train(name, Path(path), seed=seed, steps=STEPS[arm])
        return real_runs.truths(name, seed=seed, steps=STEPS[arm])
    watch, truth = attention_truth(real_runs.RUNS[name].model)
    real_runs.train(name, Path(path), seed=seed, steps=STEPS[arm], lr=lr, watch=watch)
    return truth()


def attention_truth(arch: str) -> tuple[Callable[[Any], None], Callable[[], dict[str, float]]]:
    """A ``watch`` for :func:`real_runs.train` that hooks every attention layer of an *arch* model
    (``"llama"`` or ``"gpt2"``), and the function that summarises what the hooks measured."""
    per_layer: dict[int, list[tuple[float, float]]] = {}
    losses: list[float] = []

    def watch(model: Any) -> None:
        layers = model.model.layers if arch == "llama" else model.transformer.h
        for i, layer in enumerate(layers):
            attn = layer.self_attn if arch == "llama" else layer.attn
            per_layer[i] = []
            attn.register_forward_pre_hook(_hook(arch, attn, per_layer[i]), with_kwargs=True)

        def on_output(_m: Any, _args: Any, out: Any) -> None:
            if getattr(out, "loss", None) is not None:
                losses.append(float(out.loss.detach()))

        model.register_forward_hook(on_output)

    def truth() -> dict[str, float]:
        out: dict[str, float] = {"loss_first": losses[0], "loss_last": sum(losses[-_LAST:]) / len(losses[-_LAST:])}
        for i, seen in per_layer.items():
            out[f"max_logit_first_{i}"] = seen[0][0]
            out[f"max_logit_last_{i}"] = seen[-1][0]
            out[f"max_logit_peak_{i}"] = max(m for m, _ in seen)
            out[f"entropy_last_{i}"] = seen[-1][1]
        out["max_logit_peak"] = max(out[f"max_logit_peak_{i}"] for i in per_layer)
        out["entropy_min"] = min(out[f"entropy_last_{i}"] for i in per_layer)
        return out

    return watch, truth


def _hook(arch: str, attn: Any, seen: list[tuple[float, float]]) -> Callable[..., None]:
    def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        h = kwargs.get("hidden_states", args[0] if args else None)
        with torch.no_grad():
            q, k = _llama_qk(attn, h, kwargs["position_embeddings"]) if arch == "llama" else _gpt2_qk(attn, h)
            seen.append(_logit_stats(q, k))
    return hook


def _heads(x: Any, d: int) -> Any:
    """(batch, seq, heads * d) -> (batch, heads, seq, d)."""
    b, t, _ = x.shape
    return x.reshape(b, t, -1, d).transpose(1, 2)


def _llama_qk(attn: Any, h: Any, position_embeddings: Any) -> tuple[Any, Any]:
    import torch

    d = attn.head_dim
    q, k = _heads(attn.q_proj(h), d), _heads(attn.k_proj(h), d)
    cos, sin = (x.unsqueeze(1) for x in position_embeddings)

    def rotate(x: Any) -> Any:                     # RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)      # GQA: each k head serves a group of q heads
    return q, k


def _gpt2_qk(attn: Any, h: Any) -> tuple[Any, Any]:
    q, k, _ = attn.c_attn(h).split(attn.embed_dim, dim=2)
    return _heads(q, attn.head_dim), _heads(k, attn.head_dim)


def _logit_stats(q: Any, k: Any) -> tuple[float, float]:
    """The largest causal logit q.k / sqrt(d), and the smallest head's mean normalised row entropy."""
    import torch

    t = q.shape[2]
    logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    masked = logits.masked_fill(~causal, float("-inf"))
    p = masked.softmax(-1)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)                  # (batch, heads, seq)
    norm = ent[..., 1:] / torch.log(torch.arange(2, t + 1, dtype=ent.dtype))
    return float(logits[..., causal].max()), float(norm.mean(dim=(0, 2)).min())
