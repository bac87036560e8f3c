"""A store with planted mixture-of-experts routing trouble, recorded through the real ``experts=`` capture.

:func:`planted_experts_store` records a one-layer MoE (``moe.gate`` a router whose logits are
``x Wᵀ + b_i``, ``moe.experts`` a list of E linear experts, ``top_k`` on the block) with
``gf.Recorder(..., experts="auto")``.  From record *onset* on the planted bias ``b_i``:

* ``collapse``: +8 on expert 0 (it enters every token's top k: max share 1/k);
* ``dead``: -30 on the last expert (it gets no token);
* ``starve``: multiplies the router's gradient by ``starve`` from the first record (the combine
  weights are ``w.detach() + starve * (w - w.detach())``: the forward is unchanged, the router's
  gradient ``starve`` times what it would be);
* none of these: a healthy, balanced router.

*sources* > 1 alternates the records between sources ``s0, s1, ...``.

:func:`planted_expert_units_store` writes per-expert gradients directly (``gf.Recorder(path,
experts={"moe.*": E})``, no model): the unit ``moe.w`` ``(N, E, 8, 6)``, each expert ``e`` a fixed
unit direction ``d_e`` plus noise, and an ordinary tensor ``other.w`` of pure noise.  Sources ``s0``
and ``s1`` alternate.  ``drift``: from record *onset* expert *j*'s direction turns from ``d_j`` to a
direction orthogonal to it over ten records and stays there (the loss flat, 2.0);
``conflict``: source ``s1`` pulls expert *j* along ``-d_j`` while ``s0`` pulls it along ``d_j``
(every other expert alike for both), and ``s1``'s loss stays at 2.0 while ``s0``'s falls.

Two more kinds judge each expert as a matrix of its own (experts ``(24, 24)``, a Gaussian ``d_e`` of
stable rank about 6): ``rank``: from record *onset* expert *j*'s gradient is one rank-1 direction ``u vᵀ``
(its window-mean gradient's stable rank falls from about 6 to about 1; the others' stay);
``precision``: the weights are recorded too (``W_e`` about 1, minus the lr-scaled gradient each record,
lr 0.05, gradient elements about 1), expert *j*'s weights 1000 times larger and its gradient a tenth,
so its updates (about 5e-3) sit far below half a bf16 ULP of its weights (4 near 1000) - every one
swamped - while the others' (about 0.05) move by several ULPs (half an ULP near 1: 0.004).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["planted_expert_units_store", "planted_experts_store"]


def planted_experts_store(path: Path, seed: int = 0, n_records: int = 40, onset: int = 16, *, collapse: bool = False,
                          dead: bool = False, starve: float = 1.0, experts: int = 8, top_k: int = 2,
                          tokens: int = 64, sources: int = 1, mode: str = "training") -> Path:
    """Record the planted MoE at *path* (see the module doc); returns *path*."""
    import torch
    from torch import nn

    import gradforensics as gf

    dim = 16
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 43])

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(0.3 * torch.randn(experts, dim))
            self.planted = torch.zeros(experts)

        def forward(self, x: Any) -> Any:
            return x @ self.weight.T + self.planted

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.top_k = top_k
            self.gate = Gate()
            self.experts = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(experts))

        def forward(self, x: Any) -> Any:
            p = torch.softmax(self.gate(x), -1)
            p = p.detach() + starve * (p - p.detach())
            w, idx = torch.topk(p, top_k, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
            return out

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = Moe()

        def forward(self, x: Any) -> Any:
            return self.moe(x)

    model = Model()
    target = torch.randn(tokens, dim)
    names = [f"s{i}" for i in range(sources)]
    with gf.Recorder(path, model=model, sources=names, experts="auto", mode=mode, overwrite=True) as rec:
        for i in range(n_records):
            b = torch.zeros(experts)
            if i >= onset:
                if collapse:
                    b[0] = 8.0
                if dead:
                    b[-1] = -30.0
            model.moe.gate.planted = b
            x = torch.from_numpy(rng.standard_normal((tokens, dim)).astype(np.float32))
            loss = ((model(x) - target) ** 2).mean()
            loss.backward()
            rec.record(step=i, loss=float(loss.detach()), source=names[i % sources], n_samples=tokens, lr=1e-3)
            model.zero_grad(set_to_none=True)
    return Path(path)


def planted_expert_units_store(path: Path, kind: str, *, seed: int = 0, n_records: int = 48, experts: int = 4,
                               expert: int = 2, onset: int = 20, noise: float = 0.5) -> Path:
    """Record the per-expert planted store of *kind* (``drift``, ``conflict``, ``rank`` or ``precision``) at *path*
    (see the module doc)."""
    import gradforensics as gf

    if kind not in ("drift", "conflict", "rank", "precision"):
        raise ValueError(f"kind must be 'drift', 'conflict', 'rank' or 'precision', not {kind!r}")
    shape = (8, 6) if kind in ("drift", "conflict") else (24, 24)
    rng = np.random.default_rng([seed, 4343])
    d = rng.standard_normal((experts, *shape))
    d /= np.linalg.norm(d.reshape(experts, -1), axis=1).reshape(experts, 1, 1)
    u, v = rng.standard_normal(shape[0]), rng.standard_normal(shape[1])
    rank1 = np.outer(u, v) / (np.linalg.norm(u) * np.linalg.norm(v))
    w = 1.0 + 0.1 * d * np.sqrt(np.prod(shape))
    w[expert] *= 1000.0
    o = rng.standard_normal(shape)
    o -= (o * d[expert]).sum() * d[expert]
    o /= np.linalg.norm(o)
    names = ["s0", "s1"]
    with gf.Recorder(path, sources=names, experts={"moe.*": experts}, mode="training", overwrite=True) as rec:
        for i in range(n_records):
            src = names[i % 2]
            g = d.copy()
            if kind == "drift" and i >= onset:
                t = min(1.0, (i - onset) / 10) * np.pi / 2
                g[expert] = np.cos(t) * d[expert] + np.sin(t) * o
            if kind == "conflict" and src == "s1":
                g[expert] = -d[expert]
            if kind == "rank" and i >= onset:
                g[expert] = rank1
            g += noise * rng.standard_normal(g.shape) / np.sqrt(np.prod(shape))
            loss = 2.0 if kind in ("drift", "rank", "precision") or src == "s1" else 2.0 - i / n_records
            weights = None
            if kind == "precision":
                g *= np.sqrt(np.prod(shape))            # elements about 1: updates about lr = 0.05 (expert j: 5e-3)
                g[expert] *= 0.1
                w = w - 0.05 * g
                weights = {"moe.w": w.astype(np.float32)}
            rec.record(step=i, loss=loss, source=src, n_samples=8, weights=weights,
                       grads={"moe.w": g.astype(np.float32), "other.w": rng.standard_normal((5, 5)).astype(np.float32)})
    return Path(path)
