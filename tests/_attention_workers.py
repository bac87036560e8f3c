"""Rank processes of the multi-rank attention test (spawned: importable at top level)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

import gradforensics as gf

STEPS = 3


def tiny_llama(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   attn_implementation="eager")  # type: ignore[call-arg]
    return transformers.LlamaForCausalLM(cfg)


def batch(rank: int, step: int) -> Any:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(100 * step + rank))


def ddp_attention(rank: int, world: int, port: int, out: str) -> None:
    """DDP over *world* gloo ranks, each recording its local batch's attention statistics into one store."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(OMP_NUM_THREADS="1", GRADFORENSICS_RANK_WAIT_S="60")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)
    model = DDP(tiny_llama())
    with gf.Recorder(f"{out}/ddp_attn.zarr", model=model, sources=["a"], attention="auto", sketch=8) as rec:
        for step in range(STEPS):
            x = batch(rank, step)
            model(input_ids=x, labels=x).loss.backward()
            rec.record(step=step, loss=0.0, source="a")
            model.zero_grad()
    np.save(f"{out}/done{rank}.npy", np.array([rank]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
