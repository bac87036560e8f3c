"""Tiny Hugging Face mixture-of-experts LMs: routing collapse / a balanced twin; a starved top-1 router / top-2.

Two families share this module, both byte-level causal LMs (vocabulary 256, width 32, 2 layers of
4 attention heads, 8 experts of width 64 in every layer) trained with AdamW on bytes of real text
(:func:`~gradforensics.testing.real_runs.real_text`, batch 8 x 32 tokens, 120 steps), recorded live
with ``experts="auto"`` (per-expert units of the fused ``mlp.experts`` weights and the router
statistics ``router/model.layers.<i>.mlp.gate/...``):

* ``moe-collapse``: transformers' ``MixtralForCausalLM``, top-2 routing, AdamW at lr 3e-2 without
  warm-up. Arm ``collapse`` (sick) trains without the load-balancing loss: the routing collapses
  within the first ten steps onto one expert per layer (in layer 1 at both seeds 0 and 1 that
  expert sits in the top 2 of ~every token for the rest of the run). Arm ``balanced`` is the same
  run with the load-balancing auxiliary loss (``output_router_logits=True``,
  ``router_aux_loss_coef=1.0``; the model adds ``coef * aux_loss`` to its loss): its busiest
  expert stays below ~0.8 of the tokens.
* ``moe-starved``: transformers' ``Qwen2MoeForCausalLM`` (its shared expert of width 32 included),
  normalised top-k weights (``norm_topk_prob=True``), AdamW at lr 3e-3. Arm ``starved`` (sick)
  routes top-1 without a load-balancing loss: the one normalised weight is exactly ``p / p = 1``, so the
  router's weight gets no language-model gradient at all (norm ~1e-9 or exactly 0: at most 1.1e-8 of
  the experts'; minimind #858: 7.0e-10 against 1.0e-2 once fixed). Its healthy twin ``top2-balanced`` routes top-2 with
  the load-balancing loss (coefficient 1.0, as moe-collapse's twin; at 0.1 an expert of layer 1 died at seed 0): its router learns (gradient ~0.7 of the experts') and
  its routing stays spread. Arm ``top2`` (information) differs from ``starved`` in top-k alone: its
  router learns too, but without a load-balancing loss this tiny model's top-2 routing collapses in
  layer 1 at every learning rate tried (1e-3 to 3e-2), so it cannot be a flag-free twin; and with
  the loss on the top-1 arm its router is no longer starved (the auxiliary loss's gradient reaches
  it), so no arm differing from ``starved`` in one thing is both learning and balanced.

The truth is measured in this module's own torch code, independently of the store: a forward hook
on every router (``mlp.gate``, while gradients are on) counts the tokens sent to each expert from
the indices it returns, and after every backward the router weight's gradient norm is read beside
the experts' (``gate_up_proj`` and ``down_proj`` together). Per layer ``i``:

``max_share_first_i`` / ``max_share_last_i``
    the busiest expert's share of the step's top-k assignments (a share sums to 1 over experts;
    1/E balanced, at most 1/k) at step 0 / the mean over the last ten steps;
``onset_i``
    the first step from which the max share stays at or above ``COLLAPSE_TOKENS / k`` for
    :data:`ONSET_RUN` consecutive steps (-1: never) -- the collapse's onset record;
``collapsed_frac_i``
    the fraction of the second half's steps at or above ``COLLAPSE_TOKENS / k``;
``tokens/<i>.<e>``
    expert ``e``'s token count (top-k assignments) over the last ten steps;
``dead_i``
    the experts with no token over the last ten steps;
``router_grad_i`` / ``experts_grad_i`` / ``router_grad_ratio_i``
    the median over steps of the router weight's gradient norm, of the experts' and of their ratio;

and over the layers ``max_share_last`` (the largest), ``collapse_layer`` (its layer), ``onset``
(the earliest, -1: none), ``router_grad_ratio`` (the largest), plus ``loss_first`` and
``loss_last`` (the mean of the last ten; the loss the arm optimises, the balanced arm's includes
its auxiliary loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.testing.real_runs import real_text

__all__ = ["ARMS", "COLLAPSE_TOKENS", "EXPERTS", "ONSET_RUN", "STEPS", "Arm", "onset", "train"]


@dataclass(frozen=True)
class Arm:
    """One arm: the architecture, top-k, the load-balancing coefficient (0: none) and the learning rate."""

    arch: str            # "mixtral" or "qwen2-moe"
    top_k: int
    aux_coef: float
    lr: float


ARMS: dict[str, Arm] = {
    "collapse": Arm("mixtral", 2, 0.0, 3e-2),
    "balanced": Arm("mixtral", 2, 1.0, 3e-2),
    "starved": Arm("qwen2-moe", 1, 0.0, 3e-3),
    "top2-balanced": Arm("qwen2-moe", 2, 1.0, 3e-3),
    "top2": Arm("qwen2-moe", 2, 0.0, 3e-3),
}
STEPS = 120
EXPERTS = 8
BATCH, SEQ, LAYERS = 8, 32, 2
#: Routing has collapsed while the busiest expert is in the top k of this share of the tokens
#: (its max share of the top-k assignments >= COLLAPSE_TOKENS / k; trainscope's detector fires at 0.85).
COLLAPSE_TOKENS = 0.9
#: ... for this many consecutive steps (the onset is the first of them).
ONSET_RUN = 10
_LAST = 10


def _model(arm: Arm, seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, attn_implementation="eager", num_experts_per_tok=arm.top_k,
        output_router_logits=arm.aux_coef > 0, router_aux_loss_coef=arm.aux_coef)
    if arm.arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=EXPERTS, **common)
        return transformers.MixtralForCausalLM(cfg)
    qwen = transformers.Qwen2MoeConfig(moe_intermediate_size=64, intermediate_size=64,
                                       shared_expert_intermediate_size=32, num_experts=EXPERTS,
                                       norm_topk_prob=True, **common)
    return transformers.Qwen2MoeForCausalLM(qwen)


def onset(shares: Any, level: float, run: int = ONSET_RUN) -> int:
    """The first index from which *shares* stays >= *level* for *run* consecutive values; -1 if none."""
    above = np.asarray(shares) >= level
    for i in range(len(above) - run + 1):
        if above[i:i + run].all():
            return i
    return -1


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record *arm* at *path* and return its truth (module doc), measured in plain torch."""
    import torch

    import gradforensics as gf

    if arm not in ARMS:
        raise ValueError(f"moe: arm must be one of {', '.join(ARMS)}; got {arm!r}.")
    spec = ARMS[arm]
    torch.set_num_threads(1)
    model = _model(spec, seed)
    layers = list(model.model.layers)
    counts: list[list[np.ndarray]] = []       # per step, per layer: tokens per expert

    def hook(_m: Any, _args: Any, out: Any) -> None:
        if torch.is_grad_enabled():
            counts[-1].append(torch.bincount(out[2].detach().flatten(), minlength=EXPERTS).numpy())

    for layer in layers:
        layer.mlp.gate.register_forward_hook(hook)
    data = np.frombuffer(real_text(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng([seed, 5])
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses: list[float] = []
    grads: list[list[tuple[float, float]]] = []
    model.train()
    with gf.Recorder(path, model=model, sources=["text"], experts="auto", mode="training", overwrite=True) as rec:
        for step in range(STEPS):
            counts.append([])
            starts = rng.integers(len(data) - SEQ, size=BATCH)
            ids = torch.from_numpy(np.stack([data[s:s + SEQ] for s in starts]))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.append([(_norm(layer.mlp.gate.weight.grad),
                           float(np.hypot(_norm(layer.mlp.experts.gate_up_proj.grad),
                                          _norm(layer.mlp.experts.down_proj.grad)))) for layer in layers])
            losses.append(float(loss.detach()))
            rec.record(step=step, loss=losses[-1], source="text", n_samples=BATCH, lr=spec.lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return _truth(np.asarray(counts, dtype=np.float64), np.asarray(grads), losses, COLLAPSE_TOKENS / spec.top_k)


def _norm(g: Any) -> float:
    return 0.0 if g is None else float(g.detach().norm())


def _truth(counts: np.ndarray, grads: np.ndarray, losses: list[float], level: float) -> dict[str, float]:
    """counts (steps, layers, E) token counts; grads (steps, layers, 2) router / experts gradient norms."""
    share = counts / counts.sum(-1, keepdims=True)
    top = share.max(-1)                                       # (steps, layers)
    half = len(top) // 2
    out: dict[str, float] = {"loss_first": losses[0], "loss_last": float(np.mean(losses[-_LAST:]))}
    last = counts[-_LAST:].sum(0)                             # (layers, E)
    for i in range(counts.shape[1]):
        out[f"max_share_first_{i}"] = float(top[0, i])
        out[f"max_share_last_{i}"] = float(top[-_LAST:, i].mean())
        out[f"onset_{i}"] = float(onset(top[:, i], level))
        out[f"collapsed_frac_{i}"] = float((top[half:, i] >= level).mean())
        for e in range(counts.shape[2]):
            out[f"tokens/{i}.{e}"] = float(last[i, e])
        out[f"dead_{i}"] = float((last[i] == 0).sum())
        out[f"router_grad_{i}"] = float(np.median(grads[:, i, 0]))
        out[f"experts_grad_{i}"] = float(np.median(grads[:, i, 1]))
        out[f"router_grad_ratio_{i}"] = float(np.median(grads[:, i, 0] / grads[:, i, 1]))
    n = counts.shape[1]
    out["collapse_layer"] = float(max(range(n), key=lambda i: out[f"max_share_last_{i}"]))
    out["max_share_last"] = out[f"max_share_last_{int(out['collapse_layer'])}"]
    onsets = [out[f"onset_{i}"] for i in range(n) if out[f"onset_{i}"] >= 0]
    out["onset"] = min(onsets, default=-1.0)
    out["router_grad_ratio"] = max(out[f"router_grad_ratio_{i}"] for i in range(n))
    return out
