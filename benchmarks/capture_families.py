"""One training step of a nanoGPT-style model: plain vs each capture tap vs all together (CPU seconds).

Run::

    OMP_NUM_THREADS=1 python benchmarks/capture_families.py [--vocab 8192] [--layers 4] [--dim 128]

A nanoGPT-style model (SDPA, fused q|k|v ``nn.Linear``, tied embeddings; 4 layers, width 128,
4 heads) trains with AdamW on random tokens (batch 8 x 128), one torch thread.  Every mode has
its own copy of the model (same seed) and optimizer; the modes are **interleaved** - each round
runs one step of every mode, in a rotated order, on the same batch - so that a noisy shared
machine slows them alike.  Per mode, the process CPU time of one step (forward, backward,
``record()``, ``opt.step()``), the minimum over ``--steps`` rounds after one warm-up round.
Every recorded mode stores countsketches (k = 8) of every 2-D weight, no head split, with the
writer on the caller's thread (``background=False``) so that its CPU time is counted:

* ``plain``: no recorder;
* ``recorder``: the recorder, nothing else;
* ``+attention``: ``attention="auto"`` (the SDPA tap, every block);
* ``+logits``: ``logits="auto"`` (the tied ``lm_head``);
* ``+optimizer``: ``optimizer=opt, optimizer_every=1`` (the worst case: every record);
* ``all``: the three together.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("plain", "recorder", "+attention", "+logits", "+optimizer", "all")


def main() -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import gradforensics as gf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    V, D, T, H = a.vocab, a.dim, a.seq, a.heads

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.c_attn(x).split(D, dim=2))
            return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                               .reshape(b, t, D))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2, self.attn = nn.LayerNorm(D), nn.LayerNorm(D), Attention()
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class NanoGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList([Block() for _ in range(a.layers)])
            self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    def extras(mode: str, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        att, lg, op = {"attention": "auto"}, {"logits": "auto"}, {"optimizer": opt, "optimizer_every": 1}
        return {"plain": None, "recorder": {}, "+attention": att, "+logits": lg, "+optimizer": op,
                "all": {**att, **lg, **op}}[mode]

    with tempfile.TemporaryDirectory() as d:
        runs: dict[str, tuple[Any, Any, Any]] = {}
        for m in MODES:
            torch.manual_seed(0)
            model = NanoGPT()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            kw = extras(m, opt)
            rec = None if kw is None else gf.Recorder(os.path.join(d, f"{len(runs)}.zarr"), model=model,
                                                      sources=["a"], heads=None, sketch=8, background=False, **kw)
            runs[m] = (model, opt, rec)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        g = torch.Generator().manual_seed(1)
        for r in range(a.steps + 1):
            xy = torch.randint(0, V, (a.batch, T + 1), generator=g)
            for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                model, opt, rec = runs[m]
                t0 = time.process_time()
                logits = model(xy[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, V), xy[:, 1:].reshape(-1))
                loss.backward()
                if rec is not None:
                    rec.record(step=r, loss=loss, source="a")
                opt.step()
                opt.zero_grad()
                if r >= 1:
                    times[m].append(time.process_time() - t0)
        for _, _, rec in runs.values():
            if rec is not None:
                rec.close()
    best = {m: min(v) for m, v in times.items()}
    print(f"nanoGPT-style V={V} D={D} H={H} layers={a.layers}, batch {a.batch}x{T}, 1 thread; "
          f"CPU s per training step, min of {a.steps} interleaved rounds after 1 warm-up")
    print("| mode | CPU s / step | x plain |\n|---|---|---|")
    for m, v in best.items():
        print(f"| {m} | {v:.3f} | {v / best['plain']:.2f} |")


if __name__ == "__main__":
    main()
