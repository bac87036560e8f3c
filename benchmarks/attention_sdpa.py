"""Cost of SDPA attention statistics (``attention=`` on a non-Hugging-Face model) on one CPU training step.

Run::

    OMP_NUM_THREADS=1 python benchmarks/attention_sdpa.py

A nanoGPT-style model (fused q|k|v ``nn.Linear``, ``scaled_dot_product_attention`` with
``is_causal``, tied embeddings; 4 layers, width 128, 4 heads, batch 8 × 128 tokens).  One
training step = forward, backward, AdamW step.  Timed alternating, the best of 5 in process
CPU seconds:

* plain;
* with the SDPA taps (:func:`gradforensics.recording.sdpa.open_taps`) and their per-step
  ``take()`` (the statistics' host copy) - the attention statistics alone;
* ``gf.Recorder`` without and with ``attention="auto"`` (a countsketch of every 2-D weight's
  gradient, ``record()`` every step).

The figures in ``docs/attention.md`` come from this script.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def model_and_batch() -> tuple[object, object]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    V, D, H, T, L, B = 256, 128, 4, 128, 4, 8

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.c_attn(x).split(D, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, D))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.Sequential(*(Block() for _ in range(L)))
            self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.ln_f(self.blocks(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))))

    torch.manual_seed(0)
    return GPT(), torch.randint(0, V, (B, T))


def main() -> None:
    import torch
    from torch.nn import functional as F

    import gradforensics as gf
    from gradforensics.recording.sdpa import open_taps

    torch.set_num_threads(1)
    d = Path(tempfile.mkdtemp())
    keys = ("plain", "taps", "recorder", "recorder+attention")
    runs = {}
    for key in keys:                    # one model each (same seed, same work), so that each keeps its taps open
        model, ids = model_and_batch()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)     # type: ignore[attr-defined]
        taps = open_taps(model, "auto") if key == "taps" else None    # type: ignore[arg-type]
        rec = gf.Recorder(d / f"{len(runs)}.zarr", model=model, sources=["a"], heads=None, sketch=64,
                          attention="auto" if key == "recorder+attention" else None) if key.startswith("rec") else None

        def step(model: object = model, ids: object = ids, opt: object = opt, taps: object = taps,
                 rec: object = rec) -> None:
            logits = model(ids)                                   # type: ignore[operator]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))  # type: ignore[index]
            loss.backward()
            if taps is not None:
                taps.take()                                       # type: ignore[attr-defined]
            if rec is not None:
                rec.record(step=0, loss=loss, source="a")         # type: ignore[attr-defined]
            opt.step()                                            # type: ignore[attr-defined]
            opt.zero_grad()                                       # type: ignore[attr-defined]

        step()                          # warm-up; 'auto' discovers the attention modules here
        runs[key] = (step, rec)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(5):
        for key in keys:
            t = time.process_time()
            runs[key][0]()
            times[key].append(time.process_time() - t)
    for _, rec in runs.values():
        if rec is not None:
            rec.close()                 # type: ignore[attr-defined]
    base = min(times["plain"])
    for key, ts in times.items():
        print(f"{key:>20}: {min(ts):.4f} s CPU (min of 5)  ratio to plain {min(ts) / base:.3f}")


if __name__ == "__main__":
    main()
