"""Twin family ``relu-mlp``: a ReLU MLP on scikit-learn's digits whose units die at a high learning rate.

A 64-128-128-10 MLP with two ``nn.ReLU`` layers, trained by SGD with heavy-ball momentum (0.9) on
mini-batches of 64 of 1397 digits, cross-entropy, 150 steps.  The arms differ only in the learning rate:

* ``high-lr`` (sick, lr 0.5): a few large early steps push most pre-activations below zero for
  every input; those units get no gradient through the ReLU and never come back (the dying ReLU,
  Lu et al. 2019).  Most units of one layer or both are dead at the end.
* ``sane-lr`` (healthy, lr 0.05): a few percent of the units are dead from the initialisation on
  and stay so; the others carry a zero-inflated, right-skewed spread - how every ReLU layer looks.

The truth is measured in plain torch, with forward hooks on the ReLUs over a held-out batch of 400
digits: a unit is dead when its output is exactly 0 on every held-out input, before training
(``dead_first``) and after it (``dead_last``), pooled over both layers and per layer
(``dead_last_1``, ``dead_last_3``: the ReLU's index in the ``nn.Sequential``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LR", "STEPS", "dead_shares", "record_digits", "train"]

LR = {"high-lr": 0.5, "sane-lr": 0.05}
STEPS = 150
BATCH = 64
HELD_OUT = 400


def dead_shares(model: Any, x: Any) -> dict[str, float]:
    """Share of units whose ReLU output is 0 on every row of *x*, per ReLU (by its name) and pooled."""
    import torch
    from torch import nn

    outs: dict[str, Any] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, o, name=name: outs.__setitem__(name, o))
             for name, m in model.named_modules() if isinstance(m, nn.ReLU)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    dead = {name: (o == 0).reshape(o.shape[0], o.shape[1], -1).all(dim=2).all(dim=0) for name, o in outs.items()}
    out = {name: float(d.float().mean()) for name, d in dead.items()}
    out["all"] = float(torch.cat(list(dead.values())).float().mean())
    return out


def _split(seed: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from gradforensics.testing.real_runs import digits

    x, y = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + seed))
    return x[perm[HELD_OUT:]], y[perm[HELD_OUT:]], x[perm[:HELD_OUT]], y[perm[:HELD_OUT]]


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* (``high-lr`` or ``sane-lr``) at *path*; returns the dead shares measured in torch."""
    import torch
    from torch import nn

    import gradforensics as gf

    if arm not in LR:
        raise ValueError(f"relu-mlp has arms {', '.join(LR)}; got {arm!r}.")
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = _split(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR[arm], momentum=0.9)
    first = dead_shares(model, xte)
    rec = gf.Recorder(path, model=model, sources=["digits"], tensors=["0.weight", "2.weight", "4.weight"],
                      activations=["1", "3"], weights_every=10, overwrite=True, mode="training")
    loss = record_digits(rec, model, opt, xtr, ytr, lr=LR[arm], steps=STEPS, rng=np.random.default_rng([seed, 40]))
    last = dead_shares(model, xte)
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"dead_first": first["all"], "dead_last": last["all"], "dead_last_1": last["1"],
            "dead_last_3": last["3"], "accuracy": acc, "loss_last": loss}


def record_digits(rec: Any, model: Any, opt: Any, xtr: Any, ytr: Any, *, lr: float, steps: int,
                  rng: np.random.Generator, batch: int = BATCH) -> float:
    """Train *model* on mini-batches of digits under cross-entropy, recording every step with *rec* (closed at the
    end); returns the last loss.  Shared by the ``relu-mlp`` and ``cnn-bn`` families."""
    import torch
    from torch import nn

    loss = torch.zeros(())
    with rec:
        for step in range(steps):
            idx = torch.from_numpy(rng.integers(len(xtr), size=batch))
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            rec.record(step=step, loss=float(loss.detach()), source="digits", n_samples=batch, lr=lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return float(loss.detach())
