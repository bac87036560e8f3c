"""nanoGPT-style causal LM on SDPA: attention-logit growth at a high LR / the same LR with q/k LayerNorm / a low LR.

A byte-level causal language model written in plain torch the way nanoGPT writes it: token and
position embeddings, 2 pre-LN blocks, each a fused ``c_attn`` Linear (q | k | v) feeding
``torch.nn.functional.scaled_dot_product_attention`` (4 heads of 16) and a GELU MLP, trained with
AdamW on bytes of real text (:func:`~gradforensics.testing.real_runs.real_text`).

Arms (same data, same seed, same initialisation):

* ``high-lr`` (sick): AdamW at lr 3e-2 without warm-up: the q/k weights grow, the attention logits
  of some heads grow tens-fold and their attention goes one-hot (attention-logit growth,
  Dehghani et al. 2023; Wortsman et al. 2023).
* ``qk-ln``: the same learning rate with a per-head LayerNorm on q and on k (modules ``q_norm``,
  ``k_norm``) between the projection and the dot product: the q/k weights still grow, the logits
  cannot (``|q.k|/sqrt(d) <= g_q g_k sqrt(d)``).
* ``low-lr``: AdamW at lr 1e-3.

The truth is measured in this module's own torch code, independently of the store: every step the
attention modules recompute ``q k^T / sqrt(d)`` (causal mask) from the q and k they hand to SDPA,
and keep per layer and head the max logit and the mean normalised entropy (``H / log n`` over the
queries that see two or more keys).  Recorded live with ``attention="auto"`` (the SDPA tap) and
``heads="auto"``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARMS", "ONSET_FACTOR", "logit_onsets", "train"]

#: arm -> (learning rate, q/k LayerNorm)
ARMS: dict[str, tuple[float, bool]] = {"high-lr": (3e-2, False), "qk-ln": (3e-2, True), "low-lr": (1e-3, False)}
STEPS, BATCH, SEQ, EMBD, HEADS, LAYERS = 120, 16, 32, 64, 4, 2
#: The timeline's truth: a head's max logit has departed once it stays above this many times its opening level.
ONSET_FACTOR = 3.0


def _model(qk_norm: bool, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head, self.head_dim = HEADS, EMBD // HEADS
            self.c_attn = nn.Linear(EMBD, 3 * EMBD)
            self.c_proj = nn.Linear(EMBD, EMBD)
            if qk_norm:
                self.q_norm = nn.LayerNorm(self.head_dim)
                self.k_norm = nn.LayerNorm(self.head_dim)
            self.probe: list[tuple[np.ndarray, np.ndarray]] | None = None

        def forward(self, x: Any) -> Any:
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(EMBD, dim=2)
            q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
            if qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.probe is not None:
                self.probe.append(_truth(q.detach(), k.detach()))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(EMBD), CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(EMBD)
            self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(256, EMBD), "wpe": nn.Embedding(SEQ, EMBD),
                "h": nn.ModuleList([Block() for _ in range(LAYERS)]), "ln_f": nn.LayerNorm(EMBD)})
            self.lm_head = nn.Linear(EMBD, 256, bias=False)

        def forward(self, idx: Any) -> Any:
            tr: Any = self.transformer
            x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
            for block in tr.h:
                x = block(x)
            return self.lm_head(tr.ln_f(x))

    torch.manual_seed(seed)
    return GPT()


def _truth(q: Any, k: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per head: the max causal logit q.k/sqrt(d) and the mean normalised entropy over queries with >= 2 keys."""
    import torch

    t = q.shape[-2]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    mx = logits.amax(dim=(0, 2, 3))
    p = torch.softmax(logits, dim=-1)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)            # (B, H, T)
    n = torch.arange(1, t + 1, dtype=ent.dtype)
    norm = (ent[..., 1:] / torch.log(n[1:])).mean(dim=(0, 2))
    return mx.numpy().astype(float), norm.numpy().astype(float)


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* at *path*; returns the truth: the max attention logit over the first step and the last
    ten (``max_logit_first``, ``max_logit_last``; ``layer``, ``head``: where), the lowest mean entropy of a
    head over the last ten steps, the loss (first / last ten steps), and per layer ``i`` and head ``h``
    ``max_logit/i.h`` and ``entropy/i.h`` over the last ten steps."""
    import torch
    from torch.nn import functional as F

    import gradforensics as gf
    from gradforensics.testing.real_runs import real_text

    if arm not in ARMS:
        raise ValueError(f"nanogpt: arm must be one of {', '.join(ARMS)}; got {arm!r}.")
    lr, qk_norm = ARMS[arm]
    torch.set_num_threads(1)
    data = np.frombuffer(real_text(), dtype=np.uint8).astype(np.int64)
    model = _model(qk_norm, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng([seed, 40])
    attns = [blk.attn for blk in model.transformer.h]
    first = last = None
    ent_last = None
    losses = []
    per_step = []                 # (layers, heads) max logit of each step, from the q.k probe
    with gf.Recorder(path, model=model, sources=["text"], heads="auto", attention="auto", weights_every=10,
                     mode="training", overwrite=True) as rec:
        for step in range(STEPS):
            starts = rng.integers(len(data) - SEQ - 1, size=BATCH)
            x = torch.from_numpy(np.stack([data[s:s + SEQ] for s in starts]))
            y = torch.from_numpy(np.stack([data[s + 1:s + SEQ + 1] for s in starts]))
            for a in attns:
                a.probe = []
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            mx = np.stack([a.probe[0][0] for a in attns])               # (layers, heads)
            ent = np.stack([a.probe[0][1] for a in attns])
            first = mx if first is None else first
            per_step.append(mx)
            if step >= STEPS - 10:        # the last ten steps: the max logit, the mean entropy
                last = mx if last is None else np.maximum(last, mx)
                ent_last = ent / 10 if ent_last is None else ent_last + ent / 10
            losses.append(loss.item())
            rec.record(step=step, loss=losses[-1], source="text", n_samples=BATCH, lr=lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a in attns:
        a.probe = None
    assert first is not None and last is not None and ent_last is not None
    layer, head = np.unravel_index(int(np.argmax(last)), last.shape)
    truth = {"max_logit_first": float(first.max()), "max_logit_last": float(last.max()),
             "entropy_min_last": float(ent_last.min()), "layer": float(layer), "head": float(head),
             "entropy_at_max": float(ent_last[layer, head]), "loss_first": float(np.mean(losses[:10])),
             "loss_last": float(np.mean(losses[-10:]))}
    for (i, h), v in np.ndenumerate(last):          # per layer and head: "max_logit/<layer>.<head>", "entropy/..."
        truth[f"max_logit/{i}.{h}"], truth[f"entropy/{i}.{h}"] = float(v), float(ent_last[i, h])
    truth.update(logit_onsets(np.stack(per_step)))
    return truth


def logit_onsets(mx: np.ndarray, k: float = ONSET_FACTOR, opening: int = 10) -> dict[str, float]:
    """Per layer ``i`` and head ``h`` of the per-step max logits *mx* (steps, layers, heads), measured by the q.k
    probe: ``onset/max_logit/<i>.<h>``, the first step from which the max logit stays above *k* times its
    opening level (the mean of the first *opening* steps) to the end of the run; NaN if it never does."""
    out = {}
    for (i, h), o in np.ndenumerate(mx[:opening].mean(axis=0)):
        v = mx[:, i, h]
        below = np.flatnonzero(~(v > k * o))
        start = int(below[-1]) + 1 if below.size else 0
        out[f"onset/max_logit/{i}.{h}"] = float(start) if start < v.size else float("nan")
    return out
