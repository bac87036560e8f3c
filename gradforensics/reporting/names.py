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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gradforensics.store.names import split_layer

__all__ = ["Loc", "head_cell", "heads_phrase", "int_ranges", "join_and", "location", "module_rank", "parse",
           "short_module", "table_units"]

_GENERIC = {"act_fn", "act", "activation", "activation_fn", "weight", "bias", "fn"}


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
    """``self_attn.q_proj.weight`` -> ``q_proj``; ``mlp.act_fn`` -> ``mlp.act_fn``."""
    parts = rest.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    if len(parts) > 1 and parts[-1] in _GENERIC:
        return ".".join(parts[-2:])
    return parts[-1]


#: Reading order of common module names (attention, then MLP); others sort after, alphabetically.
_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "c_attn", "query_key_value", "query", "key", "value",
          "dense", "c_proj", "gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "down_proj", "w2", "fc2", "mlp.act_fn")


def module_rank(module: str) -> tuple[int, str]:
    return (_ORDER.index(module), "") if module in _ORDER else (len(_ORDER), module)


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


def heads_phrase(heads: Iterable[int | None]) -> str:
    """``[2, 5]`` -> ``heads 2 and 5``; ``[0, 1, 2]`` -> ``heads 0–2``; no heads -> ``""``."""
    hs = sorted({int(h) for h in heads if h is not None})
    if not hs:
        return ""
    ranges = int_ranges(hs)
    word = "head" if len(hs) == 1 else "heads"
    return f"{word} {join_and(ranges)}"


def _modules_phrase(pattern: tuple[tuple[str, frozenset[int]], ...]) -> str:
    """``q_proj/k_proj, heads 2 and 5`` when the modules share their heads, else
    ``q_proj (heads 0–2), v_proj, o_proj``."""
    head_sets = {hs for _, hs in pattern}
    if len(head_sets) == 1:
        (hs,) = head_sets
        mods = "/".join(m for m, _ in pattern)
        return f"{mods}, {heads_phrase(hs)}" if hs else mods
    return ", ".join(f"{m} ({heads_phrase(hs)})" if hs else m for m, hs in pattern)


def location(units: Iterable[tuple[str, int | None]]) -> str:
    """One phrase naming every ``(tensor, head)`` unit, adjacent layers merged.

    Layers with the same modules (and heads) merge (``5–6``); modules that share
    their heads read ``model.layers.5–6 q_proj/k_proj, heads 2 and 5``, others
    ``model.layers.0 q_proj (heads 0–2), v_proj``.  Different layer patterns are
    joined with ``"; "``; names outside a layer stack are listed whole.
    """
    heads_of: dict[str, set[int]] = {}
    for name, head in units:
        seen = heads_of.setdefault(name, set())
        if head is not None:
            seen.add(int(head))
    by_layer: dict[tuple[str, int], dict[str, frozenset[int]]] = {}
    others: list[str] = []
    for name, head_set in heads_of.items():
        loc = parse(name)
        if loc.prefix is None or loc.layer is None:
            others.append(name + (f", {heads_phrase(head_set)}" if head_set else ""))
            continue
        items = by_layer.setdefault((loc.prefix, loc.layer), {})
        items[loc.module] = items.get(loc.module, frozenset()) | frozenset(head_set)
    by_pattern: dict[tuple[str, tuple[tuple[str, frozenset[int]], ...]], set[int]] = {}
    for (prefix, layer), items in by_layer.items():
        key = (prefix, tuple(sorted(items.items(), key=lambda kv: module_rank(kv[0]))))
        by_pattern.setdefault(key, set()).add(layer)
    parts = []
    for (prefix, pattern), layers in sorted(by_pattern.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
        parts.append(f"{prefix}.{', '.join(int_ranges(layers))} {_modules_phrase(pattern)}")
    return "; ".join(parts + others)
