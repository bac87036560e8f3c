"""Twin family ``logits``: a byte language model whose output logits diverge at a high learning rate.

A next-byte model on real text (:func:`~gradforensics.testing.real_runs.real_text`): the 8 previous
bytes are embedded (``nn.Embedding(256, 32)``), concatenated, passed through ``fc1`` (256 -> 128),
a GELU (``act``), ``fc2`` (128 -> 32) and a LayerNorm (``norm``), and an ``nn.Linear`` ``lm_head``
(32 -> 256) gives the logits.  Adam, mini-batches of 256 random windows, cross-entropy, 150 steps,
the learning rate warmed up linearly from 0 to its peak over the run.  The arms differ in one thing:

* ``high-lr`` (sick, peak 1.0): from about two thirds of the warm-up on, the steps overshoot and
  the logits blow up: log Z (the logsumexp of the logits) climbs from log 256 = 5.5 to a hundred
  nats and more while the loss climbs from ~3 to ~100 nats: the output-logit divergence of
  Wortsman et al. 2023.
* ``low-lr`` (healthy, peak 0.01): log Z stays within a couple of nats of log 256; the loss falls.
* ``z-loss`` (information, peak 1.0 plus the z-loss ``1e-4 * mean(log Z^2)``): what the z-loss of
  that strength does at this rate (at 1e-4 it does not hold log Z down here: the rate is the cause).

The truth is measured in plain torch on the logits of each training batch (``torch.logsumexp``
over the vocabulary): the mean and the max of log Z over the batch, averaged over the first and
the last 10 steps (``logz_mean_first``, ``logz_mean_last``, ``logz_max_first``, ``logz_max_last``),
the cross-entropy likewise (``loss_first``, ``loss_last``), and ``onset_step``: the first step from
which the batch's mean log Z stays above its opening level (first 10 steps) plus log 256, and ``spike``: the
first step whose cross-entropy is above the mean + 6 sd of the 37 steps before it (:func:`spike_step`);
``onset/logz/lm_head`` repeats ``onset_step`` under the timeline's name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CTX", "PEAK_LR", "STEPS", "VOCAB", "Z_LOSS", "onset", "spike_step", "train"]

PEAK_LR = {"high-lr": 1.0, "low-lr": 0.01, "z-loss": 1.0}
Z_LOSS = {"z-loss": 1e-4}
STEPS = 150
BATCH = 256
CTX = 8
VOCAB = 256
DIM = 32
HIDDEN = 128
EDGE = 10                     # steps averaged at each end of the run for the truth


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    class ByteLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.fc1 = nn.Linear(CTX * DIM, HIDDEN)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(HIDDEN, DIM)
            self.norm = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB)

        def forward(self, x: Any) -> Any:
            return self.lm_head(self.norm(self.fc2(self.act(self.fc1(self.emb(x).flatten(1))))))

    torch.manual_seed(seed)
    return ByteLM()


def onset(logz: np.ndarray, rise: float, edge: int = EDGE) -> int | None:
    """First step from which *logz* stays above its opening level (first *edge* steps) plus *rise*."""
    s = np.asarray(logz, float)
    below = np.flatnonzero(~(s > float(np.mean(s[:edge])) + rise))
    start = int(below[-1]) + 1 if below.size else 0
    return start if start < s.size else None


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* (``high-lr``, ``low-lr`` or ``z-loss``) at *path*; returns log Z and the loss from torch."""
    import torch
    from torch import nn

    import gradforensics as gf
    from gradforensics.testing.real_runs import real_text

    if arm not in PEAK_LR:
        raise ValueError(f"logits has arms {', '.join(PEAK_LR)}; got {arm!r}.")
    torch.set_num_threads(1)
    data = torch.from_numpy(np.frombuffer(real_text(), dtype=np.uint8).astype(np.int64))
    model = _model(seed)
    peak, zl = PEAK_LR[arm], Z_LOSS.get(arm, 0.0)
    opt = torch.optim.Adam(model.parameters(), lr=peak)
    gen = torch.Generator().manual_seed(1000 + seed)
    logz_mean, logz_max, losses = [], [], []
    with gf.Recorder(path, model=model, sources=["text"], activations=["act"], logits="auto",
                     weights_every=10, overwrite=True, mode="training") as rec:
        for step in range(STEPS):
            lr = peak * (step + 1) / STEPS
            for group in opt.param_groups:
                group["lr"] = lr
            i = torch.randint(0, len(data) - CTX - 1, (BATCH,), generator=gen)
            x, y = data[i[:, None] + torch.arange(CTX)], data[i + CTX]
            logits = model(x)
            ce = nn.functional.cross_entropy(logits, y)
            lz = torch.logsumexp(logits.detach(), dim=-1)
            loss = ce + zl * torch.logsumexp(logits, dim=-1).pow(2).mean() if zl else ce
            loss.backward()
            rec.record(step=step, loss=float(ce.detach()), source="text", n_samples=BATCH, lr=lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
            logz_mean.append(float(lz.mean()))
            logz_max.append(float(lz.max()))
            losses.append(float(ce.detach()))
    start = onset(np.array(logz_mean), math.log(VOCAB))
    return {"logz_mean_first": float(np.mean(logz_mean[:EDGE])), "logz_mean_last": float(np.mean(logz_mean[-EDGE:])),
            "logz_max_first": float(np.max(logz_max[:EDGE])), "logz_max_last": float(np.max(logz_max[-EDGE:])),
            "loss_first": float(np.mean(losses[:EDGE])), "loss_last": float(np.mean(losses[-EDGE:])),
            "onset_step": float("nan") if start is None else float(start), "spike": spike_step(losses),
            "onset/logz/lm_head": float("nan") if start is None else float(start)}


def spike_step(losses: list[float], k: float = 6.0, window: int = 37, burn_in: int = 8) -> float:
    """The first step whose cross-entropy (measured in torch) is above the mean + *k* sd of the *window* steps
    before it (at least *burn_in* of them); NaN if none."""
    y = np.asarray(losses, float)
    for i in range(burn_in, y.size):
        prev = y[max(0, i - window):i]
        if y[i] > prev.mean() + k * prev.std():
            return float(i)
    return float("nan")
