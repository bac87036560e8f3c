"""DeepSpeed universal checkpoints read as a checkpoint of a series (weights and Adam state by parameter name).

The layout, as DeepSpeed's ``ds_to_universal`` writes it (deepspeedai/DeepSpeed
``deepspeed/checkpoint/ds_to_universal.py`` at 4fd8dbdf: ``merge_tp_slices``,
``merge_zero3_slices``, ``_save_optimizer_state``; keys from ``deepspeed/checkpoint/constants.py``)::

    <step dir>/zero/<parameter name>/fp32.pt         the unsharded fp32 master weight
    <step dir>/zero/<parameter name>/exp_avg.pt      Adam's first moment
    <step dir>/zero/<parameter name>/exp_avg_sq.pt   Adam's second moment
    <step dir>/zero/<parameter name>/step.pt         the optimizer step (when the optimizer keeps one)
    <step dir>/zero/optimizer_state.pt               the common optimizer state (``param_groups`` ...)

Under ZeRO 1-2 each ``<state>.pt`` is ``torch.save({"param": tensor, "cat_dim": d, ...})``
(``vocab_tensor`` for a vocabulary padded away); under ZeRO-3 the bare tensor.  Every file
is read with ``torch.load(weights_only=True)``: a ``sub_param_shape`` entry (a DeepSpeed
class) or a ``loss_scaler`` object in ``optimizer_state.pt`` is refused by that loader, in
which case the weights are still read and the optimizer's hyper-parameters default
(the state is named by parameter either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["STATES", "is_universal", "read_universal"]

#: the per-parameter files of a universal checkpoint
STATES = ("fp32", "exp_avg", "exp_avg_sq")
_MAX_PARAMS = 1_000_000


def is_universal(d: Path) -> bool:
    """Whether *d* is a DeepSpeed universal checkpoint directory (``zero/<param>/fp32.pt``)."""
    z = d / "zero"
    return d.is_dir() and z.is_dir() and any((p / "fp32.pt").is_file() for p in z.iterdir() if p.is_dir())


def _tensor(file: Path) -> torch.Tensor:
    import torch

    from gradforensics.replay.untrusted import torch_load

    obj = torch_load(file, mmap=False)
    if isinstance(obj, Mapping):
        obj = obj.get("param")
    if not isinstance(obj, torch.Tensor):
        raise CheckpointError(f"{file}: expected a tensor or DeepSpeed's {{'param': tensor, ...}}; found "
                              f"{type(obj).__name__}.")
    return obj


def read_universal(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights by name, optimizer state dict keyed by name)`` of the universal checkpoint *d*."""
    from gradforensics.errors import GradforensicsError
    from gradforensics.replay.untrusted import torch_load

    z = d / "zero"
    params = sorted(p for p in z.iterdir() if p.is_dir() and (p / "fp32.pt").is_file())
    if len(params) > _MAX_PARAMS:
        raise CheckpointError(f"{z}: {len(params)} parameter directories, more than the {_MAX_PARAMS} read.")
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for p in params:
        weights[p.name] = _tensor(p / "fp32.pt")
        moments: dict[str, Any] = {s: _tensor(p / f"{s}.pt") for s in STATES[1:] if (p / f"{s}.pt").is_file()}
        if (p / "step.pt").is_file():
            step = torch_load(p / "step.pt", mmap=False)
            moments["step"] = step.get("param") if isinstance(step, Mapping) else step
        if moments:
            state[p.name] = moments
    group: dict[str, Any] = {}
    common = z / "optimizer_state.pt"
    if common.is_file():
        try:
            obj = torch_load(common, mmap=False)
        except GradforensicsError:          # a DeepSpeed object inside (loss scaler): hyper-parameters default
            obj = None
        groups = obj.get("param_groups") if isinstance(obj, Mapping) else None
        if isinstance(groups, list) and groups and isinstance(groups[0], Mapping):
            group = {k: v for k, v in groups[0].items() if k in ("lr", "betas", "eps", "weight_decay")}
    return weights, {"state": state, "param_groups": [{**group, "params": list(state)}]} if state else {}
