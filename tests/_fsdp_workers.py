"""The ranks' side of tests/test_import_hf_fsdp.py: two gloo processes train a tiny model under FSDP on CPU and
save Hugging Face Trainer checkpoints with accelerate's own writer, measuring what they saved themselves.

Kept apart from the test module so that a child imports torch and accelerate only.

Why not ``Trainer`` / ``Accelerator(fsdp_plugin=...)`` itself: accelerate 1.16 sets
``DistributedType.FSDP`` only for an accelerator backend (``accelerate/state.py``, the
``MULTI_GPU`` / ``MULTI_XPU`` ... branch of ``AcceleratorState.__init__``); on CPU,
``Accelerator(cpu=True, fsdp_plugin=...)`` is ``MULTI_CPU`` and wraps the model in DDP.  So the
model is sharded here with torch's own ``fully_shard`` (FSDP2, what accelerate's
``fsdp2_prepare_model`` calls) or ``FullyShardedDataParallel`` (FSDP1), and each checkpoint is
written exactly as ``Trainer._save_optimizer_and_scheduler`` writes it under FSDP
(transformers 5.24 ``trainer.py``): ``save_fsdp_model(plugin, accelerator, model, checkpoint-N,
adapter_only=True)`` then ``save_fsdp_optimizer(plugin, accelerator, optimizer, model,
checkpoint-N)``, with a real ``FullyShardedDataParallelPlugin`` and a real (CPU) ``Accelerator``;
under ``FULL_STATE_DICT`` also ``model.safetensors``, as ``Trainer.save_model`` writes it (:func:`_trainer_weights`).
FSDP1 under ``FULL_STATE_DICT`` is not written: on CPU its full state dict (``rank0_only``,
``offload_to_cpu``, which ``save_fsdp_model`` turns on for two processes) ends rank 0 with SIGSEGV
(torch 2.13.0+cpu, in ``torch/distributed/fsdp/_state_dict_utils.py`` ``param_hook``'s
``state_dict[fqn].detach().clone()``, called from ``_full_post_state_dict_hook``); its files have
the names and structure of FSDP2's (``pytorch_model_fsdp.bin``, ``optimizer.bin`` keyed by name).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

STEPS = (1, 2, 3)
BETA2 = 0.999
LR = 1e-2
#: (directory, FSDP version, accelerate state_dict_type, use_dcp)
SAVES = (("fsdp2-sharded", 2, "SHARDED_STATE_DICT", True), ("fsdp2-full", 2, "FULL_STATE_DICT", True),
         ("fsdp1-sharded", 1, "SHARDED_STATE_DICT", True), ("fsdp2-per-rank", 2, "SHARDED_STATE_DICT", False),
         ("fsdp1-local", 1, "LOCAL_STATE_DICT", True),
         ("lora-sharded", 0, "SHARDED_STATE_DICT", True), ("lora-full", 0, "FULL_STATE_DICT", True))
#: a LoRA model (peft) under FSDP2 is "version 0" above; its adapter's targets
LORA_TARGETS = ["2", "4"]


def tiny() -> torch.nn.Module:
    """Two hidden layers of one shape (8, 8): a state named by shape alone could be given to the wrong one."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _wrap(model: torch.nn.Module, version: int) -> torch.nn.Module:
    if version == 0:                              # LoRA (peft) on the frozen model, sharded by FSDP2
        import peft
        from torch.distributed.fsdp import fully_shard

        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=LORA_TARGETS))
        fully_shard(model)
        return model
    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)


def _plain(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _measure(model: torch.nn.Module, opt: torch.optim.Optimizer, version: int) -> dict[str, Any]:
    """The full weights and, per parameter, ‖m‖, ‖√v̂‖ and the step, from this process's own tensors.

    The moments' norms are sums of squares over each rank's local shard, all-reduced: no gather,
    nothing of the checkpoint writer used.
    """
    import torch.distributed as dist

    weights: dict[str, torch.Tensor] = {}
    if version != 1:
        for n, p in model.named_parameters():
            weights[n] = p.detach().full_tensor().clone()
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            weights = {_plain(n): p.detach().clone() for n, p in model.named_parameters()}
    moments: dict[str, dict[str, float]] = {}
    for n, p in model.named_parameters():
        st = opt.state.get(p, {})

        def local(t: Any) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        sums = torch.tensor([float(local(st[k]).double().pow(2).sum()) if k in st else 0.0
                             for k in ("exp_avg", "exp_avg_sq")], dtype=torch.float64)
        vsum = torch.tensor([float(local(st["exp_avg_sq"]).double().sum()) if "exp_avg_sq" in st else 0.0],
                            dtype=torch.float64)
        step = torch.tensor([float(st["step"]) if "step" in st else 0.0], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(vsum)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        t = float(step)
        moments[_plain(n)] = {"exp_avg_norm": float(sums[0].sqrt()),
                              "sqrt_v_hat_norm": float((vsum[0] / (1 - BETA2 ** t)).sqrt()), "step": t}
    return {"weights": weights, "moments": moments, "names": [n for n, _ in model.named_parameters()]}


def _trainer_weights(model: torch.nn.Module, rank: int, ck: Path) -> None:
    """``model.safetensors``, as ``Trainer.save_model`` writes it beside a FULL_STATE_DICT FSDP checkpoint.

    transformers 5.24 ``Trainer.save_model``: ``state_dict = self.accelerator.get_state_dict(self.model)``
    (accelerate 1.16 ``Accelerator.get_state_dict``, FSDP2: ``get_model_state_dict`` with
    ``full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True``), then ``Trainer._save``
    for a model that is not a ``PreTrainedModel``: ``safetensors.torch.save_file(state_dict, ...,
    metadata={"format": "pt"})`` on the main process.
    """
    import safetensors.torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                              cpu_offload=True))
    if rank == 0:
        safetensors.torch.save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    acc = Accelerator(cpu=True)                  # initialises the gloo group (see the module's docstring)
    oracle: dict[str, Any] = {}
    for version in (2, 1, 0):
        model = _wrap(tiny(), version)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, BETA2))
        saves = [s for s in SAVES if s[1] == version]
        log: list[dict[str, float]] = []
        for step in range(1, STEPS[-1] + 1):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            log.append({"loss": float(mean) / world, "learning_rate": LR, "step": step})
            if step not in STEPS:
                continue
            oracle[f"fsdp{version}-{step}"] = _measure(model, opt, version)
            for label, _, sdt, use_dcp in saves:
                ck = Path(out) / label / f"checkpoint-{step}"
                plugin = FullyShardedDataParallelPlugin(fsdp_version=1 if version == 1 else 2, state_dict_type=sdt,
                                                        cpu_ram_efficient_loading=False)
                save_fsdp_model(plugin, acc, model, str(ck), adapter_only=True, use_dcp=use_dcp)
                save_fsdp_optimizer(plugin, acc, opt, model, str(ck), use_dcp=use_dcp)
                if sdt == "FULL_STATE_DICT" and version == 2:
                    _trainer_weights(model, rank, ck)
                if rank == 0:                    # TrainerState.save_to_json's fields that the import reads
                    (ck / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": log}))
        torch.distributed.barrier()
    if rank == 0:
        torch.save(oracle, Path(out) / "oracle.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
