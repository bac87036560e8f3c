"""Optimizers of the what-if arms, and the checkpoint's optimizer state.

* :class:`Lion` - torch ships none; the published rule (Chen et al. 2023,
  "Symbolic Discovery of Optimization Algorithms", Algorithm 2)::

      c = β1·m + (1 − β1)·g
      θ ← θ − lr·(sign(c) + λ·θ)
      m ← β2·m + (1 − β2)·g

* AdamW, Adam, SGD (+momentum, Nesterov) and Adafactor are torch's own
  (``torch.optim.Adafactor`` is torch's variant of Shazeer & Stern 2018).
* :func:`load_state`: the checkpoint's ``optimizer.pt`` (what the Hugging Face
  Trainer saves next to the weights) is loaded into an arm's optimizer when its
  per-parameter state is that optimizer's (``exp_avg``/``exp_avg_sq`` for
  Adam(W), ``momentum_buffer`` for SGD, ``exp_avg`` alone for Lion,
  ``row_var``/``col_var``/``variance`` for Adafactor) and its groups hold the same
  parameters; else the arm starts fresh, and the reason is returned for the report.
  The arm's hyperparameters (lr, betas, ...) win over the saved ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch

    from gradforensics.runs.arms import Arm

__all__ = ["STATE_FILES", "Lion", "build_optimizer", "find_state", "load_state", "state_kind", "warmup_factor"]

#: File names of a saved optimizer state next to the weights (Hugging Face Trainer: ``optimizer.pt``).
STATE_FILES = ("optimizer.pt", "optimizer.bin")
#: optimizer -> the kind of saved state it can continue from.
_FAMILY = {"adamw": "adam", "adam": "adam", "sgd": "sgd", "lion": "lion", "adafactor": "adafactor"}


def _optimizer_base() -> type:
    import torch

    return torch.optim.Optimizer


class Lion(_optimizer_base()):  # type: ignore[misc]
    """Lion (EvoLved Sign Momentum), Chen et al. 2023, Algorithm 2; see the module docstring.

    Parameters
    ----------
    params
        Parameters (or groups) to optimise.
    lr
        Step size; the update of every coordinate is ``±lr`` (plus decay), so Lion
        takes an lr 3-10x smaller than AdamW's (the paper's advice).
    betas
        ``(β1, β2)``: interpolation of the update and decay of the momentum.
    weight_decay
        Decoupled weight decay λ (applied as ``lr·λ·θ``).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise SpecError(f"Lion: lr > 0, betas in [0, 1), weight_decay >= 0; got {lr}, {betas}, {weight_decay}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        import torch

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if "exp_avg" not in state:
                        state["exp_avg"] = torch.zeros_like(p)
                    m = state["exp_avg"]
                    c = m.mul(b1).add_(p.grad, alpha=1 - b1)
                    p.add_(c.sign_().add_(p, alpha=wd), alpha=-lr)
                    m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


def build_optimizer(arm: Arm, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The arm's optimizer over *params* (one group)."""
    import torch

    o = arm.options
    if arm.optimizer in ("adamw", "adam"):
        cls = torch.optim.AdamW if arm.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"])
    if arm.optimizer == "sgd":
        if o["nesterov"] and (o["momentum"] <= 0 or o["dampening"] != 0):
            raise SpecError(f"--arm {arm.name}: nesterov needs momentum > 0 and dampening 0.")
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], dampening=o["dampening"],
                               nesterov=o["nesterov"], weight_decay=o["weight_decay"])
    if arm.optimizer == "lion":
        return Lion(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), weight_decay=o["weight_decay"])
    if arm.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=o["lr"], beta2_decay=o["beta2_decay"], eps=(None, o["eps"]),
                                     d=o["d"], weight_decay=o["weight_decay"])
    raise AssertionError(arm.optimizer)   # parse_arm admits no other


def warmup_factor(step: int, warmup: int) -> float:
    """Linear warmup: ``(step + 1) / warmup`` for the first *warmup* steps, then 1."""
    return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)


def find_state(checkpoint: Path) -> Path | None:
    """The saved optimizer state of *checkpoint* (a directory, or the directory of a state-dict file), if any."""
    d = checkpoint if checkpoint.is_dir() else checkpoint.parent
    return next((d / f for f in STATE_FILES if (d / f).is_file()), None)


def state_kind(state_dict: dict[str, Any]) -> str | None:
    """``adam``, ``sgd``, ``lion``, ``adafactor`` from the per-parameter state keys; None if empty or unknown."""
    keys: set[str] = set()
    for s in (state_dict.get("state") or {}).values():
        keys |= set(s)
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return "adam"
    if "momentum_buffer" in keys:
        return "sgd"
    if keys & {"row_var", "col_var", "variance"}:
        return "adafactor"
    if "exp_avg" in keys:
        return "lion"
    return None


def read_state(path: Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, never arbitrary pickles."""
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as exc:
        raise SpecError(f"{path}: not an optimizer state torch.load(weights_only=True) can read "
                        f"({type(exc).__name__}).") from exc
    if not isinstance(obj, dict) or "state" not in obj or "param_groups" not in obj:
        raise SpecError(f"{path}: not an optimizer state dict (no 'state' and 'param_groups').")
    return obj


def load_state(opt: torch.optim.Optimizer, arm: Arm, saved: dict[str, Any] | None, where: str) -> str:
    """Load *saved* into *opt* when it fits the arm's optimizer; returns the sentence the report shows."""
    if saved is None:
        return "fresh optimizer state (the checkpoint has no optimizer.pt)"
    kind = state_kind(saved)
    if kind != _FAMILY[arm.optimizer]:
        return (f"fresh optimizer state ({where} holds {kind or 'an empty'} state; "
                f"{arm.optimizer} cannot continue from it)")
    ours = [len(g["params"]) for g in opt.param_groups]
    theirs = [len(g.get("params", ())) for g in saved["param_groups"]]
    if ours != theirs:
        return (f"fresh optimizer state ({where} has parameter groups of {theirs} tensors; "
                f"this arm has {ours})")
    bad = _shape_mismatch(opt, saved)
    if bad:
        return f"fresh optimizer state ({where} does not fit: {bad})"
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    try:
        opt.load_state_dict(saved)
    except (ValueError, RuntimeError, KeyError) as exc:
        return f"fresh optimizer state ({where} does not fit: {' '.join(str(exc).split())[:120]})"
    for g, h in zip(opt.param_groups, hyper, strict=True):
        g.update(h)                                    # the arm's lr, betas, ... win over the saved ones
    return f"optimizer state loaded from {where} ({kind} moments; the arm's hyperparameters)"


def _shape_mismatch(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> str:
    """'' when every saved moment has its parameter's shape, else what differs (load_state_dict does not check)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for idx, st in (saved.get("state") or {}).items():
        if not isinstance(idx, int) or not 0 <= idx < len(params):
            return f"state of parameter {idx!r} of {len(params)}"
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            v = st.get(key)
            if v is not None and tuple(v.shape) != tuple(params[idx].shape):
                return f"{key} of parameter {idx} has shape {tuple(v.shape)}, the parameter {tuple(params[idx].shape)}"
    return ""
