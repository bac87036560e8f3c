"""A store with planted output-logit divergence, recorded through the real logit tap.

:func:`planted_logits` gives the logits of every record, ``a_i + s_i * U`` with ``U`` a fixed
standard-normal ``(positions, V)`` pattern: from record *onset* on, the common shift ``a`` rises
linearly to *shift* and the scale ``s`` from 1 to *scale* (the logits' spread: log Z grows by tens
of nats for the defaults).  ``shift=0, scale=1`` is a flat, healthy log Z near ``log V + 1/2``;
a negative *shift* a falling one.  :func:`planted_logits_store` records them live with
``gf.Recorder(..., logits="lm_head")`` on a one-module model whose ``lm_head`` emits exactly those
logits (plus ``h @ Wᵀ`` with ``W`` zero, so it has a gradient), so a test can compare the stored
``logits/lm_head/*`` with ``logsumexp`` of :func:`planted_logits` and the analysis with the plant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["planted_logits", "planted_logits_store"]


def planted_logits(seed: int = 0, n_records: int = 48, onset: int = 16, *, shift: float = 12.0,
                   scale: float = 12.0, vocab: int = 64, positions: int = 32) -> np.ndarray:
    """The planted logits ``(n_records, positions, vocab)``, float32 (see the module doc)."""
    rng = np.random.default_rng([seed, 44])
    pattern = rng.standard_normal((positions, vocab))
    t = np.clip((np.arange(n_records) - onset) / max(n_records - 1 - onset, 1), 0.0, 1.0)
    a = shift * t + 0.05 * rng.standard_normal(n_records)
    s = 1.0 + (scale - 1.0) * t + 0.02 * rng.standard_normal(n_records)
    return (a[:, None, None] + s[:, None, None] * pattern[None]).astype(np.float32)


def planted_logits_store(path: Path, seed: int = 0, n_records: int = 48, onset: int = 16, *, shift: float = 12.0,
                         scale: float = 12.0, mode: str = "training", vocab: int = 64, positions: int = 32) -> Path:
    """Record :func:`planted_logits` at *path* through the logit tap of ``lm_head`` (mode *mode*); returns *path*."""
    import torch
    from torch import nn

    import gradforensics as gf

    logits = torch.from_numpy(planted_logits(seed, n_records, onset, shift=shift, scale=scale, vocab=vocab,
                                             positions=positions))
    dim = 8

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(vocab, dim))
            self.planted: Any = None

        def forward(self, h: Any) -> Any:
            return h @ self.weight.T + self.planted

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = Head()

        def forward(self, h: Any) -> Any:
            return self.lm_head(h)

    torch.manual_seed(seed)
    model = Model()
    h = torch.randn(positions, dim)
    y = torch.randint(0, vocab, (positions,))
    with gf.Recorder(path, model=model, sources=["text"], tensors=["lm_head.weight"], logits="lm_head",
                     mode=mode, overwrite=True) as rec:
        for i in range(n_records):
            model.lm_head.planted = logits[i]
            loss = nn.functional.cross_entropy(model(h), y)
            loss.backward()
            rec.record(step=i, loss=float(loss.detach()), source="text", n_samples=positions, lr=1e-3)
            model.zero_grad(set_to_none=True)
    return Path(path)
