"""Optimizer-state summaries of a checkpoint series, per checkpoint and tensor (Adam-family state).

A torch optimizer's ``state_dict()`` numbers the parameters (``param_groups[g]["params"]``),
it does not name them.  The numbers follow the order the parameters were handed to the
optimizer: :func:`name_states` tries the model's ``named_parameters()`` order (built
from the series' ``config.json``), the state dict's own order, each also as the Hugging Face
Trainer's two groups (weights with decay first, then biases and norms), and accepts an
order only when every moment has its tensor's shape; otherwise no summary is kept.

Per tensor and checkpoint (:func:`summarize`): ``exp_avg_norm`` ``‖m‖₂``,
``sqrt_v_hat_norm`` ``‖√v̂‖₂`` with ``v̂ = v / (1 - β₂ᵗ)``, ``eps_share`` the share of
elements with ``√v̂ < ε`` (an ε-dominated, effectively SGD-like tensor) and ``step`` -
the columns ``m_norm``, ``sqrt_v_norm``, ``eps_share``, ``step`` of the one summary
:func:`gradforensics.replay.optimstate.summarise` (β₂ and ε of the first param group; a
negative ``v`` of a damaged state gives NaN, not a clamped zero).
Per interval, :func:`update_ratio`: ``RMS(ΔW) / RMS(W)`` of the earlier checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gradforensics.replay.optimstate import OptimState
    from gradforensics.store.probes import OptimData

__all__ = ["STATS", "name_states", "optim_group", "summarize", "update_ratio"]


STATS = ("exp_avg_norm", "sqrt_v_hat_norm", "eps_share", "step")
_NO_DECAY = ("bias", "norm", "ln_", "layernorm")


def _orders(sd: Mapping[str, torch.Tensor], n_groups: int, hint: Sequence[str] | None,
            own_order: bool = True) -> dict[str, list[str]]:
    """Candidate orders: the model's (*hint*) and the state dict's own, each also as the Trainer's two groups.

    With ``own_order=False`` (a safetensors file, whose keys are stored sorted, not in the
    order the model registered them) the state dict's order is a candidate only when no two
    of its tensors share a shape: otherwise a shape check cannot catch a wrong order
    (``layers.10`` sorts before ``layers.2``) and the state would be named wrongly.
    """
    own = [n for n, t in sd.items() if t.is_floating_point()]
    if not own_order and len({tuple(sd[n].shape) for n in own}) < len(own):
        own = []
    out: dict[str, list[str]] = {}
    candidates = (("parameters", [n for n in hint if n in sd]), ("state-dict", own)) if hint else (("state-dict", own),)
    for label, names in ((k, v) for k, v in candidates if v):
        out[label] = names
        if n_groups == 2:
            rest = [n for n in names if any(k in n.lower() for k in _NO_DECAY)]
            out[f"{label} hf-trainer"] = [n for n in names if n not in rest] + rest
    return out


def name_states(opt: Any, sd: Mapping[str, torch.Tensor], hint: Sequence[str] | None = None,
                own_order: bool = True) -> dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """``{tensor name: (its optimizer state, its param group)}``, or ``{}`` when no order fits the shapes.

    *hint*: the model's ``named_parameters()`` order, where the series has a config to build it;
    *own_order*: whether *sd*'s own order is the model's (False for safetensors, see :func:`_orders`).
    The order is chosen by :func:`gradforensics.replay.optimstate.fit_order`, the rule a
    replayed model's state is named by.
    """
    from gradforensics.replay.optimstate import fit_order

    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return {}
    groups = [g for g in opt["param_groups"] if isinstance(g, Mapping) and isinstance(g.get("params"), list)]
    if len(groups) != len(opt["param_groups"]):
        return {}
    if opt["state"] and all(isinstance(k, str) for k in opt["state"]):
        return _by_name(opt["state"], groups, sd)
    if len(groups) != len(opt["param_groups"]) or \
            not all(isinstance(i, int) and not isinstance(i, bool) for g in groups for i in g["params"]):
        return {}
    shapes = {n: tuple(t.shape) for n, t in sd.items()}
    _, order, _ = fit_order({"state": opt["state"], "param_groups": groups}, _orders(sd, len(groups), hint, own_order),
                            shapes)
    if not order:
        return {}
    ids = [(i, g) for g in groups for i in g["params"]]
    state = opt["state"]
    return {name: (state[i], g) for name, (i, g) in zip(order, ids, strict=True) if isinstance(state.get(i), Mapping)}


def _by_name(state: Mapping[str, Any], groups: list[Mapping[str, Any]], sd: Mapping[str, torch.Tensor]
             ) -> dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """State keyed by parameter name (``get_optimizer_state_dict``, FSDP's full optimizer state): named as it is.

    A name's group is the one whose ``params`` lists it (the first group when groups list ids);
    a name the weights do not have, or a moment of another shape, leaves the state unnamed.
    """
    out: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for name, st in state.items():
        if not isinstance(st, Mapping) or name not in sd:
            return {}
        group = next((g for g in groups if name in g["params"]), groups[0] if groups else {})
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            v = st.get(key)
            if v is not None and tuple(getattr(v, "shape", ())) != tuple(sd[name].shape):
                return {}
        out[name] = (st, group)
    return out


def _scalar(v: Any, default: float) -> float:
    import torch

    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _named_state(opt: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str], where: str,
                 hint: Sequence[str] | None, own_order: bool) -> OptimState | None:
    """The optimizer state of *names* as the one :class:`~gradforensics.replay.optimstate.OptimState`
    replay, the Recorder and import share; None when no order names it or its hyper-parameters are malformed."""
    from gradforensics.errors import SpecError
    from gradforensics.replay.optimstate import OptimState, hyper_of

    named = {n: v for n, v in name_states(opt, sd, hint, own_order).items() if n in names}
    if not named:
        return None
    try:
        hyper = hyper_of(opt)
    except SpecError:
        return None
    return OptimState({n: dict(st) for n, (st, _) in named.items()}, hyper, "by shape and param groups", where,
                      {n: _scalar(g.get("lr"), hyper.lr) for n, (_, g) in named.items()})


def summarize(opt: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str],
              hint: Sequence[str] | None = None, own_order: bool = True) -> dict[str, dict[str, float]]:
    """The :data:`STATS` of each of *names* that has Adam-family state (``exp_avg``, ``exp_avg_sq``).

    Computed by :func:`gradforensics.replay.optimstate.summarise`, the one definition (``m_norm``,
    ``sqrt_v_norm``, ``eps_share``, ``step``) that ``capture --curvature`` and the live Recorder write.
    """
    from gradforensics.replay.optimstate import FIELDS, summarise

    state = _named_state(opt, sd, names, "", hint, own_order)
    if state is None:
        return {}
    adam = {n: st for n, st in state.per_tensor.items() if "exp_avg" in st and "exp_avg_sq" in st}
    state = replace(state, per_tensor=adam)
    col = {f: i for i, f in enumerate(FIELDS)}
    return {n: {"exp_avg_norm": r[col["m_norm"]], "sqrt_v_hat_norm": r[col["sqrt_v_norm"]],
                "eps_share": r[col["eps_share"]], "step": r[col["step"]]}
            for n, r in summarise(state, {n: sd[n] for n in adam}).items()}


def optim_group(opt: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str], where: str,
                hint: Sequence[str] | None = None, own_order: bool = True) -> OptimData | None:
    """The ``optim/`` group of the series' last checkpoint, as ``capture --curvature`` writes it, or None.

    The same per-tensor summary (:func:`gradforensics.replay.optimstate.summarise`: next
    update over weight RMS, ε share, ``‖m‖``, ``‖√v̂‖``, step) for the imported tensors
    *names*, so the ``optimizer`` analysis reads an imported run.  No batch is replayed,
    so the ``g²/v̂`` quantiles are NaN and the histograms empty: the stale-preconditioner
    finding needs ``capture --curvature``.  None when no order names the state or it has
    no learning rate.
    """
    from gradforensics.replay.optimstate import optim_data

    state = _named_state(opt, sd, names, where, hint, own_order)
    return None if state is None else optim_data(state, {n: sd[n] for n in state.per_tensor})


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """``RMS(after - before) / RMS(before)`` (NaN for an all-zero *before*)."""
    b = before.double()
    rms = float(b.pow(2).mean().sqrt())
    return float((after.double() - b).pow(2).mean().sqrt()) / rms if rms > 0 else math.nan
