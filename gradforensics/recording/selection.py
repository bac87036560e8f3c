"""Which parameters and modules of a PyTorch model a recorder takes, and what it notes about the model."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CONFIG_KEYS", "model_info", "qk_norms", "run_dtypes", "select_modules", "select_parameters"]


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


#: Leaf names of a normalisation applied to queries or keys (Qwen3/OLMo2/Gemma3 ``q_norm``, Persimmon
#: ``q_layernorm``, nanoGPT variants ``q_ln``, ``query_norm``, ``qk_norm``; ``norm_q``).
_QK_NORM = re.compile(r"^(?:(?:q|k|qk|query|key)_?(?:norm|ln|layernorm|layer_norm|rmsnorm|rms_norm)"
                      r"|(?:norm|ln)_?(?:q|k|qk))$", re.IGNORECASE)


def qk_norms(model: nn.Module) -> list[str]:
    """The modules that normalise queries or keys before the dot product: a norm by type (its class name
    holds ``Norm``) whose own name says q or k (``q_norm``, ``k_layernorm``, ``q_ln``, ...), sorted.

    A q/k normalisation bounds the attention logits whatever W_Q, W_K do (``|q.k|/sqrt(d) <= g_q g_k sqrt(d)``
    for unit-RMS q, k with gains g), so the spectral analysis does not judge those weights' growth as logit
    growth.  One applied by a function call (``F.layer_norm(q, ...)``) has no module and is not seen.
    """
    return sorted(n for n, m in model.named_modules()
                  if n and "norm" in type(m).__name__.lower() and _QK_NORM.match(n.rsplit(".", 1)[-1]))


def model_info(model: nn.Module) -> dict[str, Any]:
    """Class, parameter count, dtype, the q/k normalisations (:func:`qk_norms`, when there are any) and a
    JSON-safe subset of ``model.config``."""
    info: dict[str, Any] = {"class": type(model).__name__,
                            "n_params": int(sum(p.numel() for p in model.parameters()))}
    norms = qk_norms(model)
    if norms:
        info["qk_norm"] = norms
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
