"""Tensor names -> layer depth, short module names, and merged locations.

``model.layers.5.self_attn.q_proj.weight`` is layer 5 of ``model.layers``,
module ``q_proj``.  A group of flags on layers 5 and 6, ``q_proj`` and
``k_proj``, heads 2 and 5 reads ``model.layers.5–6 q_proj/k_proj, heads 2 and 5``.
The first integer path component is taken as the layer index
(:func:`gradforensics.store.names.split_layer`, the rule the analyses' ``layer``
column uses too), which covers LLaMA/Qwen (``model.layers.N``), GPT-2
(``transformer.h.N``), BERT/NeoX (``encoder.layer.N``, ``gpt_neox.layers.N``), T5
(``encoder.block.N``), CLIP (``resblocks.N``) and ``blocks.N`` models.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gradforensics.store.names import split_layer

__all__ = ["Loc", "experts_units", "head_cell", "head_text", "heads_phrase", "int_ranges", "join_and", "location",
           "module_rank", "parse", "short_module", "split_word", "table_units", "unique_modules"]

_GENERIC = {"act_fn", "act", "activation", "activation_fn", "weight", "bias", "fn"}
#: Leaves that several sub-layers of one block share (GPT-2/nanoGPT ``attn.c_proj`` and ``mlp.c_proj``,
#: BERT's ``attention.output.dense``, ``intermediate.dense`` and ``output.dense``, NeoX's ``attention.dense``):
#: named with their parent, so a short name alone never leaves the reader guessing which one.
_SHARED_LEAVES = {"c_proj", "dense", "proj", "out_proj", "fc", "linear", "norm", "ln", "layer_norm", "LayerNorm"}
#: Parents too vague to tell shared leaves apart (BERT's ``attention.output.dense`` vs ``output.dense``).
_VAGUE_PARENTS = {"output", "self", "inner"}


@dataclass(frozen=True)
class Loc:
    """Where a finding is: ``prefix.layer.module`` (layer ``None`` outside the stack)."""

    full: str
    prefix: str | None
    layer: int | None
    module: str


def parse(name: str) -> Loc:
    """Split a tensor / module / series name into prefix, layer index and short module."""
    parts = split_layer(name)
    if parts is None:
        return Loc(name, None, None, short_module(name))
    prefix, layer, rest = parts
    if not rest:                  # the block itself (``model.layers.3``): a layer, but named whole
        return Loc(name, None, layer, short_module(name))
    return Loc(name, prefix, layer, short_module(rest))


def short_module(rest: str) -> str:
    """``self_attn.q_proj.weight`` -> ``q_proj``; ``mlp.act_fn`` -> ``mlp.act_fn``; ``mlp.c_proj.weight`` ->
    ``mlp.c_proj`` (a leaf several sub-layers share keeps its parent)."""
    parts = rest.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    if len(parts) > 1 and (parts[-1] in _GENERIC or parts[-1] in _SHARED_LEAVES):
        keep = 3 if len(parts) > 2 and parts[-2] in _VAGUE_PARENTS else 2
        return ".".join(parts[-keep:])
    return parts[-1]


def _core(rest: str) -> str:
    """*rest* without a trailing ``weight`` / ``bias`` (the module's path)."""
    head, _, last = rest.rpartition(".")
    return head if head and last in ("weight", "bias") else rest


def _forms(core: str) -> list[str]:
    """Names of the module path *core* from shortest to whole: :func:`short_module`, then longer dotted suffixes."""
    parts = core.split(".")
    out = [short_module(core)]
    for k in range(2, len(parts) + 1):
        form = ".".join(parts[-k:])
        if len(form) > len(out[-1]):
            out.append(form)
    return out


def unique_modules(rests: Iterable[str]) -> dict[str, str]:
    """A short name for each module path (``attn.c_proj.weight``), distinct for distinct paths.

    Each starts as :func:`short_module`; names of different modules that clash grow by one
    dotted part at a time (``c_attn`` -> ``attn.c_attn``) until none does; a weight and a bias
    of one module, both present, keep their last part (``c_attn.weight``, ``c_attn.bias``).
    """
    rests = list(dict.fromkeys(rests))
    forms = {c: _forms(c) for c in dict.fromkeys(map(_core, rests))}
    at = dict.fromkeys(forms, 0)
    while True:
        by_name: dict[str, list[str]] = {}
        for c, i in at.items():
            by_name.setdefault(forms[c][i], []).append(c)
        clashes = [cs for cs in by_name.values() if len(cs) > 1]
        if not clashes:
            break
        for cs in clashes:             # distinct paths: the whole paths differ, so this ends
            for c in cs:
                at[c] = min(at[c] + 1, len(forms[c]) - 1)
    n_of = {c: sum(_core(r) == c for r in rests) for c in forms}
    return {r: forms[_core(r)][at[_core(r)]] + (r[len(_core(r)):] if n_of[_core(r)] > 1 else "") for r in rests}


#: Reading order of common module names (attention, then MLP); others sort after, alphabetically.
_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "c_attn", "attn.c_proj", "query_key_value", "query", "key",
          "value", "attention.dense", "attention.output.dense", "dense", "c_proj", "gate_proj", "up_proj", "w1", "w3",
          "c_fc", "mlp.c_proj", "intermediate.dense", "output.dense", "fc1", "down_proj", "w2", "fc2", "mlp.act_fn")


def module_rank(module: str) -> tuple[int, str, str]:
    """Sort key: :data:`_ORDER` first (a module's weight before its bias), others alphabetically after."""
    base = _core(module)
    last = "1" if module.endswith(".bias") else "0" if module.endswith(".weight") else module
    return (_ORDER.index(base), "", last) if base in _ORDER else (len(_ORDER), base, last)


def head_cell(h: Any) -> int | None:
    """A stored table's ``head`` cell as a head index; None for a whole tensor or anything that is not one."""
    import pandas as pd

    if h is None or pd.isna(h) or not math.isfinite(h) or h < 0 or h != int(h):
        return None
    return int(h)


def table_units(table: Any) -> list[tuple[str, int | None]]:
    """The ``(tensor, head)`` of every row of an analysis table (none without a ``tensor`` column)."""
    if table is None or "tensor" not in getattr(table, "columns", ()):
        return []
    import pandas as pd

    heads = pd.to_numeric(table["head"], errors="coerce") if "head" in table.columns else [None] * len(table)
    return [(str(t), head_cell(h)) for t, h in zip(table["tensor"], heads)]


def int_ranges(values: Iterable[int]) -> list[str]:
    """``[1, 3, 4, 5]`` -> ``["1", "3–5"]`` (adjacent integers merged, en dash)."""
    vals = sorted(set(int(v) for v in values))
    out: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}–{vals[j]}")
        i = j + 1
    return out


def join_and(items: Sequence[str]) -> str:
    """``["a"]`` -> ``a``; ``["a", "b"]`` -> ``a and b``; ``["a", "b", "c"]`` -> ``a, b and c``."""
    items = list(items)
    if not items:
        return ""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def experts_units(flags: Iterable[Any]) -> set[str]:
    """The tensors of *flags* whose ``head`` is an expert (a flag on one carries ``evidence["expert"]``)."""
    return {f.tensor for f in flags if "expert" in (f.evidence or {})}


def head_text(tensor: str, head: Any, experts: Collection[str]) -> int | str | None:
    """A ``head`` table cell as the report shows it: ``expert 3`` on a mixture-of-experts unit (*experts*), else
    the head's index (None for a whole tensor)."""
    h = head_cell(head)
    if h is None:
        return None
    return f"expert {h}" if tensor in experts else h


def split_word(units: Iterable[tuple[str, int | None]], experts: Collection[str]) -> str:
    """What the split units of *units* (those with a head) are: ``heads``, ``experts`` or ``heads or experts``."""
    kinds = {t in experts for t, h in units if h is not None}
    return "heads or experts" if len(kinds) > 1 else "experts" if kinds == {True} else "heads"


def heads_phrase(heads: Iterable[int | None], word: str = "head") -> str:
    """``[2, 5]`` -> ``heads 2 and 5``; ``[0, 1, 2]`` -> ``heads 0–2``; no heads -> ``""``.
    *word* ``"expert"``: ``experts 2 and 5`` (the experts of a mixture-of-experts unit)."""
    hs = sorted({int(h) for h in heads if h is not None})
    if not hs:
        return ""
    ranges = int_ranges(hs)
    return f"{word if len(hs) == 1 else word + 's'} {join_and(ranges)}"


def _modules_phrase(pattern: tuple[tuple[str, frozenset[int]], ...], experts: Collection[str] = ()) -> str:
    """``q_proj/k_proj, heads 2 and 5`` when the modules share their heads, else
    ``q_proj (heads 0–2), v_proj, o_proj``; the modules in *experts* count experts."""
    def phrase(m: str, hs: frozenset[int]) -> str:
        return heads_phrase(hs, "expert" if m in experts else "head")

    head_sets = {hs for _, hs in pattern}
    if len(head_sets) == 1 and len({m in experts for m, _ in pattern}) == 1:
        (hs,) = head_sets
        mods = "/".join(m for m, _ in pattern)
        return f"{mods}, {phrase(pattern[0][0], hs)}" if hs else mods
    return ", ".join(f"{m} ({phrase(m, hs)})" if hs else m for m, hs in pattern)


def location(units: Iterable[tuple[str, int | None]], experts: Collection[str] = ()) -> str:
    """One phrase naming every ``(tensor, head)`` unit, adjacent layers merged.

    Layers with the same modules (and heads) merge (``5–6``); modules that share
    their heads read ``model.layers.5–6 q_proj/k_proj, heads 2 and 5``, others
    ``model.layers.0 q_proj (heads 0–2), v_proj``.  Different layer patterns are
    joined with ``"; "``; names outside a layer stack are listed whole.  The tensors in
    *experts* are mixture-of-experts units: their "heads" read ``expert 3``.
    """
    heads_of: dict[str, set[int]] = {}
    for name, head in units:
        seen = heads_of.setdefault(name, set())
        if head is not None:
            seen.add(int(head))
    by_layer: dict[tuple[str, int], dict[str, frozenset[int]]] = {}
    others: list[str] = []
    placed: list[tuple[str, int, str, set[int]]] = []
    expert_rests: set[str] = set()
    for name, head_set in heads_of.items():
        split = split_layer(name)
        if split is None or not split[2]:
            others.append(name + (f", {heads_phrase(head_set, 'expert' if name in experts else 'head')}"
                                  if head_set else ""))
            continue
        placed.append((split[0], split[1], split[2], head_set))
        if name in experts:
            expert_rests.add(split[2])
    short = unique_modules(rest for _, _, rest, _ in placed)     # distinct modules never share a name
    expert_modules = {short[rest] for rest in expert_rests}
    for prefix, layer, rest, head_set in placed:
        items = by_layer.setdefault((prefix, layer), {})
        module = short[rest]
        items[module] = items.get(module, frozenset()) | frozenset(head_set)
    by_pattern: dict[tuple[str, tuple[tuple[str, frozenset[int]], ...]], set[int]] = {}
    for (prefix, layer), items in by_layer.items():
        key = (prefix, tuple(sorted(items.items(), key=lambda kv: module_rank(kv[0]))))
        by_pattern.setdefault(key, set()).add(layer)
    parts = []
    for (prefix, pattern), layers in sorted(by_pattern.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
        parts.append(f"{prefix}.{', '.join(int_ranges(layers))} {_modules_phrase(pattern, expert_modules)}")
    return "; ".join(parts + others)
