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

The axis follows the module type, not the shape: ``nn.Linear`` ``(out, in)``
splits its output axis 0, transformers' ``Conv1D`` ``(in, out)`` axis 1, any
other module the axis a probe shows to be its output; an output projection
(``o_proj``, ``c_proj``, ``out_proj``, ``dense``, ``wo`` of an attention
module) splits its input axis.  A fused q|k|v of width ``H d + 2 KV d`` is split
into roles q, k, v with their own head counts (``HeadSpec.parts``).  Every split
of a leaf module's weight, automatic or explicit, is checked by
:func:`check_split` against the module's own output on a seeded probe.  A
module that is not attention (no attention class name; no head count with a
q/k/v projection: a Mamba ``in_proj``) is not split, and not refused.

Biases of q/k/v projections split like the rows of their weight; output
biases are not per head and stay whole.  Head counts come from the attention
module's own attributes (``num_heads``, ``num_key_value_heads``, ``head_dim``,
...) and then from ``model.config`` (``num_attention_heads``,
``num_key_value_heads``, ``head_dim``).  A tensor of an attention module that
no rule decides raises :class:`~gradforensics.errors.HeadSplitError` naming it,
its module class and the explicit spec to pass instead (``str()``: the Python
form; ``.cli``: the ``--heads`` form the ``capture`` command prints).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gradforensics.errors import HeadSplitError, SpecError
from gradforensics.recording.heads import cli_fix, parse_head_spec, python_fix
from gradforensics.store.heads import HeadSpec

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ATTENTION_LEAVES", "Counts", "auto_spec", "check_split", "counts_for", "glob_for",
           "out_axis", "resolve_heads", "text_config"]


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
    heads = _int_attr(objs, ("num_heads", "num_attention_heads", "n_heads", "n_head", "nheads"))
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
    out = ["*", *out[1:]] if len(out) > 2 else out
    return ".".join(p for i, p in enumerate(out) if not (p == "*" and i and out[i - 1] == "*"))


def _undecided(name: str, why: str, module: Any = None, fix: dict[str, Any] | None = None,
               glob: str | None = None) -> HeadSplitError:
    """The one-line refusal of a split, with its fix in Python form (``str()``) and CLI form (``.cli``)."""
    g = glob or glob_for(name)
    cls = type(module).__name__ if module is not None else "?"
    head = f"heads cannot split {name} ({cls}): {why}; pass "
    fused = name.rsplit(".", 2)[-2] in _FUSED_LEAVES if "." in name else False
    py = (f"{python_fix(g, fix)} (the right layout) or " if fix else
          f"heads={{{g!r}: {{'heads': H, 'axis': A, " + ("'fused': 'qkv'" if fused else "'role': R")
          + "}, 'auto': True} or ")
    cl = (f"{cli_fix(g, fix)} (the right layout) or " if fix else
          f"--heads auto '{g}=H:axis=A," + ("fused=qkv" if fused else "role=R") + "' or ")
    return HeadSplitError(head + py + f"{python_fix(g, None)} to store it whole.",
                          head + cl + f"{cli_fix(g, None)} to store it whole.")


_FUSED_LEAVES = frozenset({"c_attn", "qkv_proj", "qkv", "wqkv", "Wqkv", "query_key_value", "in_proj"})
#: Leaves of a q, k, v or fused q|k|v projection: with a head count, they make a module attention.
_QKV_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "q_attn", "query_key_value", "qkv",
                         "wqkv", "Wqkv", "wq", "wk", "wv"})
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "nheads", "num_kv_heads", "n_kv_heads")


def _is_attention(module: nn.Module, name: str) -> bool:
    """An attention module: named so (class or attribute name), or with a head count and a q/k/v projection.

    A module with an ``in_proj`` but neither (a Mamba block, a gated MLP) is not
    attention: its tensors are stored whole, without a word.
    """
    cls = type(module).__name__.lower()
    leaf = name.rsplit(".", 1)[-1].lower()
    if "attention" in cls or "attn" in cls or leaf in ("attn", "attention", "self_attn", "self_attention"):
        return True
    has_count = _int_attr((module,), _HEAD_ATTRS) is not None
    return has_count and any(n in _QKV_LEAVES for n, _ in module.named_children())


def _need(value: int | None, what: str, name: str, module: Any) -> int:
    if value is None:
        raise _undecided(name, f"the model has no {what} (no config, no attribute on the attention module)", module)
    return value


def _model_type(model: nn.Module) -> str:
    return str(getattr(text_config(model), "model_type", "") or "")


def out_axis(owner: nn.Module) -> int | None:
    """The axis of *owner*'s ``weight`` that is its output: by module type, else by a probe (``None``: unknown).

    ``nn.Linear`` ``(out, in)``: 0; transformers' ``Conv1D`` ``(in, out)``: 1; any other
    module whose forward is ``x @ W.T (+ b)`` or ``x @ W (+ b)`` on a random probe: 0 or 1.
    """
    from torch import nn as tnn

    if isinstance(owner, tnn.Linear):
        return 0
    if type(owner).__name__ == "Conv1D":
        return 1
    return _probe_out_axis(owner)


def _fix(spec: HeadSpec) -> dict[str, Any]:
    """The explicit form of *spec* (for a refusal's fix)."""
    out: dict[str, Any] = {"heads": spec.parts[0][1] if spec.parts else spec.heads, "axis": spec.axis}
    if spec.parts:
        out["fused"] = "".join(f"{r}{n}" for r, n in spec.parts)
    elif spec.fused > 1:
        out["fused"] = "qkv" if spec.fused == 3 else spec.fused
    if spec.interleaved:
        out["interleaved"] = True
    if spec.role and not spec.parts and not (spec.fused == 3 and spec.role == "qkv"):
        out["role"] = spec.role
    return out


def _fused_qkv(name: str, c: Counts, width: int, axis: int, owner: nn.Module) -> HeadSpec:
    """A fused q|k|v of width ``H d + 2 KV d``: roles q, k, v with their own head counts."""
    h = _need(c.heads, "num_attention_heads", name, owner)
    kv = c.kv_heads or h
    d = c.head_dim
    if d is None and kv == h and width % (3 * h) == 0:
        d = width // (3 * h)            # q | k | v of equal widths: the one layout H heads each allow
    if d is None:
        raise _undecided(name, f"the head size is unknown (no head_dim, no hidden size) for {h} q and {kv} k/v heads",
                         owner)
    if width != (h + 2 * kv) * d:
        raise _undecided(name, f"its output width {width} is not (H + 2 KV) d = ({h} + 2*{kv})*{d} of the "
                               "model's head counts", owner)
    return HeadSpec.of_parts((("q", h), ("k", kv), ("v", kv)), axis)


def _rule(name: str, leaf: str, param: str, owner: nn.Module, attn: nn.Module, model: nn.Module,
          shape: tuple[int, ...]) -> HeadSpec | None:
    """The spec for parameter *param* of leaf module *owner* inside attention *attn*."""
    c = counts_for(attn, model)
    bias = param == "bias" or len(shape) == 1
    out_ax: int | None = 0 if bias else out_axis(owner)
    o_leaf = leaf in ("o_proj", "out_proj", "dense", "wo", "o", "c_proj", "proj")
    if out_ax is None:
        if leaf in ATTENTION_LEAVES or o_leaf:
            raise _undecided(name, "it is neither nn.Linear nor Conv1D, and a probe input does not show which "
                                   "weight axis is its output", owner)
        return None
    width = shape[out_ax]
    if leaf in ("q_proj", "query", "wq", "q"):
        return HeadSpec(_need(c.heads, "num_attention_heads", name, owner), out_ax, "q")
    if leaf in ("k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v"):
        role = "k" if leaf in ("k_proj", "key", "wk", "k") else "v"
        return HeadSpec(_need(c.kv_heads or c.heads, "num_key_value_heads", name, owner), out_ax, role)
    if o_leaf:
        if bias:
            return None
        return HeadSpec(_need(c.heads, "num_attention_heads", name, owner), 1 - out_ax, "o")
    if leaf == "c_attn":
        if hasattr(attn, "q_attn"):        # GPT-2 cross-attention: c_attn holds k|v
            kv = _need(c.heads, "num_attention_heads", name, owner)
            return HeadSpec.of_parts((("k", kv), ("v", kv)), out_ax, "kv")
        return _fused_qkv(name, c, width, out_ax, owner)
    if leaf == "q_attn":
        return HeadSpec(_need(c.heads, "num_attention_heads", name, owner), out_ax, "q")
    if leaf == "query_key_value":
        kind = _model_type(model) or type(attn).__name__.lower()
        if not any(t in kind.replace("-", "_") for t in (*_INTERLEAVED_QKV_TYPES, "neox")):
            raise _undecided(name, f"fused query_key_value of model type {kind!r} has no known layout", owner)
        return HeadSpec(_need(c.heads, "num_attention_heads", name, owner), out_ax, "qkv", fused=3, interleaved=True)
    if leaf in ("qkv_proj", "qkv", "wqkv", "Wqkv"):
        return _fused_qkv(name, c, width, out_ax, owner)
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


def _bert_output_spec(name: str, parent_name: str, model: nn.Module, owner: nn.Module) -> HeadSpec | None:
    """BERT-style ``attention.output.dense``: Linear ``(out, H d)``; the sibling ``attention.self`` has the counts."""
    attn = model.get_submodule(parent_name.rpartition(".")[0])
    inner = getattr(attn, "self", attn)
    ax = out_axis(owner)
    if ax is None:
        raise _undecided(name, "it is neither nn.Linear nor Conv1D", owner)
    return HeadSpec(_need(counts_for(inner, model).heads, "num_attention_heads", name, owner), 1 - ax, "o")


def auto_spec(model: nn.Module, name: str, shape: tuple[int, ...] | int) -> HeadSpec | None:
    """The automatic head spec of parameter *name* of *model* (``None``: not per head)."""
    from torch import nn as tnn

    if isinstance(shape, int):           # the number of axes only (older callers): the rank decides
        shape = tuple(model.get_parameter(name).shape)
    owner_name, _, param = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(owner, tnn.MultiheadAttention):
        return _mha_rule(name, param, owner)
    parent_name, _, leaf = owner_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, tnn.MultiheadAttention):
        return _mha_rule(name, param, parent)
    if leaf == "dense" and parent_name.endswith("attention.output") and len(shape) >= 2:
        return _bert_output_spec(name, parent_name, model, owner)
    if not _is_attention(parent, parent_name):
        return None          # not attention (a Mamba in_proj, an MLP): stored whole
    spec = _rule(name, leaf, param, owner, parent, model, shape)
    if spec is None and len(shape) >= 2 and leaf in ATTENTION_LEAVES:
        raise _undecided(name, f"no rule for the projection {leaf!r} of {type(parent).__name__}", owner)
    return spec


# ------------------------------------------------------------------ the probe check
def _tolerance(w: Any) -> float:
    import torch

    if w.dtype == torch.float64:
        return 1e-10
    if w.dtype == torch.float32 and not (w.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        return 1e-5
    return 5e-3                       # bf16 / fp16 / TF32 matmuls: a wrong split is off by O(1) anyway


def _probe(owner: nn.Module, width: int) -> tuple[Any, Any] | None:
    """``(x, f(x) - f(0))`` for a seeded random probe ``x`` of *width* features, hooks bypassed; None if it fails."""
    import torch

    w: Any = owner.weight
    gen = torch.Generator().manual_seed(12345)
    x = torch.randn(3, width, generator=gen, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
    try:
        with torch.no_grad():
            y = owner.forward(x) - owner.forward(torch.zeros_like(x))
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1]:
        return None
    return x, y


def _close(got: Any, want: Any, tol: float) -> bool:
    scale = float(want.abs().max()) or 1.0
    return float((got.double() - want).abs().max()) <= tol * scale


def _probe_out_axis(owner: nn.Module) -> int | None:
    w = getattr(owner, "weight", None)
    if w is None or getattr(w, "ndim", 0) != 2 or w.device.type == "meta":
        return None
    w64 = w.detach().double()
    for ax in (0, 1):
        probe = _probe(owner, w.shape[1 - ax])
        if probe is None:
            continue
        x, y = probe
        want = x.double() @ (w64.T if ax == 0 else w64)
        if y.shape[-1] == want.shape[-1] and _close(y, want, _tolerance(w)):
            return ax
    return None


def check_split(name: str, owner: nn.Module, spec: HeadSpec) -> str | None:
    """Check *spec* on *owner*'s weight against *owner*'s own output on a random probe.

    For a q/k/v (fused) split: head *h*'s block of the weight applied to the probe
    equals head *h*'s slice of the module's output; for an output projection
    (role o, the input axis): the probe restricted to head *h*'s inputs gives the
    module output of that head's block.  Returns what is wrong, ``None`` if the split
    holds; raises :class:`HeadSplitError` for a module whose output axis no probe shows.
    """
    import torch

    w: Any = owner.weight
    ax = _probe_out_axis(owner)
    if ax is None:
        raise _undecided(name, "a probe input does not show which axis of its weight is the output "
                               "(its forward is not x @ W.T or x @ W)", owner)
    split_ax = spec.axis % 2
    kind = "o" if spec.role == "o" else ("q" if spec.role else ("q" if split_ax == ax else "o"))
    want_ax = ax if kind == "q" else 1 - ax
    if split_ax != want_ax:
        side = "output" if kind == "q" else "input"
        return (f"role {spec.role or kind} splits the {side} axis, which is axis {want_ax} of this weight "
                f"{tuple(w.shape)}, not axis {split_ax}")
    tol = _tolerance(w)
    w64 = w.detach().double()
    n = w.shape[split_ax]
    pos = replace(spec, axis=0).split(
        torch.arange(n).numpy())                                   # (H_total, d): the positions of each head
    blocks = [w64.index_select(split_ax, torch.as_tensor(p, device=w.device)) for p in pos]
    probe = _probe(owner, w.shape[1 - ax])
    if probe is None:
        return None
    x, y = probe
    for h, (p, blk) in enumerate(zip(pos, blocks)):
        idx = torch.as_tensor(p, device=w.device)
        if kind == "q":            # head h's rows (Linear) / columns (Conv1D) give head h's output slice
            want = x.double() @ (blk.T if ax == 0 else blk)
            got = y.index_select(-1, idx)
        else:                      # head h's input slice through head h's block
            xh = torch.zeros_like(x)
            xh[:, idx] = x[:, idx]
            with torch.no_grad():
                got = owner.forward(xh) - owner.forward(torch.zeros_like(x))
            want = x.double().index_select(-1, idx) @ (blk.T if ax == 0 else blk)
        if not _close(got, want, tol):
            return f"head {spec.labels()[h]} of the split does not give the module's own output on a probe"
    return None


def _checked(model: nn.Module, name: str, spec: HeadSpec, glob: str | None) -> None:
    """Run :func:`check_split` where *name* is the ``weight`` of a leaf module (refuse in one line if it fails).

    An ``nn.Linear`` / ``Conv1D`` whose forward cannot take a plain probe (a
    sharded or meta weight) keeps the layout of its type; an explicit spec of any
    other module no probe can read is taken at the user's word.
    """
    from torch import nn as tnn

    owner = _owner(model, name) if model is not None else None     # an import without a model: no module
    param = name.rpartition(".")[2]
    w = getattr(owner, "weight", None)
    if owner is None or param != "weight" or isinstance(owner, tnn.MultiheadAttention) or w is None \
            or getattr(w, "ndim", 0) != 2 or w.device.type == "meta" or any(True for _ in owner.children()):
        return
    known = isinstance(owner, tnn.Linear) or type(owner).__name__ == "Conv1D"
    if known and _probe(owner, w.shape[1 - (out_axis(owner) or 0)]) is None:
        return
    try:
        problem = check_split(name, owner, spec)
    except HeadSplitError:
        if glob is None or known:
            raise
        return
    if problem:
        fixed = None
        ax = out_axis(owner)
        if spec.role in ("q", "k", "v", "qkv", "kv", "o") and ax is not None:
            right = ax if spec.role != "o" else 1 - ax
            if right != spec.axis % 2:
                fixed = _fix(replace(spec, axis=right))
        raise _undecided(name, problem, owner, fixed, glob)


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
            spec = auto_spec(model, name, shape)
            if spec is not None:
                _fits(model, name, shape, spec)
                _check_head_dim(model, name, shape, spec)
        else:
            spec = None
        if spec is not None:
            _fits(model, name, shape, spec, glob)
            if len(shape) == 2:
                _checked(model, name, spec, glob)
            out[name] = spec
    unused = [g for g in explicit if g not in used]
    if unused:
        raise SpecError(f"heads: glob {unused[0]!r} matches none of the recorded tensors "
                        f"(e.g. {', '.join(list(shapes)[:3])}).")
    return out


def _owner(model: nn.Module, name: str) -> Any:
    owner_name = name.rpartition(".")[0]
    try:
        return model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        return None


def _fits(model: nn.Module, name: str, shape: tuple[int, ...], spec: HeadSpec, glob: str | None = None) -> None:
    """The split axis exists and divides into the heads (one-line refusal, Python and CLI forms)."""
    if not -len(shape) <= spec.axis < len(shape):
        raise _undecided(name, f"axis {spec.axis} is out of range for shape {shape}", _owner(model, name), None, glob)
    n = shape[spec.axis]
    if n % spec.total:
        raise _undecided(name, f"axis {spec.axis} of {shape} has {n} entries, not divisible by {spec.total} heads",
                         _owner(model, name), None, glob)


def _check_head_dim(model: nn.Module, name: str, shape: tuple[int, ...], spec: HeadSpec) -> None:
    """Cross-check a head count against the config's head size, where both are known."""
    cfg = text_config(model)
    d = getattr(cfg, "head_dim", None)
    if not isinstance(d, int) or d <= 0:
        return
    got = shape[spec.axis] // spec.total
    if got != d:
        raise _undecided(name, f"{spec.total} heads on axis {spec.axis} of {shape} give head size {got} where the "
                               f"model config says head_dim={d}", _owner(model, name))
