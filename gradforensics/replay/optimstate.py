"""The optimizer state of a checkpoint, read safely, mapped to parameter names and summarised per tensor.

Where it is read from (:func:`read_optimizer_state`, ``torch.load(weights_only=True)``):
a Hugging Face Trainer checkpoint directory's ``optimizer.pt`` (or ``optimizer.bin``), a raw torch
checkpoint's ``optimizer`` entry (``{"model": ..., "optimizer": opt.state_dict()}``),
or a file that *is* an ``opt.state_dict()``.

How it is mapped to names (:func:`map_state`): ``torch.optim`` numbers the
parameters 0, 1, ... in the order of its ``param_groups``.  Two orders are tried:

* ``parameters``: the model's trainable ``named_parameters()`` in order (what
  ``torch.optim.X(model.parameters())`` numbers);
* ``hf-trainer``: the Trainer's two groups - decayed weights (no bias, no norm),
  then the rest, each in ``named_parameters()`` order.

A mapping is taken only if every state entry's tensors have its parameter's
shape; if neither fits, one line says which index and shapes disagree.  When both
fit (shapes cannot tell them apart) the param groups decide: two groups, the second
without weight decay, is the Trainer's; the mapping string says so.

What is summarised (:func:`summarise`, Adam family with ``exp_avg``/``exp_avg_sq``,
or SGD's ``momentum_buffer``), with ``m̂ = m/(1-β₁ᵗ)`` and ``v̂ = v/(1-β₂ᵗ)``:
the RMS of the next update ``lr · m̂/(√v̂+ε)`` (SGD: ``lr · buf``) over the weight's
RMS, the share of elements with ``√v̂ < ε``, ``‖m‖`` and ``‖√v̂‖``.  On the replayed
batches :class:`RatioHistogram` accumulates ``g²/v̂`` per tensor in log10 bins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CheckpointError, SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradforensics.store.probes import OptimData

__all__ = ["EXAMPLES", "FIELDS", "OPTIMIZERS", "RATIO_EDGES", "STATE_FILES", "Hyper", "OptimState", "RatioHistogram",
           "fit_order", "hyper_of", "map_state", "no_state_refusal", "optim_data",
           "preconditioner", "read_optimizer_state", "summarise"]

#: log10(g²/v̂) bin edges: 10^-12 .. 10^12, 8 bins a decade; under- and overflow go to the end bins.
RATIO_EDGES = np.linspace(-12.0, 12.0, 8 * 24 + 1)
#: Columns of the per-tensor summary (``optim/summary``).
FIELDS = ("update_rms", "weight_rms", "update_ratio", "eps_share", "m_norm", "sqrt_v_norm", "step",
          "ratio_q50", "ratio_q90", "ratio_q99", "ratio_max", "numel")
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")
#: The optimizer state next to the weights in a Hugging Face Trainer checkpoint directory.
STATE_FILES = ("optimizer.pt", "optimizer.bin")


@dataclass(frozen=True)
class Hyper:
    """The optimizer and its hyper-parameters (of the first param group, or given by the user)."""

    optimizer: str                   # adam (any Adam-family: exp_avg_sq), sgd-momentum, sgd
    lr: float
    momentum: float = 0.0            # SGD momentum (heavy-ball)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}.")
        for name in ("lr", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise SpecError(f"optimizer {name} must be a finite number > 0; got {v!r}.")
        for name in ("momentum", "beta1", "beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise SpecError(f"optimizer {name} must be in [0, 1); got {v!r}.")

    def as_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "lr": self.lr, "momentum": self.momentum, "beta1": self.beta1,
                "beta2": self.beta2, "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass
class OptimState:
    """An ``opt.state_dict()`` mapped to names: ``{name: {"exp_avg": ..., ...}}``, the hyper-parameters, how."""

    per_tensor: dict[str, dict[str, Any]]
    hyper: Hyper
    mapping: str
    source: str
    lrs: dict[str, float] = field(default_factory=dict)      # per tensor, from its group


def read_optimizer_state(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str] | None:
    """``(opt.state_dict(), where)`` of the checkpoint at *path*, or None when it has none.

    Raises
    ------
    CheckpointError
        The file cannot be read, or its optimizer entry is not a state dict.
    """
    from gradforensics.replay.untrusted import torch_load

    p = Path(path)
    if p.is_dir():
        file = next((p / f for f in STATE_FILES if (p / f).is_file()), None)
        if file is None:
            return None
        obj, where = torch_load(file), str(file)
    else:
        obj, where = torch_load(p), f"{p} ['optimizer']"
        if isinstance(obj, Mapping) and "optimizer" in obj:
            obj = obj["optimizer"]
        elif not (isinstance(obj, Mapping) and "param_groups" in obj):
            return None
    if not (isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping)
            and isinstance(obj.get("param_groups"), list)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in obj["param_groups"])):
        raise CheckpointError(f"{where}: not an optimizer state dict (expected 'state' and 'param_groups' with "
                              "'params' lists, as opt.state_dict() writes).")
    return dict(obj), where


def _orders(model: nn.Module) -> dict[str, list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    norm_modules = {n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}

    def decayed(name: str) -> bool:
        owner = name.rpartition(".")[0]
        return "bias" not in name.lower() and "norm" not in name.lower() and owner not in norm_modules

    return {"parameters": [n for n, _ in named],
            "hf-trainer": [n for n, _ in named if decayed(n)] + [n for n, _ in named if not decayed(n)]}


def _fits(order: list[str], indices: list[int], state: Mapping[Any, Any], shapes: Mapping[str, Any]) -> str | None:
    """None when *order* fits every state entry by shape, else what disagrees first."""
    if len(indices) != len(order):
        return f"the state numbers {len(indices)} parameters, the model has {len(order)} trainable ones"
    for pos, idx in enumerate(indices):
        entry = state.get(idx) or {}
        if not isinstance(entry, Mapping):
            return f"state[{idx}] is a {type(entry).__name__}, not a mapping of tensors"
        for key, t in entry.items():
            if hasattr(t, "shape") and t.ndim > 0 and tuple(t.shape) != tuple(shapes[order[pos]]):
                return (f"state[{idx}][{key!r}] has shape {tuple(t.shape)} but parameter {order[pos]} has "
                        f"{tuple(shapes[order[pos]])}")
    return None


def fit_order(state_dict: Mapping[str, Any], orders: Mapping[str, list[str]],
              shapes: Mapping[str, Any]) -> tuple[str, list[str], list[str]]:
    """The first of *orders* (``{label: names}``) that fits every state entry by shape.

    The one rule that names an ``opt.state_dict()``'s numbered parameters, for a
    replayed model (:func:`map_state`) and for an imported series
    (:func:`gradforensics.importing.optimizer.name_states`).  When orders with
    different names fit (shapes cannot tell them apart) the param groups decide:
    two groups, the second without weight decay, is the Hugging Face Trainer's (a
    label containing ``hf-trainer``); the label then says so.

    Returns
    -------
    label, order, why
        The chosen label and order (``("", [], why)`` when none fits) and, per order
        refused, what disagreed first.
    """
    groups = state_dict["param_groups"]
    indices = [int(i) for g in groups for i in g["params"]]
    why: list[str] = []
    fit: dict[str, list[str]] = {}
    for label, order in orders.items():
        problem = _fits(order, indices, state_dict["state"], shapes)
        if problem is None:
            fit[label] = order
        else:
            why.append(f"{label} order: {problem}")
    if not fit:
        return "", [], why
    label = next(iter(fit))
    if len({tuple(o) for o in fit.values()}) > 1:      # shapes cannot tell: the groups' weight decay can
        trainer = len(groups) == 2 and float(groups[1].get("weight_decay", 0) or 0) == 0.0
        chosen = next((m for m in fit if ("hf-trainer" in m) == trainer), label)
        other = next(m for m in fit if fit[m] != fit[chosen])
        return f"{chosen} ({other} order fits by shape too; chosen by the param groups)", fit[chosen], why
    return label, fit[label], why


def map_state(state_dict: Mapping[str, Any], model: nn.Module, where: str,
              hyper: Mapping[str, Any] | None = None) -> OptimState:
    """*state_dict* mapped to *model*'s parameter names, checked by shape (see the module doc)."""
    groups = state_dict["param_groups"]
    indices = [int(i) for g in groups for i in g["params"]]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mapping, order, why = fit_order(state_dict, _orders(model), shapes)
    if not order:
        raise CheckpointError(f"{where}: the optimizer state does not fit the model ({'; '.join(why)}); "
                              "was it saved with this model?")
    names = dict(zip(indices, order))
    per = {names[i]: dict(state_dict["state"].get(i) or {}) for i in indices}
    lrs = {names[int(i)]: float(g.get("lr", 0.0)) for g in groups for i in g["params"]}
    return OptimState(per, hyper_of(state_dict, hyper), mapping, where, lrs)


def hyper_of(state_dict: Mapping[str, Any] | None, given: Mapping[str, Any] | None = None) -> Hyper:
    """The hyper-parameters of the first param group (the optimizer type from the state's keys), *given* over them."""
    out: dict[str, Any] = {}
    if state_dict is not None and state_dict["param_groups"]:
        g = state_dict["param_groups"][0]
        keys = {k for s in state_dict["state"].values() if isinstance(s, Mapping) for k in s}
        try:        # numbers from a file: anything else is one line, not a traceback
            kind = "adam" if "exp_avg_sq" in keys or "betas" in g else (
                "sgd-momentum" if float(g.get("momentum", 0.0) or 0.0) > 0 else "sgd")
            out = {"optimizer": kind, "lr": float(g.get("lr", 0.0)), "eps": float(g.get("eps", 1e-8)),
                   "weight_decay": float(g.get("weight_decay", 0.0) or 0.0),
                   "momentum": float(g.get("momentum", 0.0) or 0.0)}
            if "betas" in g:
                out["beta1"], out["beta2"] = (float(b) for b in g["betas"])
        except (TypeError, ValueError) as exc:
            raise SpecError(f"the optimizer state's first param group has a malformed hyper-parameter ({exc}); "
                            "give them (--optimizer adam --lr ...).") from None
    out.update({k: v for k, v in dict(given or {}).items() if v is not None})
    if "optimizer" not in out or "lr" not in out:
        raise SpecError(no_state_refusal(out.get("optimizer")))
    return Hyper(**out)


#: The refusal's example per optimizer: its flags, with a learning rate typical of it.
EXAMPLES = {"adam": "--optimizer adam --lr 3e-4", "sgd": "--optimizer sgd --lr 0.1",
            "sgd-momentum": "--optimizer sgd-momentum --momentum 0.9 --lr 0.1"}


def no_state_refusal(optimizer: str | None) -> str:
    """The one line of a curvature capture with no optimizer state and no learning rate (or optimizer) given.

    The example follows *optimizer* where it is known (given, or read from the checkpoint); under Adam
    it also says what the capture cannot give without the state (:data:`NO_STABILITY_VERDICT`).
    """
    from gradforensics.store.probes import NO_STABILITY_VERDICT

    if optimizer in EXAMPLES:
        note = f"; without its state (exp_avg_sq) {NO_STABILITY_VERDICT}" if optimizer == "adam" else ""
        return (f"the checkpoint holds no optimizer state: give the learning rate of its {optimizer} at this step "
                f"(e.g. {EXAMPLES[optimizer]}, or curvature={{'optimizer': {optimizer!r}, 'lr': ...}}){note}.")
    return ("the checkpoint holds no optimizer state: give the optimizer it trained with and its learning rate "
            f"at this step (e.g. {EXAMPLES['adam']} or {EXAMPLES['sgd']}, or "
            "curvature={'optimizer': ..., 'lr': ...}).")


def _step(entry: Mapping[str, Any]) -> float:
    s = entry.get("step", 0)
    return float(s.item() if hasattr(s, "item") else s)


def preconditioner(state: OptimState, g2: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
    """``{name: √v̂ + ε}`` of an Adam-family state (bias-corrected), else None.

    With *g2* (``{name: E[g²]}`` on the replayed batches) it is the preconditioner of the
    *next* step, ``v' = β₂ v + (1 − β₂) E[g²]`` bias-corrected at ``t + 1``: the one the
    next update divides by (an element whose ``v`` had decayed to 0 gets the gradient it now sees).
    """
    h = state.hyper
    if h.optimizer != "adam":
        return None
    out = {}
    for name, entry in state.per_tensor.items():
        v = entry.get("exp_avg_sq")
        t = _step(entry)
        if v is None or t < 1:
            return None
        v = v.double()
        if g2 is not None and name in g2:
            v, t = h.beta2 * v + (1.0 - h.beta2) * g2[name], t + 1
        out[name] = (v / (1.0 - h.beta2 ** t)).sqrt() + h.eps
    return out


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0


def summarise(state: OptimState, model: nn.Module | Mapping[str, torch.Tensor],
              ratios: RatioHistogram | None = None) -> dict[str, list[float]]:
    """Per tensor, the :data:`FIELDS` (NaN where the optimizer has no such quantity).

    *model*: the model, or its weights by name (an imported checkpoint's state dict).
    """
    params = dict(model.named_parameters()) if hasattr(model, "named_parameters") else dict(model)
    h = state.hyper
    rows: dict[str, list[float]] = {}
    for name, entry in state.per_tensor.items():
        w = params[name].detach()
        lr = state.lrs.get(name, h.lr)
        t = _step(entry)
        nan = float("nan")
        upd = eps_share = m_norm = v_norm = nan
        if h.optimizer == "adam" and "exp_avg" in entry and "exp_avg_sq" in entry and t >= 1:
            m_hat = entry["exp_avg"].double() / (1.0 - h.beta1 ** t)
            sqrt_v = (entry["exp_avg_sq"].double() / (1.0 - h.beta2 ** t)).sqrt()
            upd = lr * _rms(m_hat / (sqrt_v + h.eps))
            eps_share = float((sqrt_v < h.eps).double().mean())
            m_norm, v_norm = float(entry["exp_avg"].double().norm()), float(sqrt_v.norm())
        elif entry.get("momentum_buffer") is not None:
            upd = lr * _rms(entry["momentum_buffer"])
            m_norm = float(entry["momentum_buffer"].double().norm())
        wr = _rms(w)
        q = ratios.quantiles(name) if ratios is not None else (nan,) * 4
        rows[name] = [upd, wr, upd / wr if wr > 0 else nan, eps_share, m_norm, v_norm, t, *q, float(w.numel())]
    return rows


def optim_data(state: OptimState, model: nn.Module | Mapping[str, torch.Tensor],
               ratios: RatioHistogram | None = None) -> OptimData:
    """The ``optim/`` group of *state*: :func:`summarise`'s rows, the g²/v̂ histograms (zeros without *ratios*)."""
    from gradforensics.store.probes import OptimData

    weights = dict(model.named_parameters()) if hasattr(model, "named_parameters") else dict(model)
    table = summarise(state, weights, ratios)
    names = list(table)
    bins = len(RATIO_EDGES) - 1
    hist = np.stack([ratios.counts[n] if ratios is not None and n in ratios.counts else np.zeros(bins, dtype=np.int64)
                     for n in names]) if names else np.zeros((0, bins), dtype=np.int64)
    summary = np.array([table[n] for n in names], dtype=np.float64).reshape(len(names), len(FIELDS))
    return OptimData(names, list(FIELDS), summary, hist,
                     {"hyper": state.hyper.as_dict(), "mapping": state.mapping, "source": state.source,
                      "edges": RATIO_EDGES.tolist(), "ndim": {n: int(weights[n].ndim) for n in names}})


class RatioHistogram:
    """``g²/v̂`` per element of each tensor, over the replayed batches, as counts in :data:`RATIO_EDGES` bins.

    ``add(model)`` after each batch's ``backward()``; an element with ``g = 0``
    counts in the lowest bin, one with ``v̂ = 0 < g²`` in the highest.
    """

    def __init__(self, state: OptimState) -> None:
        pre = preconditioner(state)
        if pre is None:
            raise SpecError("g^2/v_hat needs an Adam-family state (exp_avg_sq) with step >= 1.")
        self.v_hat = {n: (p - state.hyper.eps).pow(2) for n, p in pre.items()}
        self.counts = {n: np.zeros(len(RATIO_EDGES) - 1, dtype=np.int64) for n in pre}
        self.g2_sum: dict[str, Any] = {}
        self.batches = 0

    def add(self, model: nn.Module) -> None:
        import torch

        self.batches += 1
        for name, p in model.named_parameters():
            if name not in self.v_hat or p.grad is None:
                continue
            g2 = p.grad.detach().double().cpu().pow(2)
            self.g2_sum[name] = g2 if name not in self.g2_sum else self.g2_sum[name] + g2
            with np.errstate(divide="ignore"):
                r = torch.log10(g2 / self.v_hat[name]).nan_to_num(nan=-np.inf).numpy().ravel()
            r = np.clip(r, RATIO_EDGES[0], RATIO_EDGES[-1])
            self.counts[name] += np.histogram(r, bins=RATIO_EDGES)[0]

    def mean_g2(self) -> dict[str, Any]:
        """``{name: E[g²]}`` over the batches seen (a tensor without a gradient: zeros)."""
        return {n: self.g2_sum.get(n, 0.0 * v) / max(self.batches, 1) for n, v in self.v_hat.items()}

    def quantiles(self, name: str, qs: Sequence[float] = (0.5, 0.9, 0.99)) -> tuple[float, ...]:
        """Quantiles of g²/v̂ (the upper edge of the bin reaching each), and the largest bin's upper edge."""
        c = self.counts.get(name)
        if c is None or c.sum() == 0:
            return (float("nan"),) * (len(qs) + 1)
        cum = np.cumsum(c) / c.sum()
        out = [10.0 ** RATIO_EDGES[1 + int(np.searchsorted(cum, q))] for q in qs]
        return (*out, 10.0 ** RATIO_EDGES[1 + int(np.nonzero(c)[0][-1])])
