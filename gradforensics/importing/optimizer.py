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

    from gradforensics.store.probes import OptimData

__all__ = ["STATS", "name_states", "optim_group", "summarize", "update_ratio"]


STATS = ("exp_avg_norm", "sqrt_v_hat_norm", "eps_share", "step")
_NO_DECAY = ("bias", "norm", "ln_", "layernorm")


def _orders(sd: Mapping[str, torch.Tensor], n_groups: int, hint: Sequence[str] | None) -> dict[str, list[str]]:
    """Candidate orders: the model's (*hint*) and the state dict's own, each also as the Trainer's two groups."""
    own = [n for n, t in sd.items() if t.is_floating_point()]
    out: dict[str, list[str]] = {}
    for label, names in (("parameters", [n for n in hint if n in sd]), ("state-dict", own)) if hint \
            else (("state-dict", own),):
        out[label] = names
        if n_groups == 2:
            rest = [n for n in names if any(k in n.lower() for k in _NO_DECAY)]
            out[f"{label} hf-trainer"] = [n for n in names if n not in rest] + rest
    return out


def name_states(opt: Any, sd: Mapping[str, torch.Tensor], hint: Sequence[str] | None = None
                ) -> dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """``{tensor name: (its optimizer state, its param group)}``, or ``{}`` when no order fits the shapes.

    *hint*: the model's ``named_parameters()`` order, where the series has a config to build it.
    The order is chosen by :func:`gradforensics.replay.optimstate.fit_order`, the rule a
    replayed model's state is named by.
    """
    from gradforensics.replay.optimstate import fit_order

    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return {}
    groups = [g for g in opt["param_groups"] if isinstance(g, Mapping) and isinstance(g.get("params"), list)]
    if len(groups) != len(opt["param_groups"]) or \
            not all(isinstance(i, int) and not isinstance(i, bool) for g in groups for i in g["params"]):
        return {}
    shapes = {n: tuple(t.shape) for n, t in sd.items()}
    _, order, _ = fit_order({"state": opt["state"], "param_groups": groups}, _orders(sd, len(groups), hint), shapes)
    if not order:
        return {}
    ids = [(i, g) for g in groups for i in g["params"]]
    state = opt["state"]
    return {name: (state[i], g) for name, (i, g) in zip(order, ids, strict=True) if isinstance(state.get(i), Mapping)}


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


def optim_group(opt: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str], where: str,
                hint: Sequence[str] | None = None) -> OptimData | None:
    """The ``optim/`` group of the series' last checkpoint, as ``capture --curvature`` writes it, or None.

    The same per-tensor summary (:func:`gradforensics.replay.optimstate.summarise`: next
    update over weight RMS, ε share, ``‖m‖``, ``‖√v̂‖``, step) for the imported tensors
    *names*, so the ``optimizer`` analysis reads an imported run.  No batch is replayed,
    so the ``g²/v̂`` quantiles are NaN and the histograms empty: the stale-preconditioner
    finding needs ``capture --curvature``.  None when no order names the state or it has
    no learning rate.
    """
    from gradforensics.errors import SpecError
    from gradforensics.replay.optimstate import OptimState, hyper_of, optim_data

    named = {n: v for n, v in name_states(opt, sd, hint).items() if n in names}
    if not named:
        return None
    try:
        hyper = hyper_of(opt)
    except SpecError:
        return None
    state = OptimState({n: dict(st) for n, (st, _) in named.items()}, hyper, "by shape and param groups", where,
                       {n: _scalar(g.get("lr"), hyper.lr) for n, (_, g) in named.items()})
    return optim_data(state, {n: sd[n] for n in named})


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """``RMS(after - before) / RMS(before)`` (NaN for an all-zero *before*)."""
    b = before.double()
    rms = float(b.pow(2).mean().sqrt())
    return float((after.double() - b).pow(2).mean().sqrt()) / rms if rms > 0 else math.nan
