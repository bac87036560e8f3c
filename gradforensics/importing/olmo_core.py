"""OLMo-core's gradient dumps as a store: one record per dumped step, its gradients as OLMo-core saved them.

Layout (``GAPMonitorCallback(dump_gradients=True)``, ``_dump_gradients`` in
``olmo_core/train/callbacks/gap_monitor.py``): ``<save folder>/gradients/step<N>/`` holds

* ``full_gradients/``: a DCP (OLMo-core's ``save_state_dict``, its own storage writer) of
  ``{parameter name: p.grad}``, flat, read by :mod:`gradforensics.importing.dcp` (chunks of
  sharded gradients joined, nothing of its ``.metadata`` run); or
* ``sampled_gradients/`` (``dump_gradients_save_first_n=N``): one ``<parameter name>.safetensors``
  per parameter holding ``{"gradient": g[:N, :N, ...]}``, the leading ``N`` entries of every axis.
  These are stored as the partial tensors they are: each such gradient array carries
  ``partial=True`` and ``partial_region`` (``[[0, n0], [0, n1], ...]``: the rows and columns of
  the full gradient it holds); the full shape is not in the dump.

The dump runs in ``pre_optim_step``: the gradients are before clipping and before the step.
Steps are ``step<N>``; every step must hold the same kind of dump and the imported tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, ImportSourceError
from gradforensics.importing.dcp import is_dcp, read_dcp
from gradforensics.importing.records import ImportWriter

if TYPE_CHECKING:
    import torch

    from gradforensics.runlog import RunLog

__all__ = ["FULL", "SAMPLED", "dump_steps", "import_olmo_core", "is_gradient_dump"]

FULL = "full_gradients"
SAMPLED = "sampled_gradients"
_STEP = re.compile(r"^step(\d+)$")


def _root(source: Path) -> Path:
    return source / "gradients" if (source / "gradients").is_dir() else source


def _kind(d: Path) -> str | None:
    if is_dcp(d / FULL):
        return FULL
    if (d / SAMPLED).is_dir():
        return SAMPLED
    return None


def is_gradient_dump(source: Path) -> bool:
    """Whether *source* is an OLMo-core save folder with ``gradients/step<N>/`` dumps (or that ``gradients/``)."""
    root = _root(source)
    return root.is_dir() and any(_STEP.match(p.name) and _kind(p) for p in root.iterdir() if p.is_dir())


def dump_steps(source: Path) -> tuple[dict[int, Path], str]:
    """``({step: step directory}, "full_gradients" | "sampled_gradients")``, by step (one-line errors)."""
    root = _root(source)
    if not root.is_dir():
        raise ImportSourceError(f"{source}: not a directory; --format olmo-core reads an OLMo-core save folder "
                                "holding gradients/step<N>/full_gradients/ or sampled_gradients/.")
    steps = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))}
    kinds = {s: _kind(p) for s, p in steps.items()}
    empty = [p for s, p in steps.items() if kinds[s] is None]
    if empty:
        raise ImportSourceError(f"{empty[0]}: holds neither full_gradients/ (a DCP with .metadata) nor "
                                "sampled_gradients/; an OLMo-core gradient dump holds one of them.")
    if not steps:
        raise ImportSourceError(f"{root}: no step<N>/ gradient dump (GAPMonitorCallback(dump_gradients=True)).")
    found = {k for k in kinds.values() if k}
    if len(found) > 1:
        full = next(s for s, k in kinds.items() if k == FULL)
        part = next(s for s, k in kinds.items() if k == SAMPLED)
        raise ImportSourceError(f"{root}: step {full} holds full gradients and step {part} sampled ones; a store "
                                "holds one shape per tensor, import them apart (copy one kind's steps aside).")
    return dict(sorted(steps.items())), found.pop()   # type: ignore[return-value]


def _load(d: Path, kind: str) -> dict[str, torch.Tensor]:
    """The gradients of one step directory, by parameter name."""
    if kind == FULL:
        return read_dcp(d / FULL)[0]
    from gradforensics.replay.untrusted import read_state_dict

    out = {}
    for f in sorted((d / SAMPLED).iterdir()):
        if f.suffix != ".safetensors" or not f.is_file():
            continue
        sd = read_state_dict(f)
        if set(sd) != {"gradient"}:
            raise CheckpointError(f"{f}: holds {sorted(sd)[:3]}; an OLMo-core sampled gradient holds one tensor "
                                  "named 'gradient'.")
        out[f.name[:-len(".safetensors")]] = sd["gradient"]
    if not out:
        raise CheckpointError(f"{d / SAMPLED}: no <parameter>.safetensors file.")
    return out


def import_olmo_core(source: Path, out: Any, *, tensors: Sequence[str] | None, heads: Any,
                     writer_options: Mapping[str, Any], logs: RunLog | None = None) -> int:
    """Import every dumped step under *source* into *out* (one record each); returns the records written.

    Sampled (partial) gradients are never split into heads (they hold no whole head) and never
    checked against a logged gradient norm (they are not the whole gradient).
    """
    from gradforensics.importing.checkpoints import select
    from gradforensics.importing.heads import resolve
    from gradforensics.importing.logjoin import LogJoin

    steps, kind = dump_steps(source)
    first_step, first_dir = next(iter(steps.items()))
    first = _load(first_dir, kind)
    names = select(first, tensors, first_dir / kind)
    sampled = kind == SAMPLED
    specs = {} if sampled else resolve({n: tuple(first[n].shape) for n in names}, heads, None)
    attrs = {n: {"partial": True, "partial_region": [[0, int(s)] for s in first[n].shape]} for n in names} \
        if sampled else {}
    extra = {"import": {"format": "olmo-core", "source": str(source), "kind": kind, "steps": list(steps),
                        "pre_clip": True}}
    info = {"class": "olmo-core", "n_params": int(sum(first[n].numel() for n in names))}
    per_record = {"grads": sum(first[n].numel() * min(first[n].element_size(), 4) for n in names)}
    join = LogJoin(logs, gradients=not sampled)
    with ImportWriter(out, heads=specs, total=len(steps), per_record=per_record, framework="olmo-core",
                      model_info=info, extra=extra, logged=join.logged, grad_attrs=attrs, **writer_options) as w:
        for step, d in steps.items():
            grads = first if step == first_step else _load(d, kind)
            for n in names:
                if n not in grads:
                    raise ImportSourceError(f"{d / kind}: gradient {n} is missing; step {first_step} has it.")
                if tuple(grads[n].shape) != tuple(first[n].shape):
                    raise ImportSourceError(f"{d / kind}: gradient {n} has shape {tuple(grads[n].shape)}; step "
                                            f"{first_step} holds {tuple(first[n].shape)}.")
            iv, record = join.record(step, d.stat().st_mtime, {n: grads[n] for n in names}, grads)
            w.record(iv, record)
        if join.logged:
            w.annotate(**join.summary())
    return len(steps)
