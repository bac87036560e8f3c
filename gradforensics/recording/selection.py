"""Which parameters and modules of a PyTorch model a recorder takes, and what it notes about the model."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CONFIG_KEYS", "model_info", "run_dtypes", "select_modules", "select_parameters"]


#: ``model.config`` fields copied into the store's ``model`` attribute.
CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size")


def select_parameters(model: nn.Module, tensors: Sequence[str] | None) -> dict[str, torch.nn.Parameter]:
    """The parameters named by the globs *tensors* (default: every trainable 2-D weight), in model order.

    Raises
    ------
    SpecError
        A glob that matches no parameter.
    """
    params = dict(model.named_parameters())
    if tensors is None:
        return {n: p for n, p in params.items() if p.ndim == 2 and p.requires_grad}
    if isinstance(tensors, str):
        tensors = [tensors]
    out: dict[str, torch.nn.Parameter] = {}
    for glob in tensors:
        hits = [n for n in params if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise SpecError(f"tensors: glob {glob!r} matches no parameter of {type(model).__name__} "
                            f"(names look like {', '.join(list(params)[:3])}).")
        out.update((n, params[n]) for n in hits)
    return {n: out[n] for n in params if n in out}   # model order


def select_modules(model: nn.Module, globs: Sequence[str] | None) -> dict[str, nn.Module]:
    """The modules named by the globs *globs* (for activation hooks); a glob that matches none is a SpecError."""
    if not globs:
        return {}
    if isinstance(globs, str):
        globs = [globs]
    named = dict(model.named_modules())
    out: dict[str, nn.Module] = {}
    for glob in globs:
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise SpecError(f"activations: glob {glob!r} matches no module of {type(model).__name__} "
                            f"(names look like {', '.join([n for n in named if n][:3])}).")
        out.update((n, named[n]) for n in hits)
    return out


def model_info(model: nn.Module) -> dict[str, Any]:
    """Class, parameter count, dtype and a JSON-safe subset of ``model.config``."""
    info: dict[str, Any] = {"class": type(model).__name__,
                            "n_params": int(sum(p.numel() for p in model.parameters()))}
    first = next(iter(model.parameters()), None)
    if first is not None:
        info["dtype"] = str(first.dtype).removeprefix("torch.")
    cfg = getattr(model, "config", None)
    if cfg is not None:
        sub = {k: getattr(cfg, k, None) for k in CONFIG_KEYS}
        info["config"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                          for k, v in sub.items() if v is not None}
    return info


def run_dtypes(model: nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """``{"parameters": ..., "master": ...}``: the trainable parameters' dtype (the most common one), and the
    master weights' (what *given* says, else the parameters' own: a torch optimizer steps the parameters)."""
    names = [str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad]
    out = {"parameters": max(set(names), key=names.count)} if names else {}
    if out:
        out["master"] = out["parameters"]
    out.update(dict(given or {}))
    return out
