"""One training step of a tiny Mixtral: plain vs the recorder vs ``experts="auto"`` (CPU seconds, side by side).

Run::

    OMP_NUM_THREADS=1 python benchmarks/capture_experts.py [--experts 8] [--layers 4] [--dim 128]

A Hugging Face ``MixtralForCausalLM`` (transformers 5: experts as fused ``(E, ...)`` tensors,
top-2 routing; vocab 1024, width 128, expert width 256, 4 layers, 8 experts) trains with AdamW on
random tokens (batch 8 x 128), one torch thread.  Every mode has its own copy of the model (same
seed) and optimizer; the modes are **interleaved** (each round runs one step of every mode, in a
rotated order, on the same batch).  Per mode, the process CPU time of one step (forward, backward,
``record()``, ``opt.step()``), the minimum over ``--steps`` rounds after one warm-up round.  Every
recorded mode stores countsketches (k = 8) of what it records, the writer on the caller's thread
(``background=False``) so that its CPU time is counted:

* ``plain``: no recorder;
* ``recorder``: the recorder on every 2-D weight (the routers' weights among them);
* ``+router``: the same tensors, plus ``experts="auto"``'s router statistics (load, max share,
  entropy, logit_z: the hooks alone, ``tensors=`` naming the 2-D weights);
* ``+experts``: ``experts="auto"`` with the default selection: the router statistics and every
  fused expert tensor recorded as a unit ``(E, ...)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("plain", "recorder", "+router", "+experts")


def main() -> None:
    import torch
    import transformers
    from torch.nn import functional as F

    import gradforensics as gf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = transformers.MixtralConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=2 * a.dim,
                                     num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=a.experts, num_experts_per_tok=2,
                                     max_position_embeddings=a.seq + 1)

    def extras(mode: str, model: Any) -> dict[str, Any] | None:
        two_d = [n for n, p in model.named_parameters() if p.ndim == 2]
        return {"plain": None, "recorder": {}, "+router": {"experts": "auto", "tensors": two_d},
                "+experts": {"experts": "auto"}}[mode]

    with tempfile.TemporaryDirectory() as d:
        runs: dict[str, tuple[Any, Any, Any]] = {}
        for m in MODES:
            torch.manual_seed(0)
            model = transformers.MixtralForCausalLM(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            kw = extras(m, model)
            rec = None if kw is None else gf.Recorder(os.path.join(d, f"{len(runs)}.zarr"), model=model,
                                                      sources=["a"], heads=None, sketch=8, background=False, **kw)
            runs[m] = (model, opt, rec)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        g = torch.Generator().manual_seed(1)
        for r in range(a.steps + 1):
            xy = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
            for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                model, opt, rec = runs[m]
                t0 = time.process_time()
                logits = model(input_ids=xy[:, :-1]).logits
                loss = F.cross_entropy(logits.reshape(-1, a.vocab), xy[:, 1:].reshape(-1))
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
    print(f"Mixtral V={a.vocab} D={a.dim} E={a.experts} top-2 layers={a.layers}, batch {a.batch}x{a.seq}, 1 thread; "
          f"CPU s per training step, min of {a.steps} interleaved rounds after 1 warm-up")
    print("| mode | CPU s / step | x plain | x recorder |\n|---|---|---|---|")
    for m, v in best.items():
        print(f"| {m} | {v:.3f} | {v / best['plain']:.2f} | {v / best['recorder']:.2f} |")


if __name__ == "__main__":
    main()
