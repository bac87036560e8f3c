"""Mixture-of-experts capture: per-expert gradient units and router statistics (``experts=``).

``experts="auto"`` finds every module named ``experts`` (its last name segment) in
the model, in one of two forms:

* **fused**: the module holds its experts' weights as ``(E, ...)`` tensors
  (``nn.Parameter`` directly on it, leading axis the ``E`` experts; E is the
  module's ``num_experts``, else its router's output size).  Transformers 5
  stores Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 experts so
  (``mlp.experts.gate_up_proj`` ``(E, 2I, D)``, ``mlp.experts.down_proj``
  ``(E, D, I)``).  Each such tensor is one unit as it is.
* **listed**: an ``nn.ModuleList`` of E expert modules (Mixtral's
  ``block_sparse_moe.experts.<i>.w1``, older Qwen-MoE ``mlp.experts.<i>.down_proj``).
  The E experts' same-named weights are stacked, in expert order, into one
  ``(E, ...)`` unit named by dropping the expert index:
  ``model.layers.0.mlp.experts.3.down_proj.weight`` -> ``model.layers.0.mlp.experts.down_proj.weight``.

A shared expert (``mlp.shared_expert``) is not under an ``experts`` module: it stays
an ordinary tensor.  ``experts={glob: E}`` names the experts modules itself (globs
over module names, E the expert count, checked).  Each unit is stored as
``grads/<unit>`` ``(N, E, ...)`` with the attribute ``experts = E``.

The router of an experts module is its sibling named ``gate`` or ``router`` (the
module that holds both).  Its weight is recorded (its gradient norm is the router's),
and a forward hook reduces its output on the device (:class:`RouterHook`): a tuple
``(logits, scores, indices)`` (transformers 5 routers: the indices are the top-k
experts each token was sent to) or a logits tensor ``(..., E)`` (then the top-k of
the logits, k the router's or its parent's ``top_k`` / ``num_experts_per_tok``).
Per record, over every token of every micro-batch with gradients on since the
previous record, under ``router/<router module>/``:

* ``load`` ``(N, E)``: each expert's share of the top-k assignments (sums to 1; attributes
  ``experts`` E and ``top_k`` k; an expert in every token's top k has 1/k);
* ``max_share`` ``(N,)``: the largest ``load``, between 1/E (balanced) and 1/k;
* ``entropy`` ``(N,)``: the entropy (nats) of the *mean routing distribution*
  ``p̄ = mean over tokens of softmax(router logits)``; ``log E`` is uniform routing, 0 collapse;
* ``logit_z`` ``(N,)``: the mean over tokens of ``logsumexp(router logits)²`` (the
  quantity the router z-loss penalises);
* ``aux_loss`` ``(N,)``: the layer's auxiliary load-balancing loss (Switch Transformer)
  ``E · Σ_e f_e · P_e``, ``f_e`` the assignments to expert ``e`` per token (summed over the
  top-k slots) and ``P_e`` its mean routing probability - what transformers'
  ``load_balancing_loss_func`` gives on this layer's logits alone (no attention mask): ``k`` at
  balanced routing (``f_e = k/E``, ``P_e = 1/E``), up to ``E`` at a collapse.

The model's own auxiliary loss, where it reports one (a Hugging Face MoE model run with
``output_router_logits=True`` returns ``aux_loss``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; their
loss pools every layer's tokens and honours the attention mask), is read from the model's output
(:class:`ModelAuxTap`) and stored per record as ``router/aux_loss``: the mean over the record's
forwards with gradients on.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.store.names import check_name
from gradforensics.store.schema import ROUTER_FIELDS, router_path

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ExpertPlan", "ModelAuxTap", "RouterHook", "RouterTaps", "match_experts", "parse_cli_experts", "resolve_experts",
           "stack_units"]

_ROUTER_NAMES = ("gate", "router")


def match_experts(name: str, experts: Mapping[str, int]) -> int | None:
    """E of the first glob in *experts* (``{tensor glob: E}``) that matches tensor *name*, else None."""
    return next((int(e) for glob, e in experts.items() if fnmatch.fnmatchcase(name, glob)), None)


def parse_cli_experts(specs: list[str]) -> str | dict[str, int] | None:
    """``--experts`` entries -> ``experts=``: none or ``auto`` -> ``"auto"``; ``none`` -> None; ``GLOB=E`` -> a dict."""
    if not specs or specs == ["auto"]:
        return "auto"
    if specs == ["none"]:
        return None
    out: dict[str, int] = {}
    for spec in specs:
        glob, eq, e = spec.partition("=")
        if not eq or not glob or not e.isdigit() or int(e) < 1:
            raise SpecError(f"--experts {spec!r}: expected auto, none, or GLOB=E (E the expert count, >= 1).")
        out[glob] = int(e)
    return out


@dataclass
class ExpertPlan:
    """What ``experts=`` found in a model."""

    #: unit name -> E (every unit, fused or listed)
    units: dict[str, int] = field(default_factory=dict)
    #: listed units: unit name -> the E member parameter names, in expert order
    listed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: router module name -> (module, E, top-k or None when the router returns its indices)
    routers: dict[str, tuple[Any, int, int | None]] = field(default_factory=dict)

    @property
    def members(self) -> set[str]:
        return {m for ms in self.listed.values() for m in ms}


def resolve_experts(model: nn.Module, spec: str | Mapping[str, int] | None) -> ExpertPlan:
    """The experts units and routers of *model* for ``experts=`` (see the module doc)."""
    plan = ExpertPlan()
    if spec is None:
        return plan
    named = dict(model.named_modules())
    if spec == "auto":
        hits: dict[str, int | None] = {n: None for n in named if n and n.rsplit(".", 1)[-1] == "experts"}
        if not hits:
            raise SpecError(f"experts='auto': {type(model).__name__} has no module named 'experts'; pass "
                            "experts={'<experts module glob>': E}.",
                            cli=f"--experts: {type(model).__name__} has no module named 'experts'; pass "
                                "--experts GLOB=E.")
    elif isinstance(spec, Mapping):
        hits = {}
        for glob, e in spec.items():
            if not isinstance(e, int) or isinstance(e, bool) or e < 1:
                raise SpecError(f"experts: {glob!r} needs a positive int E (the expert count); got {e!r}.")
            found = [n for n in named if n and fnmatch.fnmatchcase(n, glob)]
            if not found:
                raise SpecError(f"experts: glob {glob!r} matches no module of {type(model).__name__} (experts "
                                f"modules look like {next((n for n in named if n.endswith('experts')), 'mlp.experts')}).")
            hits.update((n, e) for n in found)
    else:
        raise SpecError(f"experts must be 'auto', {{module glob: E}} or None; got {spec!r}.")
    for name, want in hits.items():
        _add(plan, model, named, name, want)
    return plan


def _add(plan: ExpertPlan, model: nn.Module, named: dict[str, nn.Module], name: str, want: int | None) -> None:
    from torch import nn

    module = named[name]
    parent_name = name.rpartition(".")[0]
    parent = named.get(parent_name, model)
    router_name, router = next(((f"{parent_name}.{r}" if parent_name else r, getattr(parent, r))
                                for r in _ROUTER_NAMES if isinstance(getattr(parent, r, None), nn.Module)),
                               ("", None))
    if isinstance(module, nn.ModuleList):
        e = len(module)
        groups: dict[str, list[str]] = {}
        for i, expert in enumerate(module):
            for pname, p in expert.named_parameters():
                if p.requires_grad:
                    groups.setdefault(pname, []).append(f"{name}.{i}.{pname}")
        for pname, members in groups.items():
            if len(members) == e:
                unit = check_name(f"{name}.{pname}", "experts unit")
                plan.units[unit], plan.listed[unit] = e, tuple(members)
    else:
        n_exp = getattr(module, "num_experts", None)
        if not isinstance(n_exp, int):
            w = getattr(router, "weight", None)
            n_exp = int(w.shape[0]) if w is not None and w.ndim == 2 else None
        if n_exp is None:
            raise SpecError(f"experts: {name} ({type(module).__name__}) is neither an nn.ModuleList nor a module "
                            "with num_experts or a gate/router beside it; pass experts={glob: E} naming it.")
        e = n_exp
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.ndim >= 2 and p.shape[0] == e:
                plan.units[check_name(f"{name}.{pname}", "experts unit")] = e
    if want is not None and want != e:
        raise SpecError(f"experts: {name} holds {e} experts, not {want}.")
    if router is not None:
        k = _top_k(router, parent)
        plan.routers[check_name(router_name, "router module")] = (router, e, k)


def _top_k(router: Any, parent: Any) -> int | None:
    for owner in (router, parent, getattr(parent, "config", None)):
        for attr in ("top_k", "num_experts_per_tok"):
            v = getattr(owner, attr, None)
            if isinstance(v, int) and v >= 1:
                return v
    return None


def stack_units(tensors: dict[str, Any], listed: Mapping[str, tuple[str, ...]],
                stack: Callable[[list[Any]], Any] | None = None) -> dict[str, Any]:
    """*tensors* with each listed unit's members replaced by their stack ``(E, ...)`` (where its first member was);
    *stack* (default ``torch.stack``) joins the members' values."""
    if not listed:
        return tensors
    if stack is None:
        import torch

        stack = torch.stack
    first = {ms[0]: unit for unit, ms in listed.items() if all(m in tensors for m in ms)}
    gone = {m for unit in first.values() for m in listed[unit]}
    out: dict[str, Any] = {}
    for n, t in tensors.items():
        if n in first:
            unit = first[n]
            out[unit] = stack([tensors[m] for m in listed[unit]])
        elif n not in gone:
            out[n] = t
    return out


class RouterHook:
    """Forward hook on a router: expert counts, summed routing probabilities and z on the device since :meth:`take`."""

    def __init__(self, name: str, experts: int, top_k: int | None) -> None:
        self.name, self.experts, self.top_k = name, experts, top_k
        self.sums: Any = None       # float64 (2E + 2,): [counts (E), Σ softmax (E), Σ lse², n tokens]
        self.k_seen = top_k or 1    # experts per token, as last seen (the indices' last axis)

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> None:
        import torch

        if not torch.is_grad_enabled():
            return
        logits, idx = _logits_and_indices(self.name, output, self.experts)
        with torch.no_grad():
            x = logits.detach().reshape(-1, self.experts).double()
            if idx is None:
                if self.top_k is None:
                    raise SpecError(f"experts: router {self.name} returns only logits and neither it nor its parent "
                                    "has top_k / num_experts_per_tok; its load cannot be counted.")
                idx = torch.topk(x, self.top_k, dim=-1).indices
            self.k_seen = int(idx.shape[-1]) if idx.ndim >= 1 else 1
            counts = torch.bincount(idx.detach().reshape(-1).long(), minlength=self.experts)[: self.experts]
            lse = torch.logsumexp(x, dim=-1)
            s = torch.cat([counts.double(), torch.softmax(x, dim=-1).sum(0),
                           torch.stack([(lse * lse).sum(), torch.tensor(float(x.shape[0]), dtype=torch.float64,
                                                                        device=x.device)])])
            self.sums = s if self.sums is None else self.sums + s

    def take(self) -> Any:
        """The sums since the previous take (a float64 tensor on the router's device), or None without a forward."""
        s, self.sums = self.sums, None
        return s


def _logits_and_indices(name: str, output: Any, experts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    import torch

    logits = output[0] if isinstance(output, (tuple, list)) and output else output
    idx = output[2] if isinstance(output, (tuple, list)) and len(output) >= 3 else None
    if not isinstance(logits, torch.Tensor) or logits.ndim < 1 or logits.shape[-1] != experts:
        raise SpecError(f"experts: router {name} returned {type(output).__name__}, not router logits (..., {experts}) "
                        "or a tuple (logits, scores, indices).")
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point():
        idx = None
    return logits, idx


def router_stats(s: np.ndarray, experts: int) -> dict[str, Any]:
    """The ``ROUTER_FIELDS`` of one record from a hook's sums (see the module doc)."""
    counts, probs, z2, n = s[:experts], s[experts:2 * experts], s[2 * experts], s[2 * experts + 1]
    load = counts / counts.sum() if counts.sum() > 0 else np.full(experts, np.nan)
    p = probs / n
    nz = p[p > 0]
    return {"load": load.astype(np.float32), "max_share": np.float32(load.max()),
            "entropy": np.float32(-(nz * np.log(nz)).sum()), "logit_z": np.float32(z2 / n),
            "aux_loss": np.float32(experts * float(np.dot(counts / n, p)))}


class RouterTaps:
    """Hooks on the routers; :meth:`take` gives each one's per-record rows ``{path: (array, attrs)}``."""

    def __init__(self, routers: Mapping[str, tuple[Any, int, int | None]]) -> None:
        self.hooks = {n: RouterHook(n, e, k) for n, (_, e, k) in routers.items()}
        self.handles = [m.register_forward_hook(self.hooks[n]) for n, (m, _, _) in routers.items()]

    def take(self, reduce: Callable[[Any], Any] | None = None) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        """Each router's rows of this record.  *reduce* (collective, under FSDP): sums the routers' sums over the
        ranks (one float64 tensor of every router's sums; a rank without a forward adds zeros), so a record counts
        the tokens of every rank's micro-batches."""
        sums = {name: hook.take() for name, hook in self.hooks.items()}
        if reduce is not None:
            import torch

            device = next((s.device for s in sums.values() if s is not None), torch.device("cpu"))
            sizes = [2 * h.experts + 2 for h in self.hooks.values()]
            flat = reduce(torch.cat([s if s is not None else torch.zeros(n, dtype=torch.float64, device=device)
                                     for s, n in zip(sums.values(), sizes, strict=True)]))
            parts = torch.split(flat, sizes)
            sums = {name: (p if float(p[-1]) > 0 else None) for name, p in zip(sums, parts, strict=True)}
        out: dict[str, tuple[np.ndarray, dict[str, Any]]] = {}
        for name, hook in self.hooks.items():
            s = sums[name]
            if s is None:
                raise SpecError(f"experts: router {name} ran no forward with gradients since the previous record; "
                                "every router must run in every recorded batch.")
            stats = router_stats(s.cpu().numpy(), hook.experts)
            load_attrs = {"experts": hook.experts, "top_k": hook.k_seen}
            out.update({router_path(name, k): (np.asarray(stats[k]), load_attrs if k == "load" else {})
                        for k in ROUTER_FIELDS})
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ModelAuxTap:
    """Forward hook on the model: the ``aux_loss`` it returns (a Hugging Face MoE output), summed on the device.

    :meth:`take` gives the mean over the forwards with gradients on since the previous take, or None when
    none of them returned an ``aux_loss`` (a model run without ``output_router_logits``, or one without it).
    """

    def __init__(self, model: nn.Module) -> None:
        self.sum: Any = None
        self.count = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> None:
        import torch

        if not torch.is_grad_enabled():
            return
        aux = output.get("aux_loss") if isinstance(output, Mapping) else getattr(output, "aux_loss", None)
        if not isinstance(aux, torch.Tensor) or aux.numel() != 1:
            return
        v = aux.detach().reshape(()).double()
        self.sum = v if self.sum is None else self.sum + v.to(self.sum.device)
        self.count += 1

    def take(self, reduce: Callable[[Any], Any] | None = None) -> float | None:
        """The mean since the previous take; *reduce* (collective, under FSDP) sums ``[mean, 1]`` over the ranks
        that saw one, so a record holds the mean of the ranks' means."""
        s, n, self.sum, self.count = self.sum, self.count, None, 0
        mean = None if s is None else float(s) / n
        if reduce is not None:
            import torch

            v = reduce(torch.tensor([mean or 0.0, float(mean is not None)], dtype=torch.float64,
                                    device=s.device if s is not None else "cpu"))
            return float(v[0] / v[1]) if float(v[1]) > 0 else None
        return mean

    def remove(self) -> None:
        self.handle.remove()
