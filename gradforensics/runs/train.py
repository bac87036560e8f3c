"""One what-if arm: load the checkpoint fresh, train K steps on the shared batches, record every step.

:func:`run_arm` is the training loop of every arm.  What makes arms comparable:

* the model is the checkpoint loaded anew for each arm (``load()``), and
  ``torch.manual_seed(seed)`` is set before the first step, so dropout draws
  and seeded masking are the same in every arm;
* step ``t`` takes batch ``j`` of source ``s`` from :func:`~gradforensics.runs.arms.schedule`,
  and ``batches[s][j]`` is one tensor shared by all arms - so step 0 of two
  arms with the same schedule sees the same batch at the same weights and has
  the same loss and gradient, whatever the optimizer;
* every step is recorded (``mode="training"``) *before* clipping and the
  optimizer step: ``grads/`` and ``sketch/`` hold the gradient of the loss.

Besides the store, each step leaves per tensor a short vector of the gradient
and of the update ``Δθ = θ_after − θ_before`` (the flattened tensor itself when
it has at most ``k`` elements, else its count-sketch with one seed for all
arms), so :mod:`~gradforensics.runs.cosines` can compare arms layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from gradforensics.recording.sketch import Sketcher
from gradforensics.runs.optim import build_optimizer, load_state, warmup_factor

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradforensics.runs.arms import Arm

__all__ = ["COS_K", "COS_SEED", "ArmRun", "run_arm"]

#: Length of the per-step gradient/update vectors kept for the arm-to-arm cosines (error ≈ √((1+cos²)/k)).
COS_K = 2048
COS_SEED = 20231
LossFn = Callable[["nn.Module", Any], "torch.Tensor"]


@dataclass
class ArmRun:
    """What one arm did: its store, per-step losses, schedule and the gradient/update vectors per tensor."""

    arm: Arm
    store: Path
    state_note: str
    schedule: list[tuple[str, int]]
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grads: dict[str, list[np.ndarray]] = field(default_factory=dict)
    updates: dict[str, list[np.ndarray]] = field(default_factory=dict)

    @property
    def steps_done(self) -> int:
        return len(self.losses)

    def grad_matrix(self, tensor: str) -> np.ndarray:
        return np.stack(self.grads[tensor]) if self.grads.get(tensor) else np.zeros((0, 0))

    def update_matrix(self, tensor: str) -> np.ndarray:
        return np.stack(self.updates[tensor]) if self.updates.get(tensor) else np.zeros((0, 0))


class _Vectors:
    """A tensor's flattened values when it is short, else its count-sketch (one seed for every arm)."""

    def __init__(self, k: int = COS_K, seed: int = COS_SEED) -> None:
        self.k = k
        self.sketcher = Sketcher(k, seed=seed)

    def __call__(self, t: torch.Tensor) -> np.ndarray:
        flat = t.detach().float().reshape(-1).cpu().numpy()
        return flat.astype(np.float32) if flat.size <= self.k else self.sketcher.project(flat)


def run_arm(arm: Arm, load: Callable[[], tuple[nn.Module, LossFn]], batches: Mapping[str, Sequence[Any]],
            plan: list[tuple[str, int]], store: Path, *, sources: Sequence[str], step0: int, seed: int,
            saved_state: dict[str, Any] | None, state_where: str, recorder: Mapping[str, Any],
            count: Callable[[Any], int], progress: IO[str] | None = None, on_step: Callable[[int], None] | None = None,
            ) -> ArmRun:
    """Train *arm* for ``len(plan)`` steps from a fresh load of the checkpoint, recording every step.

    Parameters
    ----------
    load
        ``load() -> (model, loss_fn)``: the checkpoint, loaded anew.
    batches, plan
        ``batches[source][j]`` and the arm's ``[(source, j), ...]`` per step.
    store
        ``<arm>.zarr`` / ``.h5`` to write (``mode="training"``).
    sources
        Every ``--data`` source (the store's sources, the same in every arm).
    step0
        Optimizer step of the checkpoint: step ``t`` is recorded as ``step0 + t``.
    saved_state, state_where
        The checkpoint's optimizer state (or None) and where it came from.
    recorder
        Keyword arguments of :class:`~gradforensics.recording.torch.TorchRecorder`
        (``tensors``, ``heads``, ``activations``, ``sketch``, ``full``, ``dtype``, ``overwrite``).
    count
        ``count(batch) -> n_samples``.
    on_step
        Called with the number of steps done after each step (a progress bar).

    Returns
    -------
    ArmRun
        Also when interrupted: ``KeyboardInterrupt`` closes the store (a valid
        store of the steps done) and propagates.
    """
    import torch

    from gradforensics.recording.selection import select_parameters
    from gradforensics.recording.torch import TorchRecorder

    model, loss_fn = load()
    model.train()
    torch.manual_seed(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(arm, trainable)
    note = load_state(opt, arm, saved_state, state_where)
    watched = select_parameters(model, recorder.get("tensors"))
    vec = _Vectors()
    run = ArmRun(arm, store, note, list(plan), grads={n: [] for n in watched}, updates={n: [] for n in watched})
    clip = float(arm.options["clip"])
    recorder = {"expected_records": len(plan), **recorder}       # one record a step: chunks without padding
    with TorchRecorder(store, model=model, sources=list(sources), mode="training", **recorder) as rec:
        for t, (src, j) in enumerate(plan):
            batch = batches[src][j]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            lr = arm.lr * warmup_factor(t, int(arm.options["warmup"]))
            for g in opt.param_groups:
                g["lr"] = lr
            value = float(loss.detach())
            rec.record(step=step0 + t, loss=value, source=src, n_samples=count(batch), lr=lr)
            before = {n: p.detach().clone() for n, p in watched.items()}
            for n, p in watched.items():
                run.grads[n].append(vec(p.grad if p.grad is not None else torch.zeros_like(p)))
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, clip)
            opt.step()
            for n, p in watched.items():
                run.updates[n].append(vec(p.detach() - before[n]))
            run.losses.append(value if math.isfinite(value) else math.nan)
            run.lrs.append(lr)
            if on_step is not None:
                on_step(t + 1)
        opt.zero_grad(set_to_none=True)
    return run
