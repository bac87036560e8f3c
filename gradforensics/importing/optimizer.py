"""Optimizer-state summaries of a checkpoint series, per checkpoint and tensor (Adam-family state).

A torch optimizer's ``state_dict()`` numbers the parameters (``param_groups[g]["params"]``),
it does not name them.  The numbers follow the order the parameters were handed to the
optimizer: :func:`name_states` tries the model's ``named_parameters()`` order (built
from the series' ``config.json``), the state dict's own order, each also as the Hugging Face
Trainer's two groups (weights with decay first, then biases and norms), and accepts an
order only when every moment has its tensor's shape; otherwise no summary is kept.

Per tensor and checkpoint (:func:`summarize`): ``exp_avg_norm`` ``‖m‖₂``,
``sqrt_v_hat_norm`` ``‖√v̂‖₂`` with ``v̂ = v / (1 - β₂ᵗ)``, ``eps_share`` the share of
elements with ``√v̂ < ε`` (an ε-dominated, effectively SGD-like tensor) and ``step``.
Per interval, :func:`update_ratio`: ``RMS(ΔW) / RMS(W)`` of the earlier checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["STATS", "name_states", "summarize", "update_ratio"]


STATS = ("exp_avg_norm", "sqrt_v_hat_norm", "eps_share", "step")
_NO_DECAY = ("bias", "norm", "ln_", "layernorm")


def _orders(sd: Mapping[str, torch.Tensor], sizes: Sequence[int], hint: Sequence[str] | None) -> list[list[str]]:
    own = [n for n, t in sd.items() if t.is_floating_point()]
    out = []
    for names in ([n for n in hint if n in sd], own) if hint else (own,):
        out.append(names)
        if len(sizes) == 2:
            rest = [n for n in names if any(k in n.lower() for k in _NO_DECAY)]
            out.append([n for n in names if n not in rest] + rest)
    return out


def name_states(opt: Any, sd: Mapping[str, torch.Tensor], hint: Sequence[str] | None = None
                ) -> dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """``{tensor name: (its optimizer state, its param group)}``, or ``{}`` when no order fits the shapes.

    *hint*: the model's ``named_parameters()`` order, where the series has a config to build it.
    """
    import torch

    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return {}
    groups = [g for g in opt["param_groups"] if isinstance(g, Mapping) and isinstance(g.get("params"), list)]
    ids = [(i, g) for g in groups for i in g["params"]]
    state = opt["state"]
    for order in _orders(sd, [len(g["params"]) for g in groups], hint):
        if len(order) != len(ids):
            continue
        pairs = {name: (state.get(i), g) for name, (i, g) in zip(order, ids, strict=True)}
        if all(isinstance(s, Mapping) and isinstance(s.get("exp_avg"), torch.Tensor)
               and tuple(s["exp_avg"].shape) == tuple(sd[n].shape) for n, (s, _) in pairs.items() if s):
            return {n: (s, g) for n, (s, g) in pairs.items() if isinstance(s, Mapping)}
    return {}


def _scalar(v: Any, default: float) -> float:
    import torch

    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def summarize(opt: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str],
              hint: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """The :data:`STATS` of each of *names* that has Adam-family state (``exp_avg``, ``exp_avg_sq``)."""
    import torch

    out: dict[str, dict[str, float]] = {}
    for name, (st, group) in name_states(opt, sd, hint).items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if name not in names or not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        step = _scalar(st.get("step"), math.nan)
        betas = group.get("betas", (0.9, 0.999))
        beta2 = float(betas[1]) if isinstance(betas, (list, tuple)) and len(betas) == 2 else 0.999
        eps = _scalar(group.get("eps"), 1e-8)
        corr = 1.0 - beta2 ** step if step == step and step > 0 else 1.0
        sqrt_v = (v.double().clamp_min(0) / corr).sqrt()
        out[name] = {"exp_avg_norm": float(m.double().norm()), "sqrt_v_hat_norm": float(sqrt_v.norm()),
                     "eps_share": float((sqrt_v < eps).double().mean()), "step": step}
    return out


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """``RMS(after - before) / RMS(before)`` (NaN for an all-zero *before*)."""
    b = before.double()
    rms = float(b.pow(2).mean().sqrt())
    return float((after.double() - b).pow(2).mean().sqrt()) / rms if rms > 0 else math.nan
