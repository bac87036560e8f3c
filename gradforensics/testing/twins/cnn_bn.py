"""Twin family ``cnn-bn``: a small CNN with BatchNorm on scikit-learn's digits (8x8 images) whose channels die.

``Conv(1->16) -> BatchNorm -> ReLU -> Conv(16->32) -> BatchNorm -> ReLU -> global mean -> Linear(32->10)``,
trained by SGD with heavy-ball momentum (0.9) on mini-batches of 64 of 1397 digits, cross-entropy,
120 steps.  The arms differ only in the learning rate:

* ``dead`` (sick, lr 5): BatchNorm keeps the convolutions' scale in check, not its own shift; large
  steps drive some shifts far below ``-|gamma|``, which puts the channel's pre-activation below zero
  at every pixel of every image - the channel is dead, gets no gradient through the ReLU and does
  not come back.  Most channels of the second layer die, a few of the first.
* ``sane`` (healthy, lr 0.1): no channel dies; the ReLU outputs are zero-inflated as usual.

The truth is measured in plain torch, with forward hooks on the ReLUs over a held-out batch of 400
digits in eval mode (running BatchNorm statistics): a channel is dead when its output is exactly 0
at every pixel of every held-out image, before training (``dead_first``) and after it
(``dead_last``), pooled over both layers and per layer (``dead_last_2``, ``dead_last_5``).

The recorder takes every parameter (the conv biases included: a bias before a BatchNorm gets a
gradient that is only rounding noise) with weight snapshots every 10 steps, and the two ReLUs'
activations; their units are the channels (axis 1, from the BatchNorm before them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gradforensics.testing.twins.relu_mlp import HELD_OUT, dead_shares, record_digits

__all__ = ["LR", "STEPS", "train"]

LR = {"dead": 5.0, "sane": 0.1}
STEPS = 120
BATCH = 64


def _net() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _eval_dead(model: Any, x: Any) -> dict[str, float]:
    model.eval()
    try:
        return dead_shares(model, x)
    finally:
        model.train()


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* (``dead`` or ``sane``) at *path*; returns the dead-channel shares measured in torch."""
    import torch

    import gradforensics as gf
    from gradforensics.testing.real_runs import digits

    if arm not in LR:
        raise ValueError(f"cnn-bn has arms {', '.join(LR)}; got {arm!r}.")
    torch.set_num_threads(1)
    x, y = digits()
    x = x.reshape(-1, 1, 8, 8)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(2000 + seed))
    xte, yte, xtr, ytr = x[perm[:HELD_OUT]], y[perm[:HELD_OUT]], x[perm[HELD_OUT:]], y[perm[HELD_OUT:]]
    torch.manual_seed(seed)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR[arm], momentum=0.9)
    first = _eval_dead(model, xte)
    rec = gf.Recorder(path, model=model, sources=["digits"], tensors=["*"], activations=["2", "5"],
                      weights_every=10, overwrite=True, mode="training")
    loss = record_digits(rec, model, opt, xtr, ytr, lr=LR[arm], steps=STEPS, rng=np.random.default_rng([seed, 41]),
                         batch=BATCH)
    last = _eval_dead(model, xte)
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"dead_first": first["all"], "dead_last": last["all"], "dead_last_2": last["2"],
            "dead_last_5": last["5"], "accuracy": acc, "loss_last": loss}
