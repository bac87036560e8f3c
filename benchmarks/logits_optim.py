"""A training step plain vs with output-logit statistics vs with live optimizer summaries (CPU seconds).

Run::

    OMP_NUM_THREADS=1 python benchmarks/logits_optim.py [--vocab 8192] [--layers 2] [--dim 64]

A nanoGPT-style model (SDPA, fused q|k|v ``nn.Linear``, tied embeddings) trains with
AdamW on random tokens (batch 4 x 64).  Per mode, the process CPU time of one step
(forward, backward, ``record()``, ``opt.step()``), the minimum over 5 steps after 2 warm-up
steps; every recorded mode stores countsketches (k = 8) of every 2-D weight, no head split,
the writer on the caller's thread (``background=False``) so that its CPU time is counted:

* ``unrecorded``: no recorder;
* ``recorded``: the recorder, nothing else;
* ``+logits``: ``logits="auto"`` (the tied ``lm_head``);
* ``+optimizer``: ``optimizer=opt, optimizer_every=1`` (the worst case: every record).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import gradforensics as gf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    V, D, T, H = a.vocab, a.dim, a.seq, 4

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.c_attn(self.ln1(x)).split(D, dim=2))
            x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                                .reshape(b, t, D))
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

    def run(mode: str) -> float:
        torch.manual_seed(0)
        model = NanoGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        extra = {"recorded": {}, "+logits": {"logits": "auto"},
                 "+optimizer": {"optimizer": opt, "optimizer_every": 1}}.get(mode)
        times = []
        with tempfile.TemporaryDirectory() as d:
            rec = None if extra is None else gf.Recorder(os.path.join(d, "r.zarr"), model=model, sources=["a"],
                                                         heads=None, sketch=8, background=False, **extra)
            for i in range(a.steps + 2):
                xy = torch.randint(0, V, (4, T + 1))
                t0 = time.process_time()
                logits = model(xy[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, V), xy[:, 1:].reshape(-1))
                loss.backward()
                if rec is not None:
                    rec.record(step=i, loss=loss, source="a")
                opt.step()
                opt.zero_grad()
                if i >= 2:
                    times.append(time.process_time() - t0)
            if rec is not None:
                rec.close()
        return min(times)

    res = {m: run(m) for m in ("unrecorded", "recorded", "+logits", "+optimizer")}
    print(f"nanoGPT-style V={V} D={D} layers={a.layers}, batch 4x{T}, CPU s per step (min of {a.steps})")
    print("| mode | CPU ms / step | x unrecorded | x recorded |\n|---|---|---|---|")
    for m, v in res.items():
        print(f"| {m} | {v * 1e3:.1f} | {v / res['unrecorded']:.2f} | {v / res['recorded']:.2f} |")


if __name__ == "__main__":
    main()
