"""Replay a problem checkpoint per data source, then analyze and report (copy and adapt).

The situation: training went bad, you have the checkpoint.  Load it, run a few
batches from *each* data source through it (no optimizer step), and record one
gradient per batch; the conflict and noise analyses then compare the sources'
mean gradients at that checkpoint.

Runs as-is on a CPU: without ``--checkpoint`` it first trains the demo's tiny
LLaMA-style model for a few steps and saves it, so there is a checkpoint to
replay.  Point ``--checkpoint`` at any ``save_pretrained`` directory of a causal
LM, and replace ``batches()`` with your per-source data loaders.  Usage::

    python examples/replay_per_source.py [--checkpoint DIR] [--out DIR] [--n-per-source N]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

import gradforensics as gf
from gradforensics import demo
from gradforensics.replay import replay


def tiny_checkpoint(path: Path, steps: int) -> Path:
    """Stand-in for your problem checkpoint: the demo's model, briefly trained, saved."""
    model, _ = demo.train(demo.DemoConfig(steps=steps), log=None)
    model.save_pretrained(path)
    return path


def batches(source: str, seed: int) -> Iterator[torch.Tensor]:
    """Stand-in for your data loader of one source: (batch, seq_len) token ids."""
    cfg = demo.DemoConfig()
    yield from demo.batches(demo.make_sources(cfg)[source], cfg, seed)


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss the run was trained with, on one batch."""
    return model(input_ids=batch, labels=batch).loss


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Replay a checkpoint per data source, analyze, report.")
    p.add_argument("--checkpoint", default=None, help="save_pretrained directory (default: a tiny demo model)")
    p.add_argument("--out", default=None, help="directory for the store and the report (default: a temporary one)")
    p.add_argument("--n-per-source", type=int, default=8, help="batches replayed per source")
    p.add_argument("--train-steps", type=int, default=60, help="steps of the stand-in checkpoint")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gf-replay-"))
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM

    ckpt = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(out / "checkpoint", args.train_steps)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.eval()                                        # the checkpoint as it is: no dropout

    sources = ["zh", "en", "code"]
    store = replay(
        model, {s: batches(s, seed=i) for i, s in enumerate(sources)}, loss_fn, out / "dump.zarr",
        n_per_source=args.n_per_source,
        tensors=["*.self_attn.*_proj.weight", "*.mlp.*_proj.weight"],   # default: every 2-D weight
        heads="auto",                                   # q/k/v/o per head (GQA understood)
        activations=["*.mlp.act_fn"],                   # per-unit activation statistics
    )
    findings = gf.analyze(store, progress=False)
    paths = gf.report(findings, out, store=store)
    print(f"{store.n_records} records from {', '.join(store.sources)} -> {store.path}")
    for f in findings.flags[:5]:
        print(f"  {f.severity:.2f} {f.kind:<10} {f.tensor}{'' if f.head is None else f' head {f.head}'}  "
              f"{', '.join(f.sources)}")
    print(f"report: {paths['html']}")
    return out


if __name__ == "__main__":
    main()
