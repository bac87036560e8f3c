"""``gradforensics capture`` under ``torchrun``: one process per device, one store.

``torchrun --nproc-per-node R -m gradforensics capture CHECKPOINT ...`` starts R
copies of the command; each finds its rank in the environment torchrun sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
joins the process group (NCCL on CUDA, gloo on the CPU), and then

* by default shards the checkpoint with ``fully_shard`` (each transformer block,
  then the root) and replays each source's batches across the ranks: record
  ``i`` of a source is the reduced gradient of ``R`` micro-batches, rank ``q``
  taking batch ``i * R + q`` (:func:`rank_batches`);
* with ``--check-ranks`` keeps the whole model on every rank and replays the
  *same* batches everywhere: the store (``extra.replicated``) is the input of
  the ``rankconsistency`` analysis, which names a rank that computes a
  different gradient for the same batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ENV", "Launch", "blocks", "finish", "from_env", "init", "rank_batches", "shard"]


ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Launch:
    """This process's rank under torchrun, and the device it uses."""

    rank: int
    world: int
    local_rank: int
    device: str


def from_env(device: str, environ: Mapping[str, str] | None = None) -> Launch | None:
    """The torchrun launch of this process, or ``None`` when it runs alone (no ``WORLD_SIZE`` > 1)."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1") or 1) < 2:
        return None
    missing = [k for k in ENV if k not in env]
    if missing:
        raise SpecError(f"WORLD_SIZE is {env['WORLD_SIZE']} but {', '.join(missing)} is not set; start "
                        "`gradforensics capture` on many ranks with torchrun --nproc-per-node R.")
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if device.startswith("cuda"):
        device = f"cuda:{local}"           # one device per process, whatever --device named
    return Launch(rank, world, local, device)


def init(launch: Launch) -> None:
    """Join the process group torchrun described (NCCL on CUDA, gloo on the CPU)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if launch.device.startswith("cuda"):
        torch.cuda.set_device(launch.device)
    dist.init_process_group("nccl" if launch.device.startswith("cuda") else "gloo")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of *model*: the members of its largest ``ModuleList`` (a transformer's layers)."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def shard(model: nn.Module, world: int, device: str) -> nn.Module:
    """``fully_shard`` each block of *model*, then the root, over a 1-D mesh of *world* ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_batches(batches: Mapping[str, Sequence[Any]], rank: int, world: int) -> dict[str, list[Any]]:
    """Rank *rank*'s share: batches ``rank, rank + R, rank + 2R, ...`` of every source."""
    return {s: list(b[rank::world]) for s, b in batches.items()}


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
