"""What a record is when the model runs on many ranks (``torch.distributed``).

:func:`context` looks at the process group and the model once, when the
recorder is made:

* ``"ddp"`` - a :class:`~torch.nn.parallel.DistributedDataParallel` model.  A
  record is the rank's *local* micro-batch gradient (its own loss, not divided
  by the world size).  :class:`LocalGrads` takes it with a per-parameter
  post-accumulate-grad hook, which runs when autograd has accumulated the
  gradient and before DDP's own hook hands it to the all-reduce; so the model's
  one communication-hook slot stays free (PowerSGD, fp16 compression).  Inside
  ``no_sync()`` nothing is reduced and the hook keeps nothing: ``.grad`` holds
  the local sum.  With ``gradient_as_bucket_view=True`` ``.grad`` is a view of
  the bucket the all-reduce overwrites, which is why the hook clones it.
* ``"fsdp"`` - parameters are DTensors (``fully_shard``).  A record is the
  step's reduced gradient, what the optimizer sees; :func:`fsdp_record` builds
  it: sketches are summed from per-shard partial projections (a projection is
  linear: the sketch of the whole gradient is the sum of the sketches of its
  shards, zero elsewhere, so heads that cross a shard boundary need nothing
  special), and only ``k`` floats per head cross between ranks; a whole gradient
  is gathered (:func:`gather_full`) on the rank that writes the record: record
  ``t`` is written by rank ``t mod R``.
* ``"local"`` - any other model under a process group of more than one rank:
  each rank records its own ``.grad`` (as ``"ddp"``, without hooks).

The store side (who writes which chunk, the commit) is :mod:`gradforensics.store.ranks`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.store.ranks import RankPlan

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    from gradforensics.recording.sketch import DeviceSketch
    from gradforensics.store.heads import HeadSpec

__all__ = [
    "KINDS",
    "Context",
    "LocalGrads",
    "context",
    "fsdp_sketches",
    "gather_full",
    "is_dtensor",
    "partial_sketch",
    "reduce_meta",
    "shard_rows",
    "unwrap",
]


KINDS = ("ddp", "fsdp", "local")


@dataclass(frozen=True)
class Context:
    """This rank in its process group, and how the model is distributed."""

    rank: int
    world: int
    kind: str

    def plan(self) -> RankPlan:
        import torch.distributed as dist

        return RankPlan(self.rank, self.world, barrier=dist.barrier, share=_from_rank0, kind=self.kind)


def _from_rank0(word: Any) -> Any:
    """Rank 0's *word* on every rank (a broadcast; the others' *word* is ignored)."""
    import torch.distributed as dist

    box = [word]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def context(model: nn.Module) -> Context | None:
    """The distributed context of *model*, or ``None`` outside a process group of two or more ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        kind = "ddp"
    elif any(is_dtensor(p) for p in model.parameters()):
        kind = "fsdp"
    else:
        kind = "local"
    return Context(dist.get_rank(), dist.get_world_size(), kind)


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names the store uses (DDP's ``module``; FSDP2 keeps the names)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


class LocalGrads:
    """Each DDP rank's local gradient, taken before the all-reduce by post-accumulate-grad hooks."""

    def __init__(self, ddp: nn.Module, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.ddp = ddp
        self.latest: dict[str, torch.Tensor] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in params.items()]

    def _hook(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            if getattr(self.ddp, "require_backward_grad_sync", True) and p.grad is not None:
                self.latest[name] = p.grad.detach().clone()   # the all-reduce is about to overwrite it
            else:
                self.latest.pop(name, None)                   # no_sync(): .grad stays local

        return hook

    def take(self, name: str, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The local gradient of *name* since the last record (``None``: no backward ran)."""
        g = self.latest.pop(name, None)
        if g is not None:
            return g
        return None if p.grad is None else p.grad.detach()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.latest.clear()


# ------------------------------------------------------------------ FSDP2
def shard_rows(g: DTensor) -> tuple[torch.Tensor, int]:
    """The local block of a DTensor sharded on dim 0 and its first row in the full tensor."""
    from torch.distributed.tensor import Shard

    placements = tuple(g.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise SpecError(f"FSDP capture reads gradients sharded on dim 0 over one mesh dimension; got placements "
                        f"{placements}. Record from a 1-D fully_shard mesh.")
    import torch.distributed as dist

    if g.device_mesh.size() != dist.get_world_size():
        raise SpecError(f"FSDP capture reads a mesh over every rank; this gradient's mesh has "
                        f"{g.device_mesh.size()} of {dist.get_world_size()} ranks.")
    local = g.to_local()
    rows = int(g.shape[0])
    step = -(-rows // g.device_mesh.size())      # fully_shard splits dim 0 as torch.chunk does
    return local, min(g.device_mesh.get_local_rank() * step, rows)


def gather_full(g: DTensor, owner: int) -> torch.Tensor | None:
    """The whole gradient on rank *owner* (``None`` elsewhere): one gather of the row blocks, not an all-gather."""
    import torch
    import torch.distributed as dist

    local, _ = shard_rows(g)
    rows, world = int(g.shape[0]), dist.get_world_size()
    step = -(-rows // world)
    block = torch.zeros((step, *g.shape[1:]), dtype=local.dtype, device=local.device)
    block[:local.shape[0]] = local
    mine = dist.get_rank() == owner
    parts = [torch.empty_like(block) for _ in range(world)] if mine else None
    dist.gather(block, parts, dst=owner)
    return torch.cat(parts)[:rows] if parts is not None else None


def partial_sketch(g: DTensor, spec: HeadSpec | None, sk: DeviceSketch, rows: bool = False) -> torch.Tensor:
    """This rank's share of the sketch of a sharded gradient: the sketch of its shard, zero elsewhere.
    *rows*: one sketch per block of axis 0 (the experts of a mixture-of-experts unit), ``(E, k)``."""
    import torch

    local, start = shard_rows(g)
    full = torch.zeros(tuple(g.shape), dtype=local.dtype, device=local.device)
    full[start:start + local.shape[0]] = local
    return sk.project_rows(full) if rows else sk.project_heads(full, spec)


def fsdp_sketches(grads: Mapping[str, DTensor], specs: Mapping[str, HeadSpec | None],
                  sk: DeviceSketch, rows: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Sketches of the full reduced gradients: one all-reduce of every tensor's partial sketches (per expert
    for the tensors in *rows*)."""
    import torch
    import torch.distributed as dist

    parts = {n: partial_sketch(g, specs.get(n), sk, n in rows) for n, g in grads.items()}
    flat = torch.cat([p.reshape(-1) for p in parts.values()])
    dist.all_reduce(flat)
    out, at = {}, 0
    host = flat.to(torch.float32).cpu().numpy()     # k floats per head: all that crosses to the host
    for n, p in parts.items():
        out[n] = host[at:at + p.numel()].reshape(tuple(p.shape))
        at += p.numel()
    return out


def reduce_meta(loss: float, n_samples: int, mixture_row: np.ndarray) -> tuple[float, int, np.ndarray]:
    """FSDP record metadata: mean loss over ranks, summed samples, the mixture weighted by samples."""
    import torch
    import torch.distributed as dist

    v = torch.tensor([loss if math.isfinite(loss) else 0.0, 1.0 if math.isfinite(loss) else 0.0, n_samples,
                      *(mixture_row * n_samples)], dtype=torch.float64)
    dist.all_reduce(v)
    mean_loss = float(v[0] / v[1]) if v[1] > 0 else math.nan
    return mean_loss, int(v[2]), v[3:].numpy()
