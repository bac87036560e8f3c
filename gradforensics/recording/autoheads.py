"""``heads="auto"``: find the per-head layout of attention weights in a PyTorch model.

The rules follow the modelling code of each family (Hugging Face transformers
names; ``nn.MultiheadAttention`` too).  ``H`` is the number of query heads,
``KV`` the number of key/value heads (``KV < H`` is grouped-query attention,
Ainslie et al. 2023), ``d`` the head size:

=====================================  ==============================  =======================================
parameter (leaf module)                weight layout                   split
=====================================  ==============================  =======================================
LLaMA/Mistral/Qwen ``q_proj``          Linear ``(H d, in)``            axis 0, ``H`` heads, role q
``k_proj`` / ``v_proj``                Linear ``(KV d, in)``           axis 0, ``KV`` heads, role k / v
``o_proj``                             Linear ``(out, H d)``           axis 1, ``H`` heads, role o
GPT-2 ``attn.c_attn``                  Conv1D ``(in, 3 H d)``, q|k|v   axis 1, fused 3, role qkv
GPT-2 ``attn.c_proj``                  Conv1D ``(H d, out)``           axis 0 (the input side), role o
GPT-NeoX ``attention.query_key_value`` Linear ``(3 H d, in)``, rows    axis 0, fused 3, interleaved, role qkv
                                       ``[h][q|k|v][d]``
GPT-NeoX ``attention.dense``           Linear ``(out, H d)``           axis 1, role o
Phi-3 ``qkv_proj``                     Linear ``((H+2KV) d, in)``      axis 0, ``H + 2 KV`` heads, role qkv
BERT ``self.query/key/value``          Linear ``(H d, in)``            axis 0, ``H`` heads, role q / k / v
BERT ``attention.output.dense``        Linear ``(out, H d)``           axis 1, role o
``nn.MultiheadAttention``              ``in_proj_weight (3 E, E)``     axis 0, fused 3, role qkv;
                                       ``out_proj (E, E)``             axis 1, role o
=====================================  ==============================  =======================================

Biases of q/k/v projections split like the rows of their weight; output
biases are not per head and stay whole.  Head counts come from the attention
module's own attributes (``num_heads``, ``num_key_value_heads``, ``head_dim``,
...) and then from ``model.config`` (``num_attention_heads``,
``num_key_value_heads``, ``head_dim``).  A tensor that looks like attention
but that no rule decides raises :class:`~gradforensics.errors.SpecError` naming
it and the explicit spec to pass instead.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError
from gradforensics.recording.heads import parse_head_spec
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ATTENTION_LEAVES", "Counts", "auto_spec", "counts_for", "glob_for", "resolve_heads", "text_config"]


#: Leaf names that look like attention projections (a tensor under one of these
#: that no rule can split is an error, not silently kept whole).
ATTENTION_LEAVES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv_proj", "c_attn", "q_attn", "query_key_value",
    "qkv", "wqkv", "Wqkv", "wq", "wk", "wv", "wo", "query", "key", "value", "in_proj",
})
_INTERLEAVED_QKV_TYPES = ("gpt_neox", "gpt_neox_japanese", "bloom")


@dataclass(frozen=True)
class Counts:
    """Head counts of one attention module (``None`` where unknown)."""

    heads: int | None
    kv_heads: int | None
    head_dim: int | None


def _int_attr(objs: Iterable[Any], names: Iterable[str]) -> int | None:
    for obj in objs:
        if obj is None:
            continue
        for n in names:
            v = getattr(obj, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def text_config(model: nn.Module) -> Any:
    """``model.config``, or its text part for a multimodal config (``get_text_config()``); ``None`` without one."""
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except (TypeError, ValueError):
            return cfg
    return cfg


def counts_for(attn: nn.Module, model: nn.Module) -> Counts:
    """Head counts of attention module *attn*: its own attributes first, then the config."""
    cfg = text_config(model)
    objs = (attn, getattr(attn, "config", None), cfg)
    heads = _int_attr(objs, ("num_heads", "num_attention_heads", "n_heads", "n_head"))
    kv = _int_attr(objs, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head"))
    head_dim = _int_attr(objs, ("head_dim", "head_size", "attention_head_size"))
    if kv is None and heads is not None:
        groups = _int_attr((attn,), ("num_key_value_groups",))
        kv = heads // groups if groups and heads % groups == 0 else heads
    if head_dim is None and heads:
        hidden = _int_attr(objs, ("embed_dim", "hidden_size", "n_embd", "d_model"))
        head_dim = hidden // heads if hidden and hidden % heads == 0 else None
    return Counts(heads, kv, head_dim)


def glob_for(name: str) -> str:
    """A glob for *name* across layers: ``model.layers.3.x`` -> ``*.layers.*.x``."""
    parts = name.split(".")
    out = ["*" if p.isdigit() else p for p in parts]
    return ".".join(["*", *out[1:]]) if len(out) > 2 else ".".join(out)


def _undecided(name: str, why: str) -> SpecError:
    g = glob_for(name)
    return SpecError(
        f"heads='auto' cannot split {name} ({why}); pass heads={{'{g}': H}} (heads along axis 0) or "
        f"heads={{'{g}': {{'heads': H, 'axis': A}}}}, with 'auto': True in the dict to keep the automatic "
        "rules for the other tensors, or {'" + g + "': None} to store it whole."
    )


def _is_attention(module: nn.Module, name: str) -> bool:
    cls = type(module).__name__.lower()
    leaf = name.rsplit(".", 1)[-1].lower()
    return "attention" in cls or "attn" in cls or leaf in ("attn", "attention", "self_attn", "self_attention")


def _need(value: int | None, what: str, name: str) -> int:
    if value is None:
        raise _undecided(name, f"the model has no {what} (no config, no attribute on the attention module)")
    return value


def _model_type(model: nn.Module) -> str:
    return str(getattr(text_config(model), "model_type", "") or "")


def _rule(name: str, leaf: str, param: str, owner: nn.Module, attn: nn.Module, model: nn.Module,
          ndim: int) -> HeadSpec | None:
    """The spec for parameter *param* of leaf module *owner* inside attention *attn*."""
    c = counts_for(attn, model)
    conv1d = type(owner).__name__ == "Conv1D"          # transformers' Conv1D: weight (in, out)
    bias = param == "bias" or ndim == 1
    if leaf in ("q_proj", "query", "wq", "q"):
        return HeadSpec(_need(c.heads, "num_attention_heads", name), 0, "q")
    if leaf in ("k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v"):
        role = "k" if leaf in ("k_proj", "key", "wk", "k") else "v"
        return HeadSpec(_need(c.kv_heads or c.heads, "num_key_value_heads", name), 0, role)
    if leaf in ("o_proj", "out_proj", "dense", "wo", "o") or (leaf == "c_proj" and conv1d):
        if bias:
            return None
        return HeadSpec(_need(c.heads, "num_attention_heads", name), 0 if conv1d else 1, "o")
    if leaf == "c_attn":
        if hasattr(attn, "q_attn"):
            raise _undecided(name, "GPT-2 cross-attention c_attn holds k|v only")
        return HeadSpec(_need(c.heads, "num_attention_heads", name), 0 if bias else 1, "qkv", fused=3)
    if leaf == "q_attn":
        return HeadSpec(_need(c.heads, "num_attention_heads", name), 0 if bias else 1, "q")
    if leaf == "query_key_value":
        kind = _model_type(model) or type(attn).__name__.lower()
        if not any(t in kind.replace("-", "_") for t in (*_INTERLEAVED_QKV_TYPES, "neox")):
            raise _undecided(name, f"fused query_key_value of model type {kind!r} has no known layout")
        return HeadSpec(_need(c.heads, "num_attention_heads", name), 0, "qkv", fused=3, interleaved=True)
    if leaf in ("qkv_proj", "qkv", "wqkv", "Wqkv"):
        h = _need(c.heads, "num_attention_heads", name)
        kv = c.kv_heads or h
        return HeadSpec(h, 0, "qkv", fused=3) if kv == h else HeadSpec(h + 2 * kv, 0, "qkv")
    return None


def _mha_rule(name: str, param: str, mha: nn.Module) -> HeadSpec | None:
    h = int(mha.num_heads)  # type: ignore[arg-type]
    if param in ("in_proj_weight", "in_proj_bias"):
        return HeadSpec(h, 0, "qkv", fused=3)
    if param in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return HeadSpec(h, 0, param[0])
    if name.endswith("out_proj.weight"):
        return HeadSpec(h, 1, "o")
    return None


def _bert_output_spec(name: str, parent_name: str, model: nn.Module) -> HeadSpec:
    """BERT-style ``attention.output.dense``: Linear ``(out, H d)``; the sibling ``attention.self`` has the counts."""
    attn = model.get_submodule(parent_name.rpartition(".")[0])
    inner = getattr(attn, "self", attn)
    return HeadSpec(_need(counts_for(inner, model).heads, "num_attention_heads", name), 1, "o")


def auto_spec(model: nn.Module, name: str, ndim: int) -> HeadSpec | None:
    """The automatic head spec of parameter *name* of *model* (``None``: not per head)."""
    from torch import nn as tnn

    owner_name, _, param = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(owner, tnn.MultiheadAttention):
        return _mha_rule(name, param, owner)
    parent_name, _, leaf = owner_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, tnn.MultiheadAttention):
        return _mha_rule(name, param, parent)
    if leaf == "dense" and parent_name.endswith("attention.output") and ndim >= 2:
        return _bert_output_spec(name, parent_name, model)
    if not _is_attention(parent, parent_name):
        if leaf in ATTENTION_LEAVES and leaf not in ("query", "key", "value") and ndim >= 2:
            raise _undecided(name, f"its module {parent_name or '<root>'} is not recognised as attention")
        return None
    spec = _rule(name, leaf, param, owner, parent, model, ndim)
    if spec is None and ndim >= 2 and leaf in ATTENTION_LEAVES:
        raise _undecided(name, "no rule for this projection")
    return spec


def resolve_heads(model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                  heads: str | Mapping[str, Any] | None) -> dict[str, HeadSpec]:
    """Head specs of the recorded tensors: ``{tensor name: HeadSpec}``, validated against shapes.

    *heads* is ``"auto"``, ``None`` or ``{glob: H | dict | None}``; in a dict, the
    entry ``"auto": True`` applies the automatic rules to tensors no glob names,
    and a glob mapped to ``None`` keeps its tensors whole.
    """
    if heads is None:
        return {}
    if isinstance(heads, str):
        if heads != "auto":
            raise SpecError(f"heads must be 'auto', a dict or None; got {heads!r}.")
        explicit: dict[str, Any] = {}
        use_auto = True
    else:
        explicit = dict(heads)
        use_auto = bool(explicit.pop("auto", False))
    used: set[str] = set()
    out: dict[str, HeadSpec] = {}
    for name, shape in shapes.items():
        glob = next((g for g in explicit if fnmatch.fnmatchcase(name, g)), None)
        if glob is not None:
            used.add(glob)
            spec = None if explicit[glob] is None else parse_head_spec(name, explicit[glob])
        elif use_auto:
            spec = auto_spec(model, name, len(shape))
            if spec is not None:
                spec.validate(name, shape)
                _check_head_dim(model, name, shape, spec)
        else:
            spec = None
        if spec is not None:
            spec.validate(name, shape)
            out[name] = spec
    unused = [g for g in explicit if g not in used]
    if unused:
        raise SpecError(f"heads: glob {unused[0]!r} matches none of the recorded tensors "
                        f"(e.g. {', '.join(list(shapes)[:3])}).")
    return out


def _check_head_dim(model: nn.Module, name: str, shape: tuple[int, ...], spec: HeadSpec) -> None:
    """Cross-check a head count against the config's head size, where both are known."""
    cfg = text_config(model)
    d = getattr(cfg, "head_dim", None)
    if not isinstance(d, int) or d <= 0:
        return
    got = shape[spec.axis] // spec.total
    if got != d:
        raise SpecError(
            f"heads for {name}: {spec.total} heads on axis {spec.axis} of {shape} give head size {got}; "
            f"the model config says head_dim={d}. Pass the right count in heads={{'{glob_for(name)}': H}}."
        )
