"""Megatron-LM mixture-of-experts dumps: experts as ``(E, ...)`` units, per-token tensors whose shape varies.

**Experts as units.**  After :func:`gradforensics.importing.megatron.merge` has numbered every
expert globally (``ep_rank * num_local_experts + j``), the E experts' same-named tensors of one
layer are stacked, in expert order, into one ``(E, ...)`` unit, stored ``grads/<unit>`` ``(N, E, ...)``
with the attribute ``experts = E`` exactly as capture stores fused experts
(:mod:`gradforensics.recording.experts`).  Both of Megatron-LM's expert layouts
(``megatron/core/transformer/moe/experts.py``) give the same unit name:

* ``SequentialMLP``: ``<layer>.mlp.experts.local_experts.<j>.linear_fc1.weight`` ->
  ``<layer>.mlp.experts.linear_fc1.weight``;
* ``TEGroupedMLP`` (grouped GEMM): ``<layer>.mlp.experts.linear_fc1.weight<j>`` ->
  ``<layer>.mlp.experts.linear_fc1.weight``.

Only parameters (``wgrads``, ``params``) of two or more axes (weights) are stacked: an expert's
activation gradient has one row per token routed to it, a different count for each expert; an
expert's bias stays its own 1-D tensor (not imported by default, as every 1-D tensor).

**Shapes that change between iterations.**  The tokens routed to each expert differ every
iteration, so the activation gradients of the experts' layers (``dgrads``' ``...experts.linear_fc1/
output0``, ``...local_experts.<j>.linear_fc2/input0``) change shape from one saved iteration to the
next, and a store array has one shape.  :func:`varying_shapes` finds every such tensor before the
first record is written; the import leaves exactly those out and names them (``extra["import"]
["not_imported"]`` and one line on stderr); the rest is imported.  A grouped experts module's
per-token tensors are also left out under expert parallelism: each expert rank's file holds its own
experts' tokens under the one name, so no rank's copy is the module's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gradforensics.errors import ImportSourceError, ShardMismatchError
from gradforensics.recording.experts import stack_units
from gradforensics.store.names import check_name

if TYPE_CHECKING:
    from pathlib import Path

    import torch

__all__ = ["VARYING", "expert_units", "grouped_per_token", "keep", "left_out_moe", "stack_experts", "varying_shapes"]

_LOCAL = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.([^/]*)$")
_GROUPED = re.compile(r"^(.*\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_GROUPED_MODULE = re.compile(r"^(?:.*\.)?experts\.linear_fc[12]/")

#: why a varying tensor is left out (stored in ``extra["import"]["not_imported"]``)
VARYING = "its shape changes between saved iterations ({shapes}): per-token tensors of routed tokens"


def expert_units(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """``{unit: member names in expert order}`` of the globally numbered expert parameters among *names*.

    Every expert 0..E-1 must be present (a gap is a lost shard: one line).
    """
    groups: dict[str, dict[int, str]] = {}
    for n in names:
        if (m := _LOCAL.match(n)) is not None:
            unit, j = m.group(1) + m.group(3), int(m.group(2))
        elif (m := _GROUPED.match(n)) is not None:
            unit, j = m.group(1), int(m.group(2))
        else:
            continue
        groups.setdefault(unit, {})[j] = n
    out: dict[str, tuple[str, ...]] = {}
    for unit, by in sorted(groups.items()):
        lost = sorted(set(range(max(by) + 1)) - set(by))
        if lost:
            raise ShardMismatchError(f"{unit}: expert {lost[0]} is missing (experts {sorted(by)[:6]} are present); "
                                     "the experts of one layer are numbered 0..E-1 across the expert ranks.")
        out[check_name(unit, "experts unit")] = tuple(by[j] for j in range(len(by)))
    return out


def stack_experts(merged: dict[str, torch.Tensor],
                  listed: Mapping[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """*merged* with each unit's experts replaced by their stack ``(E, ...)`` (``stack_units``, capture's)."""
    for unit, members in listed.items():
        if unit in merged:
            raise ShardMismatchError(f"{unit}: the dump holds a tensor of this name and its experts "
                                     f"{members[0]}..; the experts unit cannot take its name.")
        shapes = {tuple(merged[m].shape) for m in members if m in merged}
        if len(shapes) > 1:
            raise ShardMismatchError(f"{unit}: its experts have different shapes {sorted(shapes)[:2]}; the experts "
                                     "of one layer are the same shape.")
    return stack_units(merged, listed)


def grouped_per_token(names: Iterable[str]) -> list[str]:
    """The per-token tensors (``<module>/input<k>``, ``<module>/output<k>``) of grouped experts modules."""
    return [n for n in names if _GROUPED_MODULE.search(n)]


def varying_shapes(dirs: Mapping[int, Path], load: Callable[[Path], Mapping[str, Any]],
                   first: Mapping[str, Any]) -> dict[str, str]:
    """``{name: reason}`` of the tensors of *first* (the first iteration, merged) whose shape differs in another
    iteration of *dirs* (each merged by *load*; one iteration at a time, its tensors dropped after)."""
    shapes = {n: [tuple(t.shape)] for n, t in first.items()}
    for d in list(dirs.values())[1:]:
        merged = load(d)
        for n, seen in shapes.items():
            if n in merged and tuple(merged[n].shape) not in seen:
                seen.append(tuple(merged[n].shape))
        del merged
    return {n: VARYING.format(shapes=", ".join(map(str, seen[:3])) + (", ..." if len(seen) > 3 else ""))
            for n, seen in shapes.items() if len(seen) > 1}


def left_out_moe(kind: str, dirs: Mapping[int, Path], load: Callable[[Path], Mapping[str, Any]],
                 first: Mapping[str, Any], *, expert_ranks: int) -> dict[str, str]:
    """``{name: reason}`` of the per-token tensors a ``dgrads`` (or ``activations``) import leaves out: a grouped
    experts module's under expert parallelism, then every tensor whose shape varies (:func:`varying_shapes`)."""
    if kind not in ("dgrads", "activations"):
        return {}
    out = {n: (f"a grouped experts module's per-token tensor: each of the {expert_ranks} expert ranks holds its own "
               "experts' tokens under this name") for n in grouped_per_token(first)} if expert_ranks > 1 else {}
    rest = {n: t for n, t in first.items() if n not in out}
    return {**out, **varying_shapes(dirs, load, rest)}


def keep(names: list[str], left_out: Mapping[str, str], where: Path) -> list[str]:
    """*names* less the ones left out; when none is left, one line naming the first and why."""
    kept = [n for n in names if n not in left_out]
    if not kept:
        raise ImportSourceError(f"{where}: every tensor chosen is left out: {names[0]}: {left_out[names[0]]}.")
    return kept
