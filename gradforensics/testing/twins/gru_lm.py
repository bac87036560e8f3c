"""Family ``gru-lm``: a byte-level GRU language model, exploding gradients without clipping / with clipping.

A one-layer GRU (embedding 16, hidden 64, a linear read-out to 256 bytes) learns the next byte of
real text (:func:`gradforensics.testing.real_runs.real_text`) by plain SGD at a learning rate of
6 on random windows of 96 bytes, 16 a batch.  Both arms share the data, the seed and the learning rate:

* ``no-clip`` (sick): early in training the loss surface of the recurrence has a cliff
  (Pascanu, Mikolov & Bengio 2013); a step lands near it, the gradient jumps an order of magnitude
  above its own median, the full step throws the weights off, the loss climbs far above where it
  was and the recurrent weight's spectral norm grows several-fold beyond the twin's;
* ``clip`` (healthy): the same run with ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` before each
  step, the standard cure: the same cliff costs one bounded step.

The recorded gradient is the one ``backward()`` produced (before clipping: clipping is the
optimizer's business), so the twin's store sees its own cliffs too.

The truth (plain torch, no store): the gradient norm per step (all parameters, and ``weight_hh``'s
alone; their max over median), the loss spike (the largest loss over the median of the
ten before it, past the first ten steps) and the spectral norm of ``weight_hh`` and the largest
spectral radius of its three gate blocks at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARMS", "CLIP", "LR", "train"]

ARMS = ("no-clip", "clip")
LR = 6.0
CLIP = 1.0
STEPS = 120
BATCH = 16
SEQ = 96
HIDDEN = 64


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    class ByteGRU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(256, 16)
            self.rnn = nn.GRU(16, HIDDEN, batch_first=True)
            self.head = nn.Linear(HIDDEN, 256)

        def forward(self, x: Any) -> Any:
            h, _ = self.rnn(self.emb(x))
            return self.head(h)

    torch.manual_seed(seed)
    return ByteGRU()


def _radius(w: Any) -> tuple[float, float]:
    """Spectral norm of the whole recurrent weight and the largest spectral radius of its gate blocks."""
    import torch

    blocks = w.reshape(3, HIDDEN, HIDDEN)
    rho = max(float(torch.linalg.eigvals(b).abs().max()) for b in blocks)
    return float(torch.linalg.matrix_norm(w, 2)), rho


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* (``no-clip`` or ``clip``) at *path*; returns the truth measured in plain torch."""
    import torch
    from torch import nn

    import gradforensics as gf
    from gradforensics.testing.real_runs import real_text

    if arm not in ARMS:
        raise ValueError(f"gru-lm has arms {', '.join(ARMS)}; got {arm!r}.")
    torch.set_num_threads(1)
    data = np.frombuffer(real_text(), dtype=np.uint8).astype(np.int64)
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rng = np.random.default_rng([seed, 7])
    w_hh = model.rnn.weight_hh_l0
    sn0, rho0 = _radius(w_hh.detach())
    gnorm, ghh, losses = [], [], []
    with gf.Recorder(path, model=model, sources=["text"], mode="training", weights_every=10,
                     overwrite=True) as rec:
        for step in range(STEPS):
            starts = rng.integers(len(data) - SEQ - 1, size=BATCH)
            ids = torch.from_numpy(np.stack([data[s:s + SEQ + 1] for s in starts]))
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            rec.record(step=step, loss=loss.item(), source="text", n_samples=BATCH, lr=LR)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            gnorm.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
            ghh.append(float(w_hh.grad.norm()))
            losses.append(loss.item())
            if arm == "clip":
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
    sn, rho = _radius(w_hh.detach())
    g, h, ls = np.array(gnorm), np.array(ghh), np.array(losses)
    before = np.array([np.median(ls[t - 10:t]) for t in range(10, ls.size)])
    return {"grad_max_over_median": float(g.max() / np.median(g)),
            "grad_hh_max_over_median": float(h.max() / np.median(h)),
            "loss_spike": float((ls[10:] / before).max()), "loss_max": float(ls.max()),
            "loss_last": float(np.median(ls[-10:])), "weight_hh_sn_first": sn0, "weight_hh_sn_last": sn,
            "weight_hh_radius_first": rho0, "weight_hh_radius_last": rho,
            "finite": float(np.isfinite(ls).all() and np.isfinite(g).all())}
