"""The ranks' side of tests/test_multirank.py: what each gloo process runs (imported by the spawned children).

Kept apart from the test module so that a child imports torch and gradforensics
only, not the fixtures' dependencies (transformers, tokenizers).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

import gradforensics as gf

K = 64


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GRADFORENSICS_RANK_WAIT_S="60")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)


def tiny(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


HEADS = {"0.weight": 2}    # 2 heads of 3 rows: on 4 ranks FSDP's shard boundaries (rows 2, 4) cut both heads
WORLD = 4


def batch(rank: int, step: int, micro: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)


def loss_of(model: Any, b: tuple[Any, Any]) -> Any:
    x, y = b
    return ((model(x) - y) ** 2).mean()


def worker(rank: int, world: int, port: int, out: str) -> None:
    """Everything the 4-rank tests read: DDP, FSDP2, replicated replays, a loss series, then a kill -9."""
    _init(rank, world, port)
    ddp_part(rank, out)
    fsdp_part(rank, world, out)
    consistency_part(rank, out)
    series_part(rank, out)
    kill_part(rank, out)
    torch.distributed.destroy_process_group()


def ddp_part(rank: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny()
    ddp = DDP(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)    # the user's one slot stays theirs
    oracle = tiny()
    want = []
    with gf.Recorder(f"{out}/ddp.zarr", model=ddp, sources=["a", "b"], heads=HEADS, sketch=K, full=["*"]) as rec:
        for step in range(3):
            micro = 2 if step == 1 else 1         # step 1 accumulates two micro-batches under no_sync()
            oracle.zero_grad()
            total = 0.0
            for m in range(micro):
                b = batch(rank, step, m)
                if m < micro - 1:
                    with ddp.no_sync():
                        loss_of(ddp, b).backward()
                else:
                    loss_of(ddp, b).backward()
                ol = loss_of(oracle, b)
                ol.backward()
                total += float(ol)
            rec.record(step=step, loss=total, source="ab"[rank % 2], n_samples=5 * micro)
            want.append({n: p.grad.numpy().copy() for n, p in oracle.named_parameters() if p.ndim == 2})
            reduced = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.ndim == 2}
            ddp.zero_grad()
    np.savez(f"{out}/oracle{rank}.npz", **{f"{s}|{n}": g for s, w in enumerate(want) for n, g in w.items()})
    np.savez(f"{out}/reduced{rank}.npz", **reduced)


def fsdp_part(rank: int, world: int, out: str) -> None:
    """FSDP2 on the same process group: each step's reduced gradient, written by rank ``step mod R``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with gf.Recorder(f"{out}/fsdp.zarr", model=model, sources=["a", "b"], heads=HEADS, sketch=K, full=["*"],
                     mode="replay") as rec:
        for step in range(3):
            loss = loss_of(model, batch(rank, step))
            loss.backward()
            rec.record(step=step, loss=loss, source="ab"[rank % 2], n_samples=5)
            model.zero_grad()


def consistency_part(rank: int, out: str) -> None:
    model = tiny()
    for name in ("same", "bad"):
        hook = None
        if name == "bad" and rank == 1:     # planted: rank 1's device gets one weight's gradient 1% wrong
            hook = model[0].weight.register_hook(lambda g: g * 1.01)
        with gf.Recorder(f"{out}/{name}.zarr", model=model, sources=["a"], heads=HEADS, sketch=K, mode="replay",
                         extra={"replicated": True}) as rec:
            for i in range(3):
                model.zero_grad()
                loss = loss_of(model, batch(0, i))      # the same batches on every rank
                loss.backward()
                rec.record(step=0, loss=loss, source="a", n_samples=5)
        if hook is not None:
            hook.remove()


def series_part(rank: int, out: str) -> None:
    model = tiny()
    rng = np.random.default_rng(rank)
    with gf.Recorder(f"{out}/series.zarr", model=model, sources=["a"], tensors=["2.weight"], sketch=8) as rec:
        for t in range(64):    # a loss oscillation every rank shares (period 8) plus each rank's own noise
            model.zero_grad()
            loss_of(model, batch(rank, t)).backward()
            rec.record(step=t, loss=1.0 + 0.5 * np.sin(2 * np.pi * t / 8) + 0.1 * rng.standard_normal(),
                       source="a", n_samples=5)


def kill_part(rank: int, out: str) -> None:
    model = tiny()
    with gf.Recorder(f"{out}/killed.zarr", model=model, sources=["a"], tensors=["0.weight"]) as rec:
        for t in range(6):
            model.zero_grad()
            loss_of(model, batch(rank, t)).backward()
            rec.record(step=t, loss=float(rank), source="a", n_samples=5)
            if rank == 1 and t == 2:
                rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)     # rank 1 dies with 3 records written


# ------------------------------------------------------------------ under torchrun (not mp.spawn)
def ddp_sigterm(out: str) -> None:
    """DDP under torchrun: rank 1 dies (kill -9) after 3 synced records; rank 0 goes on until torchrun's SIGTERM.

    Rank 0 keeps recording local micro-batches under ``no_sync()`` (no collective
    to fail on), so what stops it is torchrun's SIGTERM; after each ``record()``
    returns it writes how many have returned to ``returned<rank>``.
    """
    import time
    from pathlib import Path

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    ddp = DDP(tiny())
    returned = Path(out) / f"returned{rank}"
    with gf.Recorder(f"{out}/ddp_term.zarr", model=ddp, sources=["a"], tensors=["0.weight"]) as rec:
        for t in range(3000):
            ddp.zero_grad()
            if t < 3:
                loss_of(ddp, batch(rank, t)).backward()       # synced: both ranks take part
            else:
                with ddp.no_sync():                           # local: rank 0 runs on alone
                    loss_of(ddp, batch(rank, t)).backward()
            rec.record(step=t, loss=float(rank), source="a", n_samples=5)
            (returned.parent / f".{returned.name}").write_text(str(t + 1))
            os.replace(returned.parent / f".{returned.name}", returned)
            if rank == 1 and t == 2:
                rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)         # rank 1 dies with 3 records written
            time.sleep(0.01)


if __name__ == "__main__":    # python -m torch.distributed.run --nproc-per-node 2 _multirank_workers.py NAME OUT
    import sys

    {"ddp_sigterm": ddp_sigterm}[sys.argv[1]](sys.argv[2])




# ------------------------------------------------------------------ a rank that dies writing its marker
class _DieAtRename:
    """Stands in for ``os`` inside :mod:`gradforensics.store.ranks`: once armed, the marker's rename kills the rank."""

    armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def replace(self, src: Any, dst: Any) -> None:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)      # the temporary is written, the rename never happens
        os.replace(src, dst)


def temporaries_worker(rank: int, world: int, port: int, out: str, before: int) -> None:
    """Rank 1 of 2 is killed between writing its marker's temporary and renaming it, after *before* records.

    ``before=0``: at its first marker (written at open), so ``ranks/1`` holds the temporary alone;
    ``before=3``: at the marker after its 4th record, next to the marker of 3.  Rank 0 records 4 and closes.
    """
    import gradforensics.store.ranks as ranks

    _init(rank, world, port)
    shim = _DieAtRename()
    if rank == 1:
        ranks.os = shim     # type: ignore[assignment]
        shim.armed = before == 0
    model = tiny()
    rec = gf.Recorder(f"{out}/store.zarr", model=model, sources=["a"], tensors=["0.weight"])
    for t in range(4 if rank == 0 else before + 1):
        model.zero_grad()
        loss_of(model, batch(rank, t)).backward()
        if rank == 1 and t == before:
            rec.flush()
            shim.armed = True
        rec.record(step=t, loss=float(rank), source="a", n_samples=5)
    rec.close()


# ------------------------------------------------------------------ experts= under FSDP2 (tests/test_experts_fsdp.py)
MOE_E, MOE_D, MOE_H, MOE_TOKENS = 4, 6, 5, 16


class _FusedExperts(torch.nn.Module):
    """Experts as one (E, H, D) weight (transformers 5's fused form)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = MOE_E
        self.weight = torch.nn.Parameter(0.3 * torch.randn(MOE_E, MOE_H, MOE_D))

    def expert(self, e: int, x: Any) -> Any:
        return x @ self.weight[e].T


class _ListedExperts(torch.nn.ModuleList):
    def expert(self, e: int, x: Any) -> Any:
        return self[e](x)


class _Moe(torch.nn.Module):
    """A top-2 block: ``gate`` an nn.Linear (its logits), ``experts`` fused or listed, ``top_k`` on it."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = torch.nn.Linear(MOE_D, MOE_E, bias=False)
        self.experts = _FusedExperts() if fused else _ListedExperts(
            torch.nn.Linear(MOE_D, MOE_H, bias=False) for _ in range(MOE_E))
        self.out = torch.nn.Linear(MOE_H, MOE_D, bias=False)

    def forward(self, x: Any) -> tuple[Any, Any]:
        logits = self.gate(x)
        p = torch.softmax(logits, -1)
        w, idx = torch.topk(p, self.top_k, dim=-1)
        h = torch.zeros(x.shape[0], MOE_H)
        for e in range(MOE_E):
            tok, slot = torch.where(idx == e)
            h = h.index_add(0, tok, self.experts.expert(e, x[tok]) * w[tok, slot, None])
        counts = torch.bincount(idx.reshape(-1), minlength=MOE_E).double()
        aux = MOE_E * torch.dot(counts / x.shape[0], p.double().mean(0))      # the Switch loss of this block
        return x + self.out(h), aux


class MoeNet(torch.nn.Module):
    """Two MoE blocks (``a`` fused experts, ``b`` listed) returning ``{"out", "aux_loss"}`` as a Hugging Face
    MoE model returns its ``aux_loss``."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.a, self.b = _Moe(fused=True), _Moe(fused=False)

    def forward(self, x: Any) -> dict[str, Any]:
        y, aux_a = self.a(x)
        y, aux_b = self.b(y)
        return {"out": y, "aux_loss": (aux_a + aux_b) / 2}


def moe_batch(rank: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(MOE_TOKENS, MOE_D, generator=g), torch.randn(MOE_TOKENS, MOE_D, generator=g)


def moe_loss(model: Any, b: tuple[Any, Any]) -> tuple[Any, Any]:
    out = model(b[0])
    return ((out["out"] - b[1]) ** 2).mean(), out["aux_loss"]


def moe_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 (``fully_shard`` over every rank) of :class:`MoeNet` recorded with ``experts="auto"``, 3 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    model = MoeNet()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with gf.Recorder(f"{out}/moe.zarr", model=model, sources=["a", "b"], experts="auto", heads=None, sketch=K,
                     full=["*"], mode="replay") as rec:
        for step in range(3):
            loss, _ = moe_loss(model, moe_batch(rank, step))
            loss.backward()
            rec.record(step=step, loss=loss, source="ab"[rank % 2], n_samples=MOE_TOKENS)
            model.zero_grad()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ a transformers MoE under FSDP2 (tests/test_experts_fsdp.py)
HF_MOE_E, HF_MOE_K, HF_MOE_V, HF_MOE_STEPS = 4, 2, 40, 2


def hf_mixtral() -> Any:
    """A tiny ``MixtralForCausalLM`` (2 layers, 4 fused experts, top-2), seeded: every rank builds the same."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=HF_MOE_V, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=HF_MOE_E,
                                     num_experts_per_tok=HF_MOE_K, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def hf_moe_ids(rank: int, step: int) -> Any:
    """Rank *rank*'s token ids at *step*: 2 rows of 6 (every rank the same number of predicted tokens)."""
    return torch.randint(0, HF_MOE_V, (2, 6), generator=torch.Generator().manual_seed(9000 + 100 * step + rank))


def hf_moe_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 of :func:`hf_mixtral` (each decoder layer, then the root, ``fully_shard``) recorded with
    ``experts="auto"``, :data:`HF_MOE_STEPS` steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    model = hf_mixtral()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with gf.Recorder(f"{out}/hf.zarr", model=model, sources=["a", "b"], experts="auto", heads=None,
                     mode="replay") as rec:
        for step in range(HF_MOE_STEPS):
            ids = hf_moe_ids(rank, step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            rec.record(step=step, loss=loss, source="ab"[rank % 2], n_samples=int(ids.numel()))
            model.zero_grad()
    torch.distributed.destroy_process_group()
