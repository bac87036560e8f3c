"""Twin family ``late-rows``: Adam, embedding rows first seen late (a loss spike) / steady data.

A small byte-level language model (an MLP over the previous ``CONTEXT`` tokens: ``nn.Embedding``
→ ``LayerNorm`` → ``Linear`` → GELU → ``Linear`` to the vocabulary, untied) trained by Adam on
bytes of real text (:func:`gradforensics.testing.real_runs.real_text`), mini-batches of random
windows.  The vocabulary is every byte of the text (ids ``0..B-1``) and a second script: the
same text spelled with ``B`` other tokens (ids ``B..2B-1``, a transliteration; a new language in
miniature).  Half of every batch is in the first script, half in the second:

* ``late`` (sick): until step ``ARRIVAL`` every window is in the first script, so the tokens of
  the second never appear: their embedding rows get no gradient and Adam's ``exp_avg_sq`` of
  those rows stays exactly 0.  From ``ARRIVAL`` on, half of each batch is in the second script:
  the rows arrive with ``v̂ = 0`` (the first update of each element is ``lr·(1-β₁)/√(1-β₂)`` ≈
  3 lr whatever its gradient, and several lr for tens of steps) and the loss spikes.
* ``steady`` (healthy): both scripts from the first step (the same windows, the same seed).

Truth, measured here from the optimizer and the model (not from the store): the loss spike at
``ARRIVAL`` (the loss there minus the median of the ``WINDOW`` steps before), the number of
embedding rows getting a gradient at ``ARRIVAL`` whose ``exp_avg_sq`` is all zero, the
update/weight ratio ‖Δw‖/‖w‖ of the arrival step on the second script's rows over the median
ratio of the other rows that got a gradient; and for the timeline (:func:`onsets`) the step of the
loss spike, the step the most rows with ``exp_avg_sq`` = 0 get a gradient, and the first step the
embedding's ‖Δw‖/‖w‖ jumps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARRIVAL", "STEPS", "onsets", "train"]

STEPS = 120
ARRIVAL = 90
CONTEXT = 8
DIM = 32
HIDDEN = 128
BATCH = 64
LR = 3e-3
WINDOW = 10
EVERY = 4          # optimizer_every: the arrival (90) is off the grid; the stale masks are taken every record
ARMS = ("late", "steady")


def _model(vocab: int, seed: int) -> Any:
    import torch
    from torch import nn

    class ByteMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, DIM)
            self.norm = nn.LayerNorm(CONTEXT * DIM)
            self.hidden = nn.Linear(CONTEXT * DIM, HIDDEN)
            self.act = nn.GELU()
            self.out = nn.Linear(HIDDEN, vocab)

        def forward(self, ctx: torch.Tensor) -> torch.Tensor:
            x = self.embed(ctx).flatten(1)
            return self.out(self.act(self.hidden(self.norm(x))))

    torch.manual_seed(seed)
    return ByteMLP()


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* (``late`` or ``steady``) at *path*; returns the truth measured in torch."""
    import torch
    import torch.nn.functional as F

    import gradforensics as gf
    from gradforensics.testing.real_runs import real_text

    if arm not in ARMS:
        raise ValueError(f"late-rows has arms {', '.join(ARMS)}; got {arm!r}.")
    torch.set_num_threads(1)
    text = real_text(200_000)
    vocab_bytes = sorted(set(text))
    lut = np.zeros(256, dtype=np.int64)
    lut[vocab_bytes] = np.arange(len(vocab_bytes))
    first = lut[np.frombuffer(text, dtype=np.uint8)]
    n_first = len(vocab_bytes)
    model = _model(2 * n_first, seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    rng = np.random.default_rng([seed, 40])
    emb = model.embed.weight
    losses: list[float] = []
    truth: dict[str, float] = {}
    stale_count: list[int] = []       # per step: embedding rows getting a gradient with exp_avg_sq all zero
    emb_ratio: list[float] = []       # per step: ||w_after - w_before|| / ||w_before|| of the embedding
    with gf.Recorder(path, model=model, sources=["text"], optimizer=opt, optimizer_every=EVERY, heads=None,
                     overwrite=True) as rec:
        for step in range(STEPS):
            starts = rng.integers(len(first) - CONTEXT - 1, size=BATCH)
            win = torch.from_numpy(np.stack([first[s:s + CONTEXT + 1] for s in starts]))
            if arm == "steady" or step >= ARRIVAL:
                win[BATCH // 2:] += n_first                 # the second script
            loss = F.cross_entropy(model(win[:, :-1]), win[:, -1])
            loss.backward()
            losses.append(float(loss.detach()))
            rec.record(step=step, loss=loss.item(), source="text", n_samples=BATCH, lr=LR)
            got = torch.zeros(emb.shape[0], dtype=torch.bool)
            got[win[:, :-1].unique()] = True
            state = opt.state.get(emb, {})
            v_now = state.get("exp_avg_sq")
            stale_count.append(int((got & (v_now.sum(dim=1) == 0)).sum()) if v_now is not None and step else 0)
            w_before = emb.detach().clone()
            if step == ARRIVAL:
                hit = torch.zeros(emb.shape[0], dtype=torch.bool)
                hit[win[:, :-1].unique()] = True
                v = opt.state[emb]["exp_avg_sq"]
                zero_v = hit & (v.sum(dim=1) == 0)
                late_hit = hit.clone()
                late_hit[:n_first] = False
                before = emb.detach().clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            emb_ratio.append(float((emb.detach() - w_before).norm() / w_before.norm()))
            if step == ARRIVAL:
                ratio = ((emb.detach() - before).norm(dim=1) / before.norm(dim=1)).numpy()
                others = hit & ~late_hit
                base = float(np.median(ratio[others.numpy()]))
                truth = {
                    "loss_spike": losses[ARRIVAL] - float(np.median(losses[ARRIVAL - WINDOW:ARRIVAL])),
                    "zero_v_rows": float(zero_v.sum()),
                    "late_rows_hit": float(late_hit.sum()),
                    "late_update_ratio": float(np.median(ratio[late_hit.numpy()])) / base,
                }
    truth["loss_last"] = float(np.median(losses[-WINDOW:]))
    truth.update(onsets(losses, stale_count, emb_ratio))
    return truth


def onsets(losses: list[float], stale_count: list[int], emb_ratio: list[float]) -> dict[str, float]:
    """The timeline's truth, from the per-step torch measurements: ``spike`` (the first step whose loss is above
    the mean + 6 sd of the 30 before it), ``onset/stale_share/embed.weight`` (the step whose batch gives a gradient
    to the most embedding rows with ``exp_avg_sq`` all zero: a rare byte seen first is one such row, a new
    script tens) and
    ``onset/update_ratio/embed.weight`` (the first step whose ``||dw|| / ||w||`` of the embedding is above twice the
    median of the 10 before it).  NaN where none."""
    loss = np.asarray(losses, float)
    spike = next((i for i in range(8, loss.size) if loss[i] > loss[max(0, i - 30):i].mean()
                  + 6 * loss[max(0, i - 30):i].std()), None)
    stale = int(np.argmax(stale_count)) if max(stale_count, default=0) > 0 else None
    r = np.asarray(emb_ratio, float)
    jump = next((i for i in range(10, r.size) if r[i] > 2 * np.median(r[i - 10:i])), None)
    return {"spike": float("nan") if spike is None else float(spike),
            "onset/stale_share/embed.weight": float("nan") if stale is None else float(stale),
            "onset/update_ratio/embed.weight": float("nan") if jump is None else float(jump)}
