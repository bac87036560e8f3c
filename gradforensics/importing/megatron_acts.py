"""Megatron-LM's ``activations/`` dumps (``--save-activations-interval N``) as activation statistics.

The dump, as NVIDIA/Megatron-LM writes it (commit ``d98e8a64``, August 2026:
``megatron/training/activation_logging.py`` ``ActivationLogger``, called from ``train_step`` in
``megatron/training/training.py`` when ``(iteration + 1) % save_activations_interval == 0``)::

    <save>/activations/iter_<iteration + 1:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth

written by ``save_grads`` (``megatron/training/checkpointing.py``) exactly as the ``dgrads`` dump: one
file per rank of expert-data-parallel rank 0, ``{"model_chunk<i>": {key: value}}``.  A forward hook
on every linear layer, norm and router (``LINEAR_TYPES``: ``ColumnParallelLinear``,
``RowParallelLinear``, the Transformer Engine linears, ``TENorm``, ``Router``, the grouped linears)
stores ``<module>/input<k>`` and ``<module>/output<k>`` (``detach().cpu()``) and each keyword
argument ``<module>/<name>`` as given (``None``, a list: ``TEGroupedLinear``'s ``m_splits`` as
``input1``) - of the **last micro-batch** (each micro-batch overwrites the keys).

What the import makes of it: per saved iteration one record, and per floating activation of two
or more axes the statistics capture computes for a module's output (``acts/<module>/<stat>``,
:data:`gradforensics.store.schema.ACT_FIELDS`), by capture's own functions
(:func:`gradforensics.recording.actstats.make_range` from the first record,
:func:`~gradforensics.recording.actstats.act_stats` every record), the units on the last axis
(Megatron's activations are ``[sequence, batch, features]``; a router's ``[tokens, experts]``).
With ``gated_mlp`` (SwiGLU) a ``linear_fc1`` output is joined
half by half, ``[gate | up]`` as in the unsharded model (by :func:`merge`, as the activation gradients).  ``<module>/output0`` is stored as ``<module>`` (the module's output, as capture names it), every
other key as ``<module>.<key>`` (``decoder.layers.0.mlp.linear_fc2.input0``: the MLP's activation
function output).  Non-tensor entries are call arguments, not activations: not read.

Joined across ranks by :func:`gradforensics.importing.megatron.merge` with the layout of the
activation gradients (the same tensors): a column-parallel layer's output and a row-parallel
layer's input along the last axis, every other activation the same bits on each tensor-parallel
rank (checked) - or, under sequence parallelism, split along the sequence axis (axis 0).  A grouped
experts module's tensors (``experts.linear_fc1/output0``: every local expert's tokens, one expert's
rows after another's, on features that are a different neuron in each expert) are cut by expert
with the module's ``input1`` (``m_splits``, the tokens of each local expert) and named as
``SequentialMLP``'s per-expert modules (``experts.local_experts.<j>.linear_fc1``), which are per
expert already; both are imported under the global expert number (:func:`merge`).  Without a
fitting ``input1`` they are left out and named.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import ImportSourceError, ShardMismatchError
from gradforensics.importing.megatron import (
    MegatronSpec,
    dense_note,
    iterations,
    merge,
    partition_axis,
    read_chunks,
    shards,
    stage_layers,
)
from gradforensics.importing.megatron_moe import grouped_per_token
from gradforensics.importing.megatron_routing import RouterLoads, joined_routing
from gradforensics.recording.actstats import ActRange, act_stats, make_range
from gradforensics.store.names import check_name
from gradforensics.store.schema import ACT_FIELDS, act_path
from gradforensics.store.writer import Row

if TYPE_CHECKING:
    import torch

    from gradforensics.runlog import RunLog

__all__ = ["JOINED", "UNIT_AXIS_FROM", "ActivationStats", "JoinedActivations", "RecordExtras", "act_module",
           "dump_stages", "import_activations", "joined_activations", "load_activations", "record_extras"]

UNIT_AXIS_FROM = "last axis (Megatron-LM's [sequence, batch, features] activations)"
_KEY = re.compile(r"^(.+)/((?:input|output)\d+)$")
_GATED = re.compile(r"(?:^|\.)linear_fc1/")
_GROUPED_WHY = ("a grouped experts module's activations without its tokens per expert (input1, m_splits: a list of "
                "counts summing to its rows) to split them by expert")


def act_module(name: str) -> str:
    """The store's module name of dump key *name*: ``<module>/output0`` -> ``<module>``, else ``<module>.<key>``."""
    m = _KEY.match(name)
    module = m.group(1) if m is not None and m.group(2) == "output0" else name.replace("/", ".")
    return check_name(module, "activations module")


def load_activations(path: Path, splits: dict[tuple[Path, str], Any] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """``{chunk: {key: tensor}}`` of one rank file, without the non-tensor call arguments the hook also saves;
    a grouped experts module's tokens per expert (its ``input1``) go to *splits* under ``(path, module key)``."""
    import torch

    out: dict[int, dict[str, torch.Tensor]] = {}
    for chunk, sd in read_chunks(path, "activation").items():
        out[chunk] = {n: v for n, v in sd.items() if isinstance(n, str) and isinstance(v, torch.Tensor)}
        if splits is not None:
            for n in grouped_per_token(out[chunk]):
                splits[(path, n)] = sd.get(n.rpartition("/")[0] + "/input1")
    return out


def _split_by_expert(sd: dict[str, torch.Tensor], name: str, counts: Any) -> bool:
    """Replace a grouped experts module's per-token tensor *name* in *sd* by one per local expert, named as
    ``SequentialMLP``'s (``<...>.experts.local_experts.<j>.linear_fc1/output0``), its rows cut by *counts*
    (``TEGroupedLinear``'s ``m_splits``: the tokens of each local expert, in order).  False (and *name* dropped)
    when *counts* does not fit."""
    import torch

    t = sd.pop(name)
    if isinstance(counts, torch.Tensor) and not counts.is_floating_point() and counts.ndim == 1:
        counts = counts.tolist()
    if (not isinstance(counts, (list, tuple)) or not counts
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            or sum(counts) != t.shape[0]):
        return False
    module, _, key = name.rpartition("/")
    head, _, leaf = module.rpartition(".")
    for j, part in enumerate(torch.split(t, list(counts), dim=0)):
        sd[f"{head}.local_experts.{j}.{leaf}/{key}"] = part
    return True


def dump_stages(d: Path, spec: MegatronSpec) -> dict[int, tuple[int, frozenset[int]]] | None:
    """The pipeline stages of iteration directory *d* (:func:`.megatron.stage_layers`: each stage's first global
    layer and its stage-local expert layers), for ``tokens_per_expert/`` under pipeline parallelism; ``None``
    without it (or without a layout)."""
    lay = spec.layout
    if lay is None or lay.pp == 1 or lay.vp > 1:
        return None
    return stage_layers({s: load_activations(s.path) for s in shards(d, lay) if s.tp == 0 and s.ep == 0})


class ActivationStats:
    """Per saved iteration, the ``acts/<module>/<stat>`` rows of an ``activations/iter_*`` directory.

    The range (thresholds, histogram edges) of each module is fixed at the first iteration read, as
    capture fixes it at a module's first record.
    """

    def __init__(self, spec: MegatronSpec, *, tensors: Sequence[str] | None = None,
                 sequence_parallel: bool | None = None) -> None:
        sp = bool(getattr(spec.layout, "sp", False)) if sequence_parallel is None else sequence_parallel
        self.spec, self.sp, self.globs = spec, sp, list(tensors or [])
        self.names: list[str] = []                  # dump keys (global), in order, fixed at the first iteration
        self.ranges: dict[str, ActRange] = {}
        self.left_out: dict[str, str] = {}
        self.like: Path | None = None

    def merged(self, d: Path) -> dict[str, torch.Tensor]:
        """Iteration directory *d* joined over the ranks (grouped experts modules' tensors cut by expert first)."""
        grid = shards(d, self.spec.layout)
        if self.like is not None:
            want = {s.path.name for s in shards(self.like, self.spec.layout)}
            got = {s.path.name for s in grid}
            if want != got:
                lost = sorted(want ^ got)[0]
                raise ShardMismatchError(f"{d}: {lost} is in one of {d.name}, {self.like.name} only; every saved "
                                         "iteration is written by the same ranks.")
        loaded = {}
        counts: dict[tuple[Path, str], Any] = {}
        for s in grid:
            chunks = load_activations(s.path, counts)
            for sd in chunks.values():
                for n in grouped_per_token(sd):
                    if not _split_by_expert(sd, n, counts.get((s.path, n))):
                        self.left_out.setdefault(n, _GROUPED_WHY)
                for n in [n for n, t in sd.items() if not t.is_floating_point() or t.ndim < 2]:
                    del sd[n]           # a routing map, token ids, a bias: no activation statistics to take
            loaded[s] = chunks
        spec = self.spec
        if self.sp:       # sequence parallel: what the name rules call replicated is split along the sequence
            keys = {re.sub(r"\.\d+\.", ".*.", n) for c in loaded.values() for sd in c.values() for n in sd}
            splits: dict[str, int | None] = {k: 0 for k in sorted(keys) if partition_axis(k) is None}
            spec = dataclasses.replace(spec, tp_splits={**spec.tp_splits, **splits})
        return merge(loaded, spec, d)        # a gated linear_fc1 output joined half by half there

    def rows(self, d: Path) -> dict[str, Row]:
        """The statistics rows of iteration directory *d*."""
        merged = self.merged(d)
        if self.like is None:
            self.like = d
            self._choose(merged, d)
        out: dict[str, Row] = {}
        for name in self.names:
            t = merged.get(name)
            if t is None:
                raise ShardMismatchError(f"{d}: activation {name} is missing; iteration {self.like.name} has it.")
            a = t.detach().float().numpy()
            a = a.reshape(-1, a.shape[-1])
            rng = self.ranges.get(name)
            if rng is None:
                rng = self.ranges[name] = dataclasses.replace(make_range(a), unit_axis=t.ndim - 1, units=a.shape[-1],
                                                              unit_axis_from=UNIT_AXIS_FROM)
            elif a.shape[-1] != rng.units:
                raise ImportSourceError(f"{d}: activation {name} has {a.shape[-1]} units on its last axis; it had "
                                        f"{rng.units} at {self.like.name}.")
            stats = act_stats(a, rng)
            module = act_module(name)
            out.update({act_path(module, k): Row(stats[k], rng.attrs() if k == "hist" else {}) for k in ACT_FIELDS})
        return out

    def _choose(self, merged: Mapping[str, torch.Tensor], d: Path) -> None:
        floating = list(merged)
        if self.globs:
            unused = [g for g in self.globs if not any(fnmatch.fnmatchcase(n, g) for n in [*floating, *self.left_out])]
            if unused:
                raise ImportSourceError(f"--tensors: glob {unused[0]!r} matches no activation of {d} "
                                        f"(e.g. {', '.join(floating[:3])}).")
            floating = [n for n in floating if any(fnmatch.fnmatchcase(n, g) for g in self.globs)]
            self.left_out = {n: w for n, w in self.left_out.items()
                             if any(fnmatch.fnmatchcase(n, g) for g in self.globs)}
        if not floating:
            first = next(iter(self.left_out.items()), None)
            raise ImportSourceError(f"{d}: no floating activation of two or more axes to import"
                                    + (f"; {first[0]} is left out: {first[1]}." if first else "."))
        modules: dict[str, str] = {}
        for n in floating:
            other = modules.setdefault(act_module(n), n)
            if other != n:
                raise ImportSourceError(f"{d}: activations {other} and {n} take one store name {act_module(n)}.")
        self.names = floating


def _notice(say: Any, left_out: Mapping[str, str]) -> None:
    if left_out and say is not None:
        names = sorted(left_out)
        print(f"import: {len(names)} activation(s) not imported ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
              f"): {left_out[names[0]]}; see extra['import']['not_imported'].", file=say)


def _layout(spec: MegatronSpec) -> Any:
    return dataclasses.asdict(spec.layout) if spec.layout is not None else "from the file names"


def import_activations(source: Path, out: Any, spec: MegatronSpec, *, tensors: Sequence[str] | None,
                       writer_options: Mapping[str, Any], logs: RunLog | None = None,
                       top_k: int | None = None) -> int:
    """Every ``activations/iter_*`` under *source* as a record of activation statistics (and, with *top_k*, the
    router loads of ``tokens_per_expert/``: :func:`.megatron_routing.joined_routing`); returns the records."""
    from gradforensics.importing.logjoin import LogJoin
    from gradforensics.importing.records import ImportWriter

    iters = iterations(source, "activations")
    stats = ActivationStats(spec, tensors=tensors)
    first_it, first_dir = next(iter(iters.items()))
    first_rows = stats.rows(first_dir)
    routing = joined_routing(source, spec.layout, list(iters), top_k, quiet=bool(writer_options.get("quiet", True)),
                             stages=dump_stages(first_dir, spec), tp_pp_dp=_tp_pp_dp(spec))
    extras = RecordExtras(None, routing)
    first_rows.update(extras.rows(first_it))
    dense = dense_note(["activations"], len({s.ep for s in shards(first_dir, spec.layout)}))
    extra = {"import": {"format": "megatron", "source": str(source), "kind": "activations", "dense": dense,
                        "iterations": list(iters), "layout": _layout(spec), "sequence_parallel": stats.sp,
                        "activations": JOINED, "router": extras.notes["router"],
                        "not_imported": dict(stats.left_out)}}
    join = LogJoin(logs, gradients=False)
    per_record = {"acts": sum(r.data.nbytes for r in first_rows.values())}
    with ImportWriter(out, heads={}, total=len(iters), per_record=per_record, framework="megatron",
                      model_info={"class": "megatron", "n_params": 0}, extra=extra, logged=join.logged,
                      **writer_options) as w:
        _notice(w.say, stats.left_out)
        for it, d in iters.items():
            rows = first_rows if it == first_it else {**stats.rows(d), **extras.rows(it)}
            iv, _ = join.record(it, d.stat().st_mtime, {})
            w.record(iv, {}, (), rows)
        w.annotate(not_imported=dict(stats.left_out), **(join.summary() if join.logged else {}))
    return len(iters)


#: ``extra["import"]["activations"]`` of a store that holds them
JOINED = "statistics of the last micro-batch's activations of each saved iteration (acts/<module>/<stat>)"


class JoinedActivations:
    """The activation statistics of a ``wgrads`` / ``dgrads`` / ``params`` import's records: called with a record's
    iteration, the rows of ``activations/iter_<it>`` (none when :attr:`note` says they are not joined)."""

    def __init__(self, spec: MegatronSpec, dirs: Mapping[int, Path], note: str = JOINED) -> None:
        self.stats, self.dirs, self.note = ActivationStats(spec), dict(dirs), note

    def __call__(self, it: int) -> dict[str, Row]:
        return self.stats.rows(self.dirs[it]) if self.note == JOINED else {}

    @property
    def left_out(self) -> dict[str, str]:
        return dict(self.stats.left_out)


def joined_activations(source: Path, spec: MegatronSpec, *, quiet: bool = True) -> JoinedActivations | None:
    """The ``activations/`` dump beside a ``wgrads`` / ``dgrads`` / ``params`` one (None when there is none).  Joined
    when it was saved at every iteration of that dump (every record needs the same arrays); else its
    :attr:`~JoinedActivations.note` says why, also on stderr unless *quiet*."""
    import sys

    if spec.kind == "activations" or not (source / "activations").is_dir() or not (source / spec.kind).is_dir():
        return None
    found = iterations(source, "activations")
    lost = [s for s in iterations(source, spec.kind) if s not in found]
    if not lost:
        return JoinedActivations(spec, found)
    note = (f"not joined: activations/ has no iter_{lost[0]:07d} (saved at {', '.join(map(str, list(found)[:4]))}"
            f"{', ...' if len(found) > 4 else ''}); import them alone with --kind activations")
    if not quiet:
        print(f"import: activations {note}.", file=sys.stderr)
    return JoinedActivations(spec, found, note)


class RecordExtras:
    """The rows a ``wgrads`` / ``dgrads`` / ``params`` import's records get beside their tensors: the activation
    statistics (:func:`joined_activations`) and the router loads (:func:`.megatron_routing.joined_routing`)."""

    def __init__(self, acts: JoinedActivations | None, routing: RouterLoads | str | None) -> None:
        self.acts, self.routing = acts, routing

    def rows(self, it: int) -> dict[str, Row]:
        out = self.acts(it) if self.acts is not None else {}
        if isinstance(self.routing, RouterLoads):
            out.update(self.routing(it))
        return out

    @property
    def notes(self) -> dict[str, str]:
        """``extra["import"]`` entries: what became of ``activations/`` and ``tokens_per_expert/``."""
        routing = self.routing.note if isinstance(self.routing, RouterLoads) else self.routing
        return {"activations": self.acts.note if self.acts is not None else "none in the dump",
                "router": routing or "none in the dump"}

    @property
    def joined(self) -> list[str]:
        """The dumps whose rows the records get: ``["activations"]`` when they are joined, else none."""
        return ["activations"] if self.acts is not None and self.acts.note == JOINED else []

    @property
    def left_out(self) -> dict[str, str]:
        """The activations left out, as ``"activation <dump key>"`` (beside the gradient dump's own names)."""
        return {f"activation {n}": why for n, why in self.acts.left_out.items()} if self.acts is not None else {}


def _tp_pp_dp(spec: MegatronSpec) -> bool | None:
    return spec.run_args.tp_pp_dp if spec.run_args is not None else None


def record_extras(source: Path, *, top_k: int | None = None,
                  quiet: bool = True) -> Callable[[MegatronSpec, Sequence[int]], RecordExtras]:
    """For :func:`gradforensics.importing.megatron.import_megatron`'s ``extra_rows``: the activations and router
    loads beside the dump in *source*, made once the spec and the records' iterations are known (*top_k*: the
    router's k; default the resolved spec's ``moe_topk``, given or from the run's saved arguments)."""

    def make(spec: MegatronSpec, steps: Sequence[int]) -> RecordExtras:
        k = top_k if top_k is not None else spec.moe_topk
        first = next(iter(iterations(source, spec.kind).values()))
        return RecordExtras(joined_activations(source, spec, quiet=quiet),
                            joined_routing(source, spec.layout, steps, k, quiet=quiet,
                                           stages=dump_stages(first, spec), tp_pp_dp=_tp_pp_dp(spec)))

    return make
