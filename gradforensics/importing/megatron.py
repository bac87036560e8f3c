"""Megatron-LM's gradient and parameter dumps as a store: one record per saved iteration.

The layout, as Megatron-LM writes it (``megatron/training/checkpointing.py``
``save_grads``; ``megatron/training/training.py`` ``_save_state_dict``)::

    <save>/<wgrads|dgrads|params>/iter_<iteration:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth

written by every rank of expert-data-parallel rank 0, the ``_<pp>`` part only when the
pipeline-parallel size is above 1 and the ``_<ep>`` part only when the expert-parallel size
is.  Each file is ``torch.save(dict)`` of ``{"model_chunk<i>": {parameter name: tensor}}``,
``i`` the virtual-pipeline chunk; ``wgrads`` holds each parameter's reduced ``main_grad``
(saved after the all-reduce, before the optimizer step), ``params`` its ``data`` after the
step, ``dgrads`` the activation gradients ``<module>/output<k>`` and ``<module>/input<k>``
of the last micro-batch.  The iteration in the name is 1-based.

Merging a saved iteration into the unsharded model (:func:`merge`):

* **tensor parallel**: column-parallel weights (``linear_qkv``, ``linear_fc1``, the vocab-
  parallel ``word_embeddings`` and ``output_layer``) are joined along axis 0, row-parallel
  ones (``linear_proj``, ``linear_fc2``) along axis 1; every other tensor is replicated and
  rank 0's copy is kept (its shape must agree on every rank).  A gated ``linear_fc1``
  (SwiGLU) holds its part of both halves on each rank: ``gated_mlp`` joins the halves apart.
* **pipeline parallel and virtual chunks**: ``decoder.layers.<i>`` in a chunk is local; chunks are
  ordered as Megatron places layers (virtual stage first, then pipeline rank) and each gets
  the count of decoder layers before it as its offset: the names carry global layer numbers.
  MTP layers (``mtp.layers.<i>``, last stage only) keep their own numbers.
* **expert parallel**: every expert rank writes the non-expert tensors too, and expert rank 0's copy of each
  tensor-parallel shard is kept.  For ``wgrads`` and ``params`` the copies are the same (the dense gradients are
  all-reduced over the data-parallel group, which spans the expert ranks; Megatron's ``save_grads`` says they
  are duplicated); for ``dgrads`` and ``activations`` they are not: each expert rank is another data-parallel
  replica of the dense layers and ran its own micro-batch, so the dense activation gradients and activations
  are expert rank 0's micro-batch (:data:`DENSE_EP0`, in ``extra["import"]["dense"]``).  Local experts
  (``experts.local_experts.<j>``, grouped ``experts.linear_fc1.weight<j>``) are renumbered
  globally, ``ep_rank * n_local + j``; the import then stacks them into ``(E, ...)`` experts units
  (:mod:`.megatron_moe`).
* **the layout** (:class:`Layout`, ``--layout``, or the run's saved arguments: :func:`resolve`,
  :mod:`.megatron_args`): the files present are checked against the ones its ranks write; with an expert
  tensor-parallel size below TP the files are a diagonal of the TP x EP grid and experts are joined over
  their ETP shards (:meth:`Layout.writers`); above TP is refused.  Without a layout, a dump holding
  experts is refused: its ETP cannot be read from the files.
* **sequence parallelism** (``sp``): ``dgrads`` of a column-parallel input and a row-parallel output
  are joined along the sequence axis; ``wgrads`` join as without it.
* **the padded vocabulary** (:func:`trim_vocab`): rows past the true vocabulary size are dropped.
* **fused QKV** (``linear_qkv``): its rows are ``[group][q heads of the group | k | v][d]``
  (``get_query_key_value_tensors``); with ``num_heads`` (and ``num_query_groups``) they are
  reordered to ``[q heads][k groups][v groups]`` and split into ``H + 2G`` heads (``q0..``,
  ``k0..``, ``v0..`` labels when ``G == H``); ``linear_proj`` is split by head along axis 1.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, ImportSourceError, MissingShardError, ShardMismatchError, SpecError
from gradforensics.importing.megatron_args import RunArgs, read_run_args
from gradforensics.importing.records import ImportWriter
from gradforensics.store.heads import HeadSpec
from gradforensics.store.names import check_name

if TYPE_CHECKING:
    import torch

    from gradforensics.runlog import RunLog

__all__ = ["COLUMN_PARALLEL", "DENSE_EP0", "KINDS", "ROW_PARALLEL", "Layout", "MegatronSpec", "Shard", "dense_note",
           "import_megatron", "iterations", "layer_offsets", "layout_axis", "load_shard", "merge", "parse_layout",
           "partition_axis", "qkv_heads", "read_chunks",
           "resolve", "save_dir", "shards", "stage_layers", "store_name", "trim_vocab"]


KINDS = ("wgrads", "dgrads", "params", "activations")
#: module leaves whose weight (and bias) are split along axis 0 across tensor-parallel ranks
COLUMN_PARALLEL = frozenset({"linear_qkv", "linear_fc1", "linear_q", "linear_kv", "linear_q_up_proj",
                             "linear_kv_up_proj", "word_embeddings", "output_layer"})
#: module leaves whose weight is split along axis 1 (their bias is replicated)
ROW_PARALLEL = frozenset({"linear_proj", "linear_fc2"})
_ITER = re.compile(r"^iter_(\d{7})$")
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?\.pth$")
_CHUNK = re.compile(r"^model_chunk(\d+)$")
_LAYER = re.compile(r"^((?:.*\.)?decoder\.layers\.)(\d+)(\..*)$")   # not mtp.layers.<i>: numbered apart
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_PARAM = re.compile(r"^(?:.*\.)?([A-Za-z_0-9]+)\.(weight|bias)\d*$")
_DGRAD = re.compile(r"^(?:.*\.)?([A-Za-z_0-9]+)/(input|output)\d+$")
#: a gated ``linear_fc1``'s weight / bias (split along axis 0) and output (activation gradients, activations: the
#: last axis): each tensor-parallel rank holds ``[its gate | its up]``
_GATED_FC1 = re.compile(r"(?:^|\.)linear_fc1(?:\.(?:weight|bias)\d*|/output\d+)$")


@dataclass(frozen=True)
class Layout:
    """The run's parallel sizes (``--layout tp=,pp=,ep=,etp=,vp=,sp=``); ``etp`` defaults to ``tp``, as in Megatron-LM.

    ``sp``: sequence parallelism (``None``: not said, taken as off).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vp: int = 1
    sp: bool | None = None

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "ep", "vp"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"--layout: {k} must be an integer >= 1; got {v!r}.")
        if self.etp is not None and (not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1):
            raise SpecError(f"--layout: etp must be an integer >= 1; got {self.etp!r}.")
        if self.sp not in (None, True, False):
            raise SpecError(f"--layout: sp must be 0 or 1; got {self.sp!r}.")

    @property
    def etp_size(self) -> int:
        return self.tp if self.etp is None else self.etp

    def writers(self) -> dict[tuple[int, int], int]:
        """``{(tp rank, ep rank): expert tp rank}`` of the ranks that write a file on one pipeline stage.

        ``save_grads`` writes on expert-data-parallel rank 0; with Megatron-LM's default order
        ``tp-cp-ep-dp-pp`` those are the stage's local ranks ``r < etp * ep``, whose tensor-parallel rank
        is ``r % tp``, expert rank ``(r // etp) % ep`` and expert tensor-parallel rank ``r % etp``
        (``megatron/core/parallel_state.py``, ``RankGenerator``).
        """
        tp, etp, ep = self.tp, self.etp_size, self.ep
        if etp > tp:
            raise SpecError(f"--layout etp={etp} tp={tp}: an expert tensor-parallel size above the tensor-parallel "
                            f"size is not supported: {etp // tp if etp % tp == 0 else etp} ranks write each "
                            "mp_rank_* file name and only the last one's expert shard survives on disk.")
        if etp * ep < tp:
            raise SpecError(f"--layout etp={etp} ep={ep} tp={tp}: only {etp * ep} of the {tp} tensor-parallel "
                            "ranks write a file (expert-data-parallel rank 0), so the other tensor-parallel "
                            "shards of the dense tensors were never saved; this dump cannot be joined.")
        return {(r % tp, (r // etp) % ep): r % etp for r in range(etp * ep)}

    def file_name(self, tp: int, pp: int, ep: int) -> str:
        name = f"mp_rank_{tp:02d}"
        if self.pp > 1:
            name += f"_{pp:03d}"
        if self.ep > 1:
            name += f"_{ep:03d}"
        return name + ".pth"


def parse_layout(text: str | Mapping[str, int] | Layout | None) -> Layout | None:
    """``"tp=2,pp=2,ep=2,etp=1,vp=1,sp=1"`` (or a mapping) as a :class:`Layout` (one-line SpecError when malformed)."""
    if text is None or isinstance(text, Layout):
        return text
    if isinstance(text, Mapping):
        items = dict(text)
    else:
        items = {}
        for part in str(text).split(","):
            key, sep, val = part.strip().partition("=")
            if not sep or not val.strip().isdigit():
                raise SpecError(f"--layout {text!r}: expected KEY=N entries (tp=, pp=, ep=, etp=, vp=, sp=); got "
                                f"{part!r}.")
            items[key.strip()] = int(val)
    unknown = sorted(set(items) - {"tp", "pp", "ep", "etp", "vp", "sp"})
    if unknown:
        raise SpecError(f"--layout: unknown size {unknown[0]!r}; known: tp, pp, ep, etp, vp, sp.")
    sp = items.pop("sp", None)
    if sp not in (None, 0, 1):
        raise SpecError(f"--layout: sp must be 0 or 1; got {sp!r}.")
    return Layout(**items, sp=None if sp is None else bool(sp))


@dataclass(frozen=True)
class MegatronSpec:
    """What to import from a Megatron-LM ``--save`` directory and how the model is laid out."""

    kind: str = "wgrads"
    num_heads: int | None = None
    num_query_groups: int | None = None
    gated_mlp: bool = False
    #: ``{glob: axis or None}``: how tensors matching a glob are laid out across tensor-parallel ranks,
    #: overriding the name rules (``None``: replicated); the first matching glob wins
    tp_splits: Mapping[str, int | None] = field(default_factory=dict)
    #: the run's parallel sizes; ``None``: read from the file names (a full TP x PP x EP grid, no experts)
    layout: Layout | None = None
    #: the true vocabulary size (``--vocab-size``): the padded rows of the embedding tensors are dropped
    vocab_size: int | None = None
    #: a checkpoint (or ``--save`` directory) holding the run's saved arguments (``--args-from``)
    args_from: str | None = None
    #: the run's ``--moe-router-topk`` (``--moe-topk``): reads ``tokens_per_expert/``; default: the saved arguments'
    moe_topk: int | None = None
    #: the run's saved arguments, once read (:func:`resolve`), and where they were looked for
    run_args: RunArgs | None = None
    args_note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(f"megatron: kind must be one of {KINDS}; got {self.kind!r}.")
        for glob, axis in self.tp_splits.items():
            if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
                raise SpecError(f"megatron: --tp-split {glob}: the axis must be an integer or none; got {axis!r}.")
        h, g = self.num_heads, self.num_query_groups
        if h is not None and h < 1:
            raise SpecError(f"megatron: num_heads must be >= 1; got {h}.")
        if g is not None and (h is None or g < 1 or h % g):
            raise SpecError(f"megatron: num_query_groups ({g}) needs num_heads and must divide it; got num_heads={h}.")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise SpecError(f"megatron: --vocab-size must be an integer >= 1; got {self.vocab_size!r}.")

    @property
    def groups(self) -> int | None:
        return self.num_query_groups or self.num_heads


@dataclass(frozen=True)
class Shard:
    """One rank's file of a saved iteration."""

    tp: int
    pp: int
    ep: int
    path: Path


#: ``extra["import"]["dense"]`` of a ``dgrads`` / ``activations`` import under expert parallelism
DENSE_EP0 = ("expert rank 0's micro-batch: under expert parallelism each expert rank is another data-parallel "
             "replica of the dense layers (other tokens); the dense {what} of the other expert ranks are not read "
             "(the experts' come from every expert rank)")


def dense_note(kinds: Sequence[str], expert_ranks: int) -> str | None:
    """What ``extra["import"]["dense"]`` says of the dense tensors of *kinds* read from *expert_ranks* expert
    ranks' files (``None``: one expert rank, or ``wgrads`` / ``params``, the same on every expert rank)."""
    what = [w for k, w in (("dgrads", "activation gradients"), ("activations", "activations")) if k in kinds]
    return DENSE_EP0.format(what=" and ".join(what)) if expert_ranks > 1 and what else None


# ------------------------------------------------------------------ the run's saved arguments
#: Megatron-LM's argument name of each --layout size
_ARG_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
              "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
              "vp": "virtual_pipeline_model_parallel_size", "sp": "sequence_parallel"}


def save_dir(source: Path, kind: str) -> Path:
    """The ``--save`` directory of *source* (``<save>`` or one of its dump directories)."""
    return source.parent if source.name in KINDS and not (source / kind).is_dir() else source


def resolve(spec: MegatronSpec, source: Path) -> MegatronSpec:
    """*spec* completed from the run's saved arguments (``--args-from``, else a checkpoint in the ``--save`` dir).

    What the arguments say fills what *spec* leaves open (the layout, heads, query groups, SwiGLU, the
    vocabulary, the router's top-k); what both say must agree, else a one-line :class:`SpecError` names the field.
    """
    args, where = read_run_args(save_dir(source, spec.kind), Path(spec.args_from) if spec.args_from else None)
    if args is None:
        return dataclasses.replace(spec, args_note=f"none found (looked for {where})")
    said: dict[str, int | bool] = {"tp": args.tp, "pp": args.pp, "ep": args.ep, "etp": args.etp, "vp": args.vp,
                                   "sp": args.sp}
    lay = spec.layout
    if lay is not None:
        given = {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "vp": lay.vp, "sp": lay.sp}
        for k, v in given.items():
            if v is not None and v != said[k]:
                raise SpecError(f"--layout {k}={int(v)} disagrees with the run's saved arguments: {_ARG_NAMES[k]}="
                                f"{said[k]!r} in {where}.")
    for flag, mine, theirs, name in (("--num-heads", spec.num_heads, args.num_heads, "num_attention_heads"),
                                     ("--num-query-groups", spec.num_query_groups, args.num_query_groups,
                                      "num_query_groups"),
                                     ("--vocab-size", spec.vocab_size, args.vocab_size, "vocab_size"),
                                     ("--moe-topk", spec.moe_topk, args.moe_topk, "moe_router_topk")):
        if mine is not None and theirs is not None and mine != theirs:
            raise SpecError(f"{flag} {mine} disagrees with the run's saved arguments: {name}={theirs} in {where}.")
    if spec.gated_mlp and not args.gated_mlp:
        raise SpecError(f"--gated-mlp disagrees with the run's saved arguments: swiglu=False in {where}.")
    if spec.kind == "dgrads" and args.cp > 1:
        raise SpecError(f"{where}: context_parallel_size={args.cp}: each rank that writes dgrads holds its own part "
                        "of the sequence, and only some of them write; a context-parallel dgrads dump is not "
                        "supported.")
    heads = spec.num_heads or args.num_heads
    return dataclasses.replace(
        spec, layout=Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vp=args.vp, sp=args.sp),
        num_heads=heads, num_query_groups=spec.num_query_groups or (args.num_query_groups if heads else None),
        gated_mlp=spec.gated_mlp or args.gated_mlp, vocab_size=spec.vocab_size or args.vocab_size, run_args=args,
        args_note=where, moe_topk=spec.moe_topk or args.moe_topk)


# ------------------------------------------------------------------ the files
def iterations(root: Path, kind: str) -> dict[int, Path]:
    """``{iteration: iter_XXXXXXX directory}`` of *kind* under *root* (``<save>`` or ``<save>/<kind>``)."""
    base = root / kind if (root / kind).is_dir() else root
    if not base.is_dir():
        raise ImportSourceError(f"{root}: not a directory; --format megatron reads Megatron-LM's --save directory "
                                f"(holding {'/, '.join(KINDS)}/).")
    found = {int(m.group(1)): p for p in sorted(base.iterdir()) if p.is_dir() and (m := _ITER.match(p.name))}
    if not found:
        raise ImportSourceError(f"{base}: no iter_<7 digits>/ directory of {kind} dumps (Megatron-LM writes them "
                                f"with --save-{kind}-interval N under --save).")
    return dict(sorted(found.items()))


def shards(d: Path, layout: Layout | None = None) -> list[Shard]:
    """The rank files of iteration directory *d*, a complete (tp, pp, ep) grid (:class:`MissingShardError`).

    With *layout*, the files must be exactly those its ranks write (:meth:`Layout.writers`).
    """
    parsed = [(m, p) for p in sorted(d.iterdir()) if (m := _RANK.match(p.name))]
    if not parsed:
        raise ImportSourceError(f"{d}: no mp_rank_<tp>[_<pp>][_<ep>].pth file in this iteration directory.")
    if layout is not None:
        return _against_layout(d, parsed, layout)
    widths = {sum(g is not None for g in m.groups()[1:]) for m, _ in parsed}
    if len(widths) > 1:
        raise ImportSourceError(f"{d}: rank files of different forms ({', '.join(p.name for _, p in parsed[:3])}); "
                                "one iteration is written by one parallel layout.")
    out = [Shard(int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0), p) for m, p in parsed]
    if widths == {1}:
        out = _one_suffix(out)
    return _complete(d, out, widths.pop())


def _against_layout(d: Path, parsed: list[tuple[re.Match[str], Path]], layout: Layout) -> list[Shard]:
    """The files of *d* checked against *layout*: the form of each name, then the set of (tp, pp, ep) ranks."""
    writers = layout.writers()
    want = {(t, p, e) for p in range(layout.pp) for (t, e) in writers}
    width = (layout.pp > 1) + (layout.ep > 1)
    got: dict[tuple[int, int, int], Path] = {}
    for m, path in parsed:
        suffixes = [int(g) for g in m.groups()[1:] if g is not None]
        if len(suffixes) != width:
            raise MissingShardError(
                f"{path}: the file name does not fit --layout {_layout_text(layout)} (its files are named like "
                f"{layout.file_name(0, 0, 0)}): the dump was written by another layout.")
        pp = suffixes[0] if layout.pp > 1 else 0
        ep = suffixes[-1] if layout.ep > 1 else 0
        got[(int(m.group(1)), pp, ep)] = path
    extra = sorted(set(got) - want)
    if extra:
        t, p, e = extra[0]
        what = ("tensor-parallel rank" if t >= layout.tp else "pipeline rank" if p >= layout.pp else
                "expert rank" if e >= layout.ep else "rank pair (tp, ep) that writes no file under this etp")
        raise MissingShardError(f"{got[extra[0]]}: not written by --layout {_layout_text(layout)} (its {what} is "
                                "outside it); the layout disagrees with the files present.")
    lost = sorted(want - set(got))
    if lost:
        raise MissingShardError(f"{d}: {layout.file_name(*lost[0])} is missing (--layout {_layout_text(layout)} "
                                f"writes {len(want)} files here, {len(got)} are present); every rank's file is "
                                "needed to join the shards.")
    return sorted((Shard(t, p, e, path) for (t, p, e), path in got.items()), key=lambda s: (s.pp, s.ep, s.tp))


def _layout_text(layout: Layout) -> str:
    sp = ",sp=1" if layout.sp else ""
    return f"tp={layout.tp},pp={layout.pp},ep={layout.ep},etp={layout.etp_size},vp={layout.vp}{sp}"


def _one_suffix(found: list[Shard]) -> list[Shard]:
    """``mp_rank_TT_XXX``: ``XXX`` is the pipeline rank, or the expert rank when the pipeline size is 1.

    The file names alone cannot tell; the contents can: pipeline stages hold different
    tensors (the embedding is on the first only), expert ranks the same names.
    """
    names = {s.pp: frozenset(_names(load_shard(s.path))) for s in found if s.tp == 0}
    if len(set(names.values())) == 1 and len(names) > 1:
        return [Shard(s.tp, 0, s.pp, s.path) for s in found]
    return found


def _names(chunks: Mapping[int, Mapping[str, Any]]) -> set[str]:
    return {f"{c}:{n}" for c, sd in chunks.items() for n in sd}


def _complete(d: Path, found: list[Shard], width: int) -> list[Shard]:
    tps = max(s.tp for s in found) + 1
    pps = max(s.pp for s in found) + 1
    eps = max(s.ep for s in found) + 1
    have = {(s.tp, s.pp, s.ep) for s in found}
    for t in range(tps):
        for p in range(pps):
            for e in range(eps):
                if (t, p, e) not in have:
                    raise MissingShardError(f"{d}: {_file_name(t, p, e, width, pps, eps)} is missing (the others "
                                            f"make a grid of TP {tps} x PP {pps} x EP {eps}); every rank's file is "
                                            "needed to join the shards (an expert tensor-parallel size below TP "
                                            "writes fewer: give --layout tp=,ep=,etp= or --args-from CHECKPOINT).")
    return sorted(found, key=lambda s: (s.pp, s.ep, s.tp))


def _file_name(t: int, p: int, e: int, width: int, pps: int, eps: int) -> str:
    name = f"mp_rank_{t:02d}"
    if width == 2 or (width == 1 and pps > 1):
        name += f"_{p:03d}"
    if width == 2 or (width == 1 and eps > 1):
        name += f"_{e:03d}"
    return name + ".pth"


def read_chunks(path: Path, what: str = "tensor") -> dict[int, Mapping[Any, Any]]:
    """``{chunk: {key: value}}`` of one rank file as saved, read with ``weights_only=True`` (one-line errors
    naming *what* a key maps to)."""
    from gradforensics.replay.untrusted import torch_load

    obj = torch_load(path, mmap=True)
    if not isinstance(obj, Mapping) or not obj:
        raise CheckpointError(f"{path}: expected Megatron's {{'model_chunk<i>': {{name: {what}}}}}; found "
                              f"{type(obj).__name__}.")
    out: dict[int, Mapping[Any, Any]] = {}
    for key, sd in obj.items():
        m = _CHUNK.match(key) if isinstance(key, str) else None
        if m is None or not isinstance(sd, Mapping):
            raise CheckpointError(f"{path}: entry {str(key)[:60]!r} is not model_chunk<i> -> {{name: {what}}}.")
        out[int(m.group(1))] = sd
    return out


def load_shard(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """``{chunk: {name: tensor}}`` of one rank file, read with ``weights_only=True`` (one-line errors)."""
    import torch

    out: dict[int, dict[str, torch.Tensor]] = {}
    for chunk, sd in read_chunks(path).items():
        bad = next((k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
        if bad is not None:
            raise CheckpointError(f"{path}: model_chunk{chunk}: entry {str(bad)[:60]!r} is not a tensor under a name.")
        out[chunk] = dict(sd)
    return out


# ------------------------------------------------------------------ merging one iteration
def merge(loaded: Mapping[Shard, Mapping[int, Mapping[str, torch.Tensor]]], spec: MegatronSpec,
          where: Path) -> dict[str, torch.Tensor]:
    """The unsharded ``{global name: tensor}`` of one iteration's rank files.

    Dense tensors are joined over the tensor-parallel ranks; expert tensors over the expert
    tensor-parallel ranks, which are the tensor-parallel ones unless ``spec.layout`` says
    ``etp`` differs (then each file's expert rank comes from :meth:`Layout.writers`).
    """
    lay = spec.layout
    tps = lay.tp if lay is not None else 1 + max(s.tp for s in loaded)
    etp_of = lay.writers() if lay is not None and lay.etp_size != lay.tp else None
    etps = lay.etp_size if lay is not None else tps
    if lay is not None:
        for shard, chunks in loaded.items():
            if len(chunks) != lay.vp:
                raise ShardMismatchError(f"{shard.path}: holds {len(chunks)} model chunk(s) "
                                         f"({', '.join(f'model_chunk{c}' for c in sorted(chunks))}); --layout vp="
                                         f"{lay.vp} says {lay.vp}: the layout disagrees with the files.")
    if lay is None:
        _no_expert_without_layout(loaded, spec, where)
    offsets = layer_offsets(loaded)
    per_name: dict[str, dict[int, tuple[torch.Tensor, Shard]]] = defaultdict(dict)
    sizes: dict[str, int] = {}
    for shard, chunks in loaded.items():
        n_local = _local_experts(chunks)
        for c, sd in chunks.items():
            for name, t in sd.items():
                g, expert = _global_name(name, offsets[(c, shard.pp)], shard.ep, n_local)
                slot = (etp_of[(shard.tp, shard.ep)] if etp_of is not None else shard.tp) if expert else shard.tp
                sizes[g] = etps if expert else tps
                seen = per_name[g].get(slot)
                if seen is not None:
                    if not expert and seen[1].pp == shard.pp and seen[1].ep != shard.ep:
                        if shard.ep < seen[1].ep:       # expert rank 0's copy of a dense tensor is the one kept
                            per_name[g][slot] = (t, shard)
                        continue
                    _same_on_two_stages(g, seen, (t, shard))
                    continue
                per_name[g][slot] = (t, shard)
    return {name: _join(name, ranks, sizes[name], spec, where) for name, ranks in per_name.items()}


def _no_expert_without_layout(loaded: Mapping[Shard, Mapping[int, Mapping[str, Any]]], spec: MegatronSpec,
                              where: Path) -> None:
    """Expert tensors need the expert tensor-parallel size, which neither the file names nor the values give.

    ETP above TP writes a full TP x EP grid of file names (each twice, one expert shard kept); ETP x EP below
    TP can write one too (``tp=4,etp=2,ep=1`` writes the files of ``tp=2``, half the dense shards unsaved); only
    ETP = TP is joined right from the names.
    """
    for chunks in loaded.values():
        for sd in chunks.values():
            name = next((n for n in sd if _LOCAL_EXPERT.match(n) or _GROUPED_EXPERT.match(n)), None)
            if name is not None:
                raise ImportSourceError(
                    f"{where}: holds expert tensors ({name}) and no layout is known: the expert tensor-parallel "
                    "size cannot be read from the files (above TP, two ranks write each file name and one expert "
                    "shard survives; with ETP x EP below TP some dense shards are never written). Pass --layout "
                    f"tp=,pp=,ep=,etp= or --args-from CHECKPOINT (the run's saved arguments: {spec.args_note}).")


def _same_on_two_stages(name: str, first: tuple[torch.Tensor, Shard], other: tuple[torch.Tensor, Shard]) -> None:
    """A global name met twice (two pipeline stages or chunks): one tensor kept only if both are the same bits."""
    (a, sa), (b, sb) = first, other
    if not _bit_equal(a, b):
        raise ShardMismatchError(f"{sb.path}: {name} is also in {sa.path.name} (pipeline rank {sa.pp}) with other "
                                 "values; two stages hold one name (a custom pipeline layout or MTP layers?) and "
                                 "neither copy can be chosen.")


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads included)."""
    import torch

    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))
    return bool(torch.equal(a, b))


def layer_offsets(loaded: Mapping[Shard, Mapping[int, Mapping[str, Any]]]) -> dict[tuple[int, int], int]:
    """``{(chunk, pp rank): global number of its first layer}``: chunks by (virtual stage, pipeline rank)."""
    counts: dict[tuple[int, int], int] = {}
    for shard, chunks in loaded.items():
        if shard.tp == 0 and shard.ep == 0:
            for c, sd in chunks.items():
                counts[(c, shard.pp)] = len({m.group(2) for n in sd if (m := _LAYER.match(n))})
    out, total = {}, 0
    for key in sorted(counts):
        out[key] = total
        total += counts[key]
    return out


_MOE_LAYER = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.mlp\.(?:router|experts)[./]")


def stage_layers(loaded: Mapping[Shard, Mapping[int, Mapping[str, Any]]]) -> dict[int, tuple[int, frozenset[int]]]:
    """``{pipeline rank: (global number of its first decoder layer, its stage-local layers with experts)}`` of one
    iteration's rank files, for a layout of one model chunk per rank (a layer has experts when the dump holds its
    router's or experts' tensors)."""
    offsets = layer_offsets(loaded)
    out: dict[int, tuple[int, frozenset[int]]] = {}
    for shard, chunks in loaded.items():
        if shard.tp == 0 and shard.ep == 0:
            moe = frozenset(int(m.group(1)) for sd in chunks.values() for n in sd if (m := _MOE_LAYER.match(n)))
            out[shard.pp] = (offsets.get((0, shard.pp), 0), moe)
    return out


def _local_experts(chunks: Mapping[int, Mapping[str, Any]]) -> int:
    idx = {m.group(2) for sd in chunks.values() for n in sd
           if (m := _LOCAL_EXPERT.match(n) or _GROUPED_EXPERT.match(n))}
    return len(idx)


def _global_name(name: str, offset: int, ep: int, n_local: int) -> tuple[str, bool]:
    """The name in the unsharded model, and whether it is an expert's tensor."""
    m = _LAYER.match(name)
    if m is not None:
        name = f"{m.group(1)}{offset + int(m.group(2))}{m.group(3)}"
    if (m := _LOCAL_EXPERT.match(name)) is not None:
        return f"{m.group(1)}{ep * n_local + int(m.group(2))}{m.group(3)}", True
    if (m := _GROUPED_EXPERT.match(name)) is not None:
        return f"{m.group(1)}{ep * n_local + int(m.group(2))}", True
    return name, False


def partition_axis(name: str) -> int | None:
    """The axis *name* is split along across tensor-parallel ranks, ``None`` when replicated."""
    if (m := _DGRAD.match(name)) is not None:           # activation gradients: the partitioned side
        leaf, side = m.groups()
        split = (leaf in COLUMN_PARALLEL and side == "output") or (leaf in ROW_PARALLEL and side == "input")
        return -1 if split else None
    m = _PARAM.match(name)
    if m is None:
        return None
    leaf, param = m.groups()
    if leaf in COLUMN_PARALLEL:
        return 0
    if leaf in ROW_PARALLEL and param == "weight":
        return 1
    return None


def layout_axis(name: str, spec: MegatronSpec) -> int | None:
    """The tensor-parallel axis of *name*: the first ``spec.tp_splits`` glob that matches, else the name rules."""
    for glob, axis in spec.tp_splits.items():
        if fnmatch.fnmatchcase(name, glob):
            return axis
    if _sp_split(name, spec):
        return 0
    return partition_axis(name)


def _sp_split(name: str, spec: MegatronSpec) -> bool:
    """Whether *name* is a dgrad split along the sequence by sequence parallelism (a column-parallel layer's input,
    a row-parallel layer's output: ``[s/tp, b, h]``)."""
    if spec.kind != "dgrads" or spec.layout is None or not spec.layout.sp or (m := _DGRAD.match(name)) is None:
        return False
    leaf, side = m.groups()
    return (leaf in COLUMN_PARALLEL and side == "input") or (leaf in ROW_PARALLEL and side == "output")


def _join(name: str, ranks: Mapping[int, tuple[torch.Tensor, Shard]], tps: int, spec: MegatronSpec,
          where: Path) -> torch.Tensor:
    """The unsharded tensor of one name, the layout checked against the ranks' values.

    A tensor the layout calls replicated must hold the same bits on every tensor-parallel rank
    (Megatron-LM all-reduces the gradients of replicated parameters across them): ranks that
    disagree mean it is split under a name the rules do not know, and the import stops naming
    it.  A tensor the layout calls split whose ranks all hold the same non-zero bits is in fact
    replicated (an expert tensor-parallel size below TP, say): the import stops too.
    """
    import torch

    missing = [t for t in range(tps) if t not in ranks]
    if missing:
        some = next(iter(ranks.values()))[1]
        raise ShardMismatchError(f"{where}: {name} is in {some.path.name} but not in the file of tensor-parallel "
                                 f"rank {missing[0]}; the rank files do not belong together.")
    parts = [ranks[t][0] for t in range(tps)]
    first = parts[0]
    for t, p in enumerate(parts):
        if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
            raise ShardMismatchError(f"{ranks[t][1].path}: {name} has shape {tuple(p.shape)} {p.dtype}; tensor-"
                                     f"parallel rank 0 holds {tuple(first.shape)} {first.dtype} (Megatron splits "
                                     "evenly: every rank's shard has one shape).")
    axis = layout_axis(name, spec)
    if tps == 1:
        return first
    if axis is None:
        differ = [t for t in range(1, tps) if not _bit_equal(parts[t], first)]
        if differ:
            raise ShardMismatchError(
                f"{where}: {name} differs between tensor-parallel ranks 0 and {differ[0]} although its name says "
                "replicated: it is split under a name the importer does not know (or the ranks did not "
                f"synchronise{_sp_hint(name, spec)}). Give its layout: --tp-split '{_glob_of(name)}=AXIS' (the "
                f"split axis) or '{_glob_of(name)}=none'.")
        return first
    if all(_bit_equal(p, first) for p in parts[1:]) and bool(torch.any(first != 0)):
        sp = _sp_split(name, spec)
        says, why = (("sequence-parallel layout", "a run without sequence parallelism?") if sp else
                     ("name", "an expert tensor-parallel size below the tensor-parallel size?"))
        raise ShardMismatchError(
            f"{where}: {name} holds the same values on all {tps} tensor-parallel ranks although its {says} says "
            f"split along axis {axis}: it is replicated there ({why}). Give its layout: --tp-split "
            f"'{_glob_of(name)}=none'.")
    if spec.gated_mlp and _GATED_FC1.search(name) and axis == (-1 if "/" in name else 0):
        halves = [p.chunk(2, dim=axis) for p in parts]      # each rank: [its gate | its up]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=axis)
    return torch.cat(parts, dim=axis)


def _sp_hint(name: str, spec: MegatronSpec) -> str:
    if spec.kind == "dgrads" and _DGRAD.match(name) and not (spec.layout is not None and spec.layout.sp):
        return "; a sequence-parallel run? give --layout ...,sp=1"
    return ""


def _glob_of(name: str) -> str:
    """A glob for *name* across layers and experts (numbers become ``*``), for the refusal's fix."""
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))


# ------------------------------------------------------------------ heads
def qkv_heads(t: torch.Tensor, heads: int, groups: int, name: str) -> tuple[torch.Tensor, HeadSpec]:
    """Megatron's fused QKV rows ``[group][q.. | k | v][d]`` as ``[q heads][k groups][v groups]``, and its spec."""
    per = heads // groups
    rows = t.shape[0]
    if rows % (groups * (per + 2)):
        raise SpecError(f"{name}: {rows} rows are not {groups} query groups x ({per} q + k + v) heads; check "
                        "--num-heads and --num-query-groups.")
    d = rows // (groups * (per + 2))
    x = t.reshape(groups, per + 2, d, *t.shape[1:])
    q = x[:, :per].reshape(heads * d, *t.shape[1:])
    k = x[:, per].reshape(groups * d, *t.shape[1:])
    v = x[:, per + 1].reshape(groups * d, *t.shape[1:])
    import torch

    out = torch.cat([q, k, v], dim=0)
    spec = HeadSpec(heads, 0, "qkv", fused=3) if groups == heads else HeadSpec(heads + 2 * groups, 0, "qkv")
    return out, spec


def _apply_heads(merged: dict[str, torch.Tensor], spec: MegatronSpec, heads: Any) -> dict[str, HeadSpec]:
    """Reorder the fused QKV tensors in place and return the head specs of every split tensor."""
    from gradforensics.importing.heads import resolve

    explicit = {k: v for k, v in heads.items() if k != "auto"} if isinstance(heads, Mapping) else {}
    out = resolve({n: tuple(t.shape) for n, t in merged.items()}, explicit or None, None) if explicit else {}
    auto = heads == "auto" or (isinstance(heads, Mapping) and bool(heads.get("auto")))
    if not auto or spec.num_heads is None:
        return out
    h, g = spec.num_heads, spec.groups or spec.num_heads
    for name in list(merged):
        if name in out:
            continue
        if re.search(r"\.linear_qkv\.(weight|bias)$", name):
            merged[name], out[name] = qkv_heads(merged[name], h, g, name)
        elif re.search(r"\.self_attention\.linear_proj\.weight$", name):
            out[name] = HeadSpec(h, 1, "o")
            out[name].validate(name, tuple(merged[name].shape))
    return out


# ------------------------------------------------------------------ the padded vocabulary
_VOCAB_ROWS = re.compile(r"(?:^|\.)(?:word_embeddings\.weight|output_layer\.(?:weight|bias))$")
_VOCAB_LAST = re.compile(r"(?:^|\.)output_layer/output\d+$")


def trim_vocab(merged: dict[str, torch.Tensor], spec: MegatronSpec, where: Path) -> dict[str, Any] | None:
    """Drop the padded vocabulary rows of the embedding tensors in place; what was found, for the import's attrs.

    Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``
    (``vocab_size_with_padding``, ``megatron/core/tokenizers/utils/build_tokenizer.py``): ``word_embeddings``
    and ``output_layer`` hold that many rows (the logits' gradient in ``dgrads``, that many columns).  With the
    true size known (``--vocab-size``, or the run's ``vocab_size``) the rows past it are dropped; their count
    is checked against the run's ``padded_vocab_size`` (or the rule) when the arguments are known.
    """
    args = spec.run_args
    padded = args.padded_vocab_size if args is not None else None
    v = spec.vocab_size
    if v is None and padded is None:
        return None
    rule = None
    if padded is None and v is not None and args is not None and args.divisible_by:
        multiple = args.divisible_by * args.tp
        rule = -(-v // multiple) * multiple
    src = "--vocab-size" if args is None or args.vocab_size is None else "the run's vocab_size"
    rows = None
    for n in list(merged):
        axis = 0 if _VOCAB_ROWS.search(n) else -1 if spec.kind == "dgrads" and _VOCAB_LAST.search(n) else None
        if axis is None:
            continue
        t = merged[n]
        r = int(t.shape[axis])
        want = padded if padded is not None else rule
        if want is not None and r != want:
            why = ("the run's padded_vocab_size" if padded is not None else
                   f"{v} padded to a multiple of make_vocab_size_divisible_by x TP")
            raise ShardMismatchError(f"{where}: {n} has {r} vocabulary rows; {why} is {want}: the saved arguments "
                                     "are not this dump's run.")
        if v is not None and r < v:
            raise ShardMismatchError(f"{where}: {n} has {r} vocabulary rows, fewer than the vocabulary size {v} "
                                     f"({src}).")
        if v is not None and r > v:
            merged[n] = t.narrow(axis % t.ndim, 0, v).contiguous()
        rows = r
    if rows is None:
        return None
    return {"size": v, "padded": rows, "rows_dropped": rows - v if v is not None else 0,
            "from": src if v is not None else "unknown: pass --vocab-size to drop the padded rows"}


# ------------------------------------------------------------------ the import
def _load_iteration(d: Path, spec: MegatronSpec, like: Path | None = None) -> dict[str, torch.Tensor]:
    """One iteration merged, its padded vocabulary rows dropped; with *like*, its rank files must be those of
    iteration directory *like*."""
    grid = shards(d, spec.layout)
    if like is not None:
        want = {s.path.name for s in shards(like, spec.layout)}
        lost = sorted(want - {s.path.name for s in grid})
        if lost:
            raise MissingShardError(f"{d}: {lost[0]} is missing ({like.name} has it); every saved iteration is "
                                    "written by the same ranks.")
        extra = sorted({s.path.name for s in grid} - want)
        if extra:
            raise MissingShardError(f"{like}: {extra[0]} is missing ({d.name} has it); every saved iteration is "
                                    "written by the same ranks.")
    merged = merge({s: load_shard(s.path) for s in grid}, spec, d)
    trim_vocab(merged, spec, d)
    return merged


def _layout_from(given: Layout | None, spec: MegatronSpec) -> str:
    said = [w for w, on in (("--layout", given is not None), ("the run's saved arguments", spec.run_args is not None))
            if on]
    return " and ".join(said) or "the file names"


def _select(merged: Mapping[str, torch.Tensor], tensors: Sequence[str] | None, where: Path) -> list[str]:
    floating = [n for n, t in merged.items() if t.is_floating_point()]
    if tensors:
        unused = [g for g in tensors if not any(fnmatch.fnmatchcase(n, g) for n in floating)]
        if unused:
            raise ImportSourceError(f"--tensors: glob {unused[0]!r} matches no tensor of {where} "
                                    f"(e.g. {', '.join(floating[:3])}).")
        chosen = [n for n in floating if any(fnmatch.fnmatchcase(n, g) for g in tensors)]
    else:
        chosen = [n for n in floating if merged[n].ndim >= 2]
    if not chosen:
        raise ImportSourceError(f"{where}: no tensor of two or more axes to import; pass --tensors GLOB.")
    return chosen


def store_name(name: str) -> str:
    """A dump's name as a store name: ``dgrads``' ``module/output0`` becomes ``module.output0``."""
    return check_name(name.replace("/", "."), "tensor name")


def import_megatron(source: Path, out: Any, spec: MegatronSpec, *, tensors: Sequence[str] | None, heads: Any,
                    writer_options: Mapping[str, Any], logs: RunLog | None = None,
                    extra_rows: Callable[[MegatronSpec, Sequence[int]], Any] | None = None) -> int:
    """Import every saved iteration of ``spec.kind`` under *source* into *out*; returns the records written.

    *extra_rows* makes, from the spec and the records' iterations, what gives each record's other rows (its
    ``rows(iteration)``: activation statistics, router loads) and its ``notes`` and ``left_out`` for
    ``extra["import"]`` (:func:`.megatron_acts.record_extras`).

    With *logs* (the run's own, :mod:`gradforensics.runlog`), records get the logged loss, lr, loss scale
    and gradient norm; fp16 gradients are unscaled and skipped iterations marked (:mod:`.logjoin`).
    """
    from gradforensics.importing.logjoin import LogJoin
    from gradforensics.importing.megatron_moe import expert_units, keep, left_out_moe, stack_experts

    iters = iterations(source, spec.kind)
    given = spec.layout
    spec = resolve(spec, source)
    params = iterations(source, "params") if spec.kind != "params" and (source / "params").is_dir() else {}
    first_it, first_dir = next(iter(iters.items()))
    merged = merge({s: load_shard(s.path) for s in shards(first_dir, spec.layout)}, spec, first_dir)
    vocab = trim_vocab(merged, spec, first_dir)
    # parameters only, weights only (2-D and up): (E, ...) units; an expert's bias stays its own 1-D tensor
    listed = expert_units(n for n, t in merged.items() if t.ndim >= 2) if spec.kind != "dgrads" else {}
    merged = stack_experts(merged, listed)
    names = _select(merged, tensors, first_dir)
    expert_ranks = len({s.ep for s in shards(first_dir, spec.layout)})
    left_out = left_out_moe(spec.kind, iters, lambda d: _load_iteration(d, spec, first_dir),
                            {n: merged[n] for n in names}, expert_ranks=expert_ranks)
    names = keep(names, left_out, first_dir)
    specs = _apply_heads(merged, spec, heads)
    units = {store_name(u): len(m) for u, m in listed.items() if u in names}
    extras = extra_rows(spec, list(iters)) if extra_rows is not None else None
    first_extra = extras.rows(first_it) if extras is not None else {}
    left_out = {store_name(n): why for n, why in left_out.items()}
    left_out.update(extras.left_out if extras is not None else {})
    extra = {"import": {"format": "megatron", "source": str(source), "kind": spec.kind,
                        "iterations": list(iters), "num_heads": spec.num_heads,
                        "num_query_groups": spec.num_query_groups, "gated_mlp": spec.gated_mlp,
                        "layout": _layout_text(spec.layout) if spec.layout else "from the file names",
                        "layout_from": _layout_from(given, spec),
                        "run_args": spec.run_args.as_attrs() if spec.run_args is not None else spec.args_note,
                        "vocab": vocab,
                        "qkv_order": "q heads, k groups, v groups" if spec.num_heads else "megatron",
                        "experts_units": units,
                        "activations": "none in the dump", "router": "none in the dump", "not_imported": left_out,
                        **(extras.notes if extras is not None else {}),
                        "dense": dense_note([spec.kind, *(extras.joined if extras is not None else ())],
                                            expert_ranks)}}
    info = {"class": "megatron", "n_params": int(sum(merged[n].numel() for n in names))}
    store_specs = {store_name(n): s for n, s in specs.items() if n in names}
    grad_bytes = sum(merged[n].numel() * min(merged[n].element_size(), 4) for n in names)
    per_record = {"grads": grad_bytes, "weights": grad_bytes * len(set(params) & set(iters)) // len(iters),
                  "acts": sum(r.data.nbytes for r in first_extra.values())}
    join = LogJoin(logs, gradients=spec.kind != "params")
    with ImportWriter(out, heads=store_specs, total=len(iters), per_record=per_record, framework="megatron",
                      model_info=info, extra=extra, logged=join.logged,
                      experts=units, **writer_options) as w:
        if left_out and w.say is not None:
            print(f"import: {len(left_out)} tensor(s) not imported ({', '.join(sorted(left_out)[:3])}"
                  f"{', ...' if len(left_out) > 3 else ''}): {left_out[min(left_out)]}; see "
                  "extra['import']['not_imported'].", file=w.say)
        for it, d in iters.items():
            if it != first_it:
                merged = stack_experts(_load_iteration(d, spec, first_dir), listed)
                _apply_heads(merged, spec, heads)
            snaps = []
            if it in params:
                p = stack_experts(_load_iteration(params[it], spec, first_dir), listed)
                _apply_heads(p, spec, heads)
                snaps = [{store_name(n): p[n] for n in names if n in p}]
            missing = [n for n in names if n not in merged]
            if missing:
                raise ShardMismatchError(f"{d}: {missing[0]} is missing; iteration {first_it} has it.")
            iv, record = join.record(it, d.stat().st_mtime, {store_name(n): merged[n] for n in names}, merged)
            rows = first_extra if it == first_it or extras is None else extras.rows(it)
            w.record(iv, record, snaps, rows)
        if join.logged:
            w.annotate(**join.summary())
    return len(iters)
