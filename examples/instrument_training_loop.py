"""Instrument a PyTorch training loop with gradforensics (copy this into your own loop).

Runs as-is on a CPU in a few seconds: a tiny LLaMA-style model (random init,
grouped-query attention) trains on random tokens from two "data sources",
with gradient accumulation, and every optimizer step is recorded:

* the accumulated gradient of every 2-D weight, attention weights split per head;
* per-unit statistics of the MLP activations;
* a weight snapshot every 4 records.

Then the store is opened and summarised.  Usage::

    python examples/instrument_training_loop.py [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gradforensics as gf


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def loader(steps: int, micro_batches: int):
    """Yields (list of micro-batches, source) per optimizer step; stands in for your data loader."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        source = ("web", "code")[step % 2]
        low, high = (0, 128) if source == "web" else (128, 256)    # the sources differ in vocabulary
        yield [torch.randint(low, high, (4, 32), generator=g) for _ in range(micro_batches)], source


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Instrument a training loop with gradforensics.")
    p.add_argument("--out", default=None, help="directory for the store (default: a new temporary one)")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gf-example-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dump.zarr"                     # or "dump.h5"

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = 2
    with gf.Recorder(path, model=model, sources=["web", "code"],
                     tensors=["*.self_attn.*_proj.weight", "*.mlp.*.weight"],   # default: every 2-D weight
                     heads="auto",                  # q/k/v/o per head, GQA from the config
                     activations=["*.mlp.act_fn"],  # per-unit statistics of these modules' outputs
                     weights_every=4, overwrite=True) as rec:   # replaces only a gradforensics store
        for step, (micro_batches, source) in enumerate(loader(args.steps, micro)):
            tokens = 0
            for ids in micro_batches:               # gradient accumulation: .grad sums them
                loss = model(input_ids=ids, labels=ids).loss / micro
                loss.backward()
                tokens += ids.numel()
            # after the last backward, before zero_grad: records the accumulated .grad
            rec.record(step=step, loss=loss.item() * micro, source=source,
                       n_samples=len(micro_batches) * micro_batches[0].shape[0],
                       lr=opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad(set_to_none=True)

    store = gf.open_store(path)
    print(f"{path}: {store.n_records} records, sources {list(store.sources)}, mode {store.mode}")
    q = "model.layers.0.self_attn.q_proj.weight"
    print(f"{q}: stored as {store.grads[q].shape} (records, heads, rows, cols), role {store.grads[q].attrs['role']}")
    print(f"activation modules: {store.act_modules}; weight snapshots at records {store.weight_records().tolist()}")
    print(f"next: gradforensics inspect {path}   and   gradforensics analyze {path} --out {out / 'report'}")
    return path


if __name__ == "__main__":
    main()
