"""Twin family ``mixture``: a small byte-level LM trained on three data sources, one broken / all clean.

The model is a context MLP language model (the last ``CONTEXT`` bytes, embedded and concatenated, a
GELU hidden layer, logits over the 256 bytes), trained by Adam on pure batches of one source each, the
sources in a seeded random order (every record is tagged with its source).  The arms differ in the third source only:

* ``broken``: ``python`` (the Python standard library's sources), ``english`` (the license texts
  under ``/usr/share/common-licenses``) and ``broken``: the synthetic records of the clean arm with
  **random next-byte targets** — nothing to learn, so its loss stays near ``log 256`` while the
  others fall, and its gradient pulls every shared layer against the other two;
* ``clean``: ``python``, ``english`` and ``records``: structured synthetic text (``key=value`` records
  of numbers and words, seeded), three clean sources of *different domains*: their gradients
  disagree (negative cosines are the base rate of a mixture), but none stands out.

The truth, in plain torch and independently of the store: each source's training loss early and
late in the run and its held-out loss at the end, and the cosine between each pair of sources'
mean gradients over the run (the per-step gradients of all parameters, summed per source).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARMS", "CONTEXT", "STEPS", "sources_of", "train"]

ARMS = ("broken", "clean")
CONTEXT = 8          # bytes of context
STEPS = 150          # records (50 per source)
BATCH = 32
LR = 3e-3


def sources_of(arm: str) -> tuple[str, str, str]:
    """The three source names of *arm*."""
    if arm not in ARMS:
        raise ValueError(f"mixture arms are {', '.join(ARMS)}; got {arm!r}.")
    return ("python", "english", "broken" if arm == "broken" else "records")


def _english(max_bytes: int = 200_000) -> bytes:
    """License texts on this machine (else a few docstrings of the standard library)."""
    import glob

    from gradforensics.testing.real_runs import read_files

    out = bytearray(read_files(sorted(glob.glob("/usr/share/common-licenses/*")), max_bytes))
    if len(out) < 20_000:           # no license texts: prose from docstrings
        import collections
        import json
        import pathlib

        for mod in (collections, json, pathlib, math):
            out += "\n".join(str(getattr(mod, n).__doc__ or "") for n in dir(mod) if not n.startswith("_")).encode()
    return bytes(out[:max_bytes])


def _records(seed: int, n_bytes: int = 200_000) -> bytes:
    """Structured synthetic text: ``id=123;name=delta;qty=45;ok=yes`` records, one a line, seeded."""
    rng = np.random.default_rng([seed, 71])
    words = ["alpha", "bravo", "delta", "gamma", "omega", "sigma", "kappa", "theta"]
    out = []
    size = 0
    i = 0
    while size < n_bytes:
        qty = int(rng.integers(0, 100))
        line = (f"id={i};name={words[int(rng.integers(len(words)))]};qty={qty};"
                f"ok={'yes' if qty % 2 == 0 else 'no'}\n")
        out.append(line)
        size += len(line)
        i += 1
    return "".join(out).encode()[:n_bytes]


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(256, 16), nn.Flatten(), nn.Linear(16 * CONTEXT, 96), nn.GELU(),
                         nn.Linear(96, 256))


def _batch(data: np.ndarray, rng: np.random.Generator, n: int, random_targets: bool) -> tuple[Any, Any]:
    import torch

    starts = rng.integers(len(data) - CONTEXT - 1, size=n)
    x = np.stack([data[s:s + CONTEXT] for s in starts])
    y = data[starts + CONTEXT]
    if random_targets:
        y = rng.integers(256, size=n)
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(np.asarray(y, dtype=np.int64))


def train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* at *path*; returns each source's losses and the sources' mean-gradient cosines."""
    import torch
    import torch.nn.functional as F

    import gradforensics as gf
    from gradforensics.testing.real_runs import real_text

    torch.set_num_threads(1)
    names = sources_of(arm)
    records = _records(seed)
    raw = [real_text(200_000), _english(), records]
    data = [np.frombuffer(b, dtype=np.uint8).astype(np.int64) for b in raw]
    held = [d[-20_000:] for d in data]              # held out: the last 20 kB of each source
    data = [d[:-20_000] for d in data]
    broken = [arm == "broken" and k == 2 for k in range(3)]
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    rng = np.random.default_rng([seed, 72])
    params = [p for p in model.parameters()]
    gsum = [torch.zeros(sum(p.numel() for p in params)) for _ in names]
    losses: list[list[float]] = [[] for _ in names]
    order = rng.permutation(np.arange(STEPS) % 3)   # the sources in a seeded random order, 50 records each
    model.train()
    with gf.Recorder(path, model=model, sources=list(names), tensors=["*"], mode="training",
                     overwrite=True) as rec:
        for step in range(STEPS):
            k = int(order[step])
            x, y = _batch(data[k], rng, BATCH, broken[k])
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            gsum[k] += torch.cat([p.grad.reshape(-1) for p in params])
            losses[k].append(float(loss.item()))
            rec.record(step=step, loss=loss.item(), source=names[k], n_samples=BATCH, lr=LR)
            opt.step()
            opt.zero_grad(set_to_none=True)
    truth: dict[str, float] = {}
    model.eval()
    erng = np.random.default_rng([seed, 73])
    with torch.no_grad():
        for k, name in enumerate(names):
            x, y = _batch(held[k], erng, 2048, broken[k])
            truth[f"heldout_loss_{name}"] = float(F.cross_entropy(model(x), y))
            truth[f"loss_early_{name}"] = float(np.mean(losses[k][:5]))
            truth[f"loss_late_{name}"] = float(np.mean(losses[k][-10:]))
    for a in range(3):
        for b in range(a + 1, 3):
            c = F.cosine_similarity(gsum[a], gsum[b], dim=0)
            truth[f"cos_{names[a]}_{names[b]}"] = float(c)
    return truth
