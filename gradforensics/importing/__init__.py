"""Import what a team already has into an ordinary schema-v1 store (``mode="training"``).

* :mod:`gradforensics.importing.checkpoints`: a series of checkpoints (Hugging Face
  Trainer ``checkpoint-N/``, raw torch files, safetensors): weight snapshots and the
  update between consecutive checkpoints, one record per interval;
* :mod:`gradforensics.importing.megatron`: Megatron-LM's ``wgrads`` / ``dgrads`` /
  ``params`` dumps, shards joined, one record per saved iteration;
* :mod:`gradforensics.importing.olmo_core`: OLMo-core's gradient dumps, one record per dumped step.

All write through :class:`gradforensics.importing.records.ImportWriter` (the store
writer), read every file with ``torch.load(weights_only=True)`` or safetensors, and
refuse anything malformed in one line.  ``gf.import_run(...)`` is the entry point;
``gradforensics import`` its command line.  See ``docs/import.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from gradforensics.store.reader import Store

__all__ = ["FORMATS", "detect_format", "import_run"]


FORMATS = ("auto", "checkpoints", "megatron", "olmo-core")


def detect_format(source: Path) -> str:
    """``megatron`` when *source* is a Megatron-LM ``--save`` directory (or one of its dump directories),
    ``olmo-core`` when it holds OLMo-core gradient dumps (``gradients/step<N>/``), else ``checkpoints``."""
    from gradforensics.importing.megatron import KINDS
    from gradforensics.importing.olmo_core import is_gradient_dump

    def has_iters(d: Path) -> bool:
        return d.is_dir() and any(p.name.startswith("iter_") and p.is_dir() for p in d.iterdir())

    if any(has_iters(source / k) for k in KINDS) or (source.name in KINDS and has_iters(source)):
        return "megatron"
    if is_gradient_dump(source):
        return "olmo-core"
    return "checkpoints"


def import_run(source: str | os.PathLike[str], out: str | os.PathLike[str], *, format: str = "auto",
               tensors: Sequence[str] | None = None, heads: str | Mapping[str, Any] | None = "auto",
               kind: str = "wgrads", num_heads: int | None = None, num_query_groups: int | None = None,
               gated_mlp: bool = False, overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
               quiet: bool = True, force: bool = False, logs: str | os.PathLike[str] | None = None,
               tp_splits: Mapping[str, int | None] | None = None,
               layout: str | Mapping[str, int] | None = None, args_from: str | os.PathLike[str] | None = None,
               vocab_size: int | None = None, moe_topk: int | None = None) -> Store:
    """Import a training run's history from *source* into a new store at *out*.

    Parameters
    ----------
    source
        A directory: checkpoints (``format="checkpoints"``) or a Megatron-LM ``--save``
        directory holding ``wgrads/``, ``dgrads/`` or ``params/`` (``format="megatron"``).
    out
        The store to write (``*.zarr``, ``*.h5``, or a Zarr store at an fsspec URL).
    format
        ``"checkpoints"``, ``"megatron"``, ``"olmo-core"`` (OLMo-core's gradient dumps), or ``"auto"``
        (default: ``megatron`` when *source* holds ``wgrads/``, ``dgrads/`` or ``params/`` with ``iter_*``
        directories, ``olmo-core`` when it holds ``gradients/step<N>/``, else ``checkpoints``).
    tensors
        Globs of the tensors to import (default: every floating 2-D tensor).
    heads
        ``"auto"``, ``None`` or ``{glob: H | {"heads": H, "axis": A, ...}}`` as in
        ``capture``.  Megatron's fused ``linear_qkv`` is split into heads by query group
        when *num_heads* (and *num_query_groups* for grouped-query attention) are given.
    kind
        Megatron: which dump, ``"wgrads"`` (the reduced ``main_grad``), ``"dgrads"``, ``"params"``
        or ``"activations"`` (``--save-activations-interval``: activation statistics ``acts/<module>/``
        per saved iteration; beside another kind saved at the same iterations they join its records).
    num_heads, num_query_groups, gated_mlp
        Megatron: the model's attention heads and query groups, and whether
        ``linear_fc1`` is a gated (SwiGLU) pair whose halves each rank holds.
    tp_splits
        Megatron: ``{glob: axis or None}``, the tensor-parallel layout of tensors the name rules
        do not know (or get wrong): split along ``axis``, or replicated (``None``).  Every join is
        checked against the ranks' values either way (see docs/import.md).
    layout
        Megatron: the run's parallel sizes, ``"tp=2,pp=2,ep=2,etp=1,vp=1"`` or a mapping (``etp``
        defaults to ``tp``, the others to 1).  The files present are checked against it; it is
        needed for an expert tensor-parallel size below TP.  Default: the run's saved arguments when a
        checkpoint is found (see *args_from*), else the grid of the file names (refused when the dump holds
        experts: their layout cannot be read from the files).  ``sp=1``: sequence parallelism.
    args_from
        Megatron: a checkpoint holding the run's saved arguments (a ``--save`` directory, an ``iter_*``
        directory, a ``common.pt`` or ``model_optim_rng.pt``); default: a checkpoint beside the dumps.
        The layout, heads, query groups, SwiGLU and vocabulary are taken from it; what *layout* and the
        other parameters also say must agree.
    vocab_size
        Megatron: the true vocabulary size; the padded rows of ``word_embeddings`` / ``output_layer``
        are dropped (default: the run's saved ``vocab_size`` when it has one).
    moe_topk
        Megatron: the run's ``--moe-router-topk`` k, needed to read ``tokens_per_expert/``
        (``--save-tokens-per-expert-interval``) into ``router/<router>/load`` (attribute ``top_k``).
    overwrite, storage_options
        As for :class:`gradforensics.Recorder`.
    quiet, force
        No size line and progress bar; write even when the estimate exceeds the free disk.
    logs
        The run's own logs (a TensorBoard directory or event file, a ``trainer_state.json``; see
        :mod:`gradforensics.runlog`): the logged loss, lr, gradient norm and loss scale join the
        records; a fp16 dump's gradients are unscaled by the logged loss scale, skipped iterations
        are marked ``batches/skipped``, and the dump's gradient norm is checked against the logged one.

    Returns
    -------
    Store
        The written store, opened for reading.

    Raises
    ------
    ImportSourceError, CheckpointError, NotACheckpointError
        A source that is not a series, or a file that cannot be read safely (one line).
    """
    from gradforensics.store.reader import open_store

    if format not in FORMATS:
        raise SpecError(f"import: format must be one of {FORMATS}; got {format!r}.")
    src = Path(source)
    if format == "auto":
        format = detect_format(src)
    run_log = None
    if logs is not None:
        from gradforensics.runlog import read_run_log

        run_log = read_run_log(logs)
    options = {"overwrite": overwrite, "storage_options": storage_options, "quiet": quiet, "force": force}
    if format == "checkpoints":
        from gradforensics.importing.checkpoints import import_checkpoints

        import_checkpoints(src, out, tensors=tensors, heads=heads, writer_options=options, logs=run_log)
    elif format == "olmo-core":
        from gradforensics.importing.olmo_core import import_olmo_core

        import_olmo_core(src, out, tensors=tensors, heads=heads, writer_options=options, logs=run_log)
    else:
        from gradforensics.importing.megatron import MegatronSpec, import_megatron, parse_layout, resolve
        from gradforensics.importing.megatron_acts import import_activations, record_extras

        spec = MegatronSpec(kind=kind, num_heads=num_heads, num_query_groups=num_query_groups, gated_mlp=gated_mlp,
                            tp_splits=dict(tp_splits or {}), layout=parse_layout(layout), vocab_size=vocab_size,
                            args_from=None if args_from is None else str(args_from), moe_topk=moe_topk)
        if kind == "activations":
            spec = resolve(spec, src)           # the run's saved arguments (import_megatron resolves its own)
            import_activations(src, out, spec, tensors=tensors, writer_options=options, logs=run_log, top_k=spec.moe_topk)
        else:
            import_megatron(src, out, spec, tensors=tensors, heads=heads, writer_options=options, logs=run_log,
                            extra_rows=record_extras(src, quiet=quiet))
    return open_store(out, storage_options=storage_options)
