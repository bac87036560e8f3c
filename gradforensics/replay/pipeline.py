"""``gf.capture(checkpoint, data, out)``: a problem checkpoint and its data sources to a replay store.

What ``gradforensics capture`` does, as a library call (the command parses its
flags into the three option groups of :mod:`gradforensics.replay.plan` and calls
:func:`capture_checkpoint`):

1. check the data files (:func:`gradforensics.replay.data.precheck`) and ``out``
   (:func:`store_location`), before the model loads;
2. load the checkpoint offline (:func:`load_model`: model, tokenizer, loss) and
   check ``seq_len`` against its positions;
3. check the globs against the model and estimate the store's size
   (:func:`gradforensics.replay.plan.plan_record`), refusing one the disk cannot hold
   unless ``force`` (:func:`gradforensics.replay.plan.check_disk`) - before any
   batch is packed;
4. pack each source's seeded batches (:func:`gradforensics.replay.data.load_batches`)
   and replay them through the model (:func:`gradforensics.replay.replay`) into a
   :class:`~gradforensics.recording.torch.TorchRecorder`, with ``storage_options``
   passed to it for a store at an fsspec URL.

Under ``torchrun`` (``launch``, which the command line sets up) the checkpoint is
sharded with ``fully_shard`` and each source's batches are split across the ranks,
or, with ``check_ranks``, every rank replays the same batches
(:mod:`gradforensics.replay.distributed`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CaptureInterrupted, GradforensicsError, SpecError, Terminated
from gradforensics.recording.attention import use_eager_attention
from gradforensics.replay.plan import (
    BatchSpec,
    ModelSpec,
    RecordSpec,
    as_spec,
    check_disk,
    check_seq_len,
    fit_seq_len,
    plan_record,
)

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.replay.checkpoint import Checkpoint
    from gradforensics.replay.data import Source
    from gradforensics.replay.distributed import Launch
    from gradforensics.replay.probe import CurvatureSpec
    from gradforensics.store.reader import Store

__all__ = ["Captured", "capture", "capture_checkpoint", "curvature_spec", "data_sources",
           "load_model", "seq_len_for",
           "store_exists", "store_location"]

@dataclass(frozen=True)
class Captured:
    """What :func:`capture_checkpoint` wrote: the store (opened for reading), where, and the loss it replayed."""

    store: Store
    out: Any            # the local Path, or the Location of a store at a URL
    loss_name: str
    sources: tuple[str, ...]


# ------------------------------------------------------------------ inputs
def data_sources(data: Mapping[str, Any] | Sequence[str], text_field: str = "text") -> list[Source]:
    """``{"zh": "zh.jsonl", ...}`` or ``["zh=zh.jsonl", ...]`` -> checked sources (one-line errors)."""
    from gradforensics.replay import data as rdata

    specs = [f"{k}={os.fspath(v)}" for k, v in data.items()] if isinstance(data, Mapping) else list(data)
    sources = rdata.parse_sources(specs)
    for src in sources:
        rdata.precheck(src, text_field)
    return sources


def store_location(out: Any, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The store to write: a local :class:`~pathlib.Path`, or the Location of a Zarr store at an fsspec URL.

    Raises
    ------
    SpecError
        Not ``*.zarr`` / ``*.h5`` / ``*.hdf5``, or the store exists and not *overwrite*.
    NotAStoreError
        HDF5 at a URL.
    """
    from gradforensics.store import remote

    text = str(out)
    path = Path(text)
    if path.suffix.lower() not in (".zarr", ".h5", ".hdf5"):
        raise SpecError(f"--out {text}: expected a *.zarr directory or a *.h5 / *.hdf5 file.")
    if remote.is_url(text):
        from gradforensics.store.backends import locate

        where = locate(out, storage_options)    # HDF5 at a URL: refused in one line
        if store_exists(where) and not overwrite:
            raise SpecError(f"--out {text} already exists; pass --overwrite to replace it, or choose another URL.")
        return where
    if path.exists() and not overwrite:
        raise SpecError(f"--out {text} already exists; pass --overwrite to replace it, or choose another path.")
    return path


def store_exists(where: Any) -> bool:
    """Whether a store exists at *where*: a local path, or the Location of a Zarr store at a URL."""
    from gradforensics.store import remote

    if not remote.is_url(str(where)):
        return Path(str(where)).exists()
    fs, root = remote.filesystem(where.path, where.storage_options)
    return bool(remote.translated(where.path, lambda: fs.exists(f"{root}/zarr.json")))


def load_model(checkpoint: str | os.PathLike[str], model: ModelSpec, batches: BatchSpec) -> Checkpoint:
    """Load *checkpoint* offline as *model* says, and check ``batches.seq_len`` against its positions
    (no ``seq_len``: the one :func:`seq_len_for` picks)."""
    from gradforensics.replay.checkpoint import load_checkpoint, max_positions
    from gradforensics.replay.offline import offline

    with offline():     # HF_HUB_OFFLINE=1 before transformers is first imported
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()     # ours is the one progress bar
        ckpt = load_checkpoint(checkpoint, loss=model.loss, model_factory=model.model_factory,
                               tokenizer=model.tokenizer, device=model.device, model_dtype=model.model_dtype,
                               seed=batches.seed)
    check_seq_len(seq_len_for(batches, ckpt)[0], ckpt.max_positions, max_positions(ckpt.model)[1])
    return ckpt


def seq_len_for(batches: BatchSpec, ckpt: Checkpoint) -> tuple[int, str | None]:
    """``batches.seq_len``, or with none given 512 or the model's own limit when lower, and the line saying so.

    The limits: the model's positions, and the tokenizer's ``model_max_length`` (the
    length the model was trained at, where the tokenizer says it; the demo's is 32).
    """
    from gradforensics.replay.checkpoint import max_positions

    tok = getattr(ckpt.tokenizer, "model_max_length", None)
    tok_len = tok if isinstance(tok, int) and not isinstance(tok, bool) else None
    return fit_seq_len(batches.seq_len, [(ckpt.max_positions, max_positions(ckpt.model)[1]),
                                         (tok_len, "the tokenizer's model_max_length")])


# ------------------------------------------------------------------ the call
def capture(checkpoint: str | os.PathLike[str], data: Mapping[str, Any] | Sequence[str], out: Any, *,
            batches: BatchSpec | Mapping[str, Any] | None = None, record: RecordSpec | Mapping[str, Any] | None = None,
            model: ModelSpec | Mapping[str, Any] | None = None, storage_options: Mapping[str, Any] | None = None,
            overwrite: bool = False, force: bool = False, quiet: bool = True,
            threads: int | str | None = "auto", curvature: Any = None) -> Store:
    """Replay batches of every data source through *checkpoint* and write one gradient per batch to *out*.

    What ``gradforensics capture`` does in one process (``docs/capture-your-checkpoint.md``).

    Parameters
    ----------
    checkpoint
        A Hugging Face model directory, or a state-dict file with ``model={"model_factory": ...}``
        (and ``"tokenizer"``).
    data
        ``{"zh": "zh.jsonl", "en": "en.txt"}`` or ``["zh=zh.jsonl", ...]``: ``.txt`` (one
        document a line) or ``.jsonl``; the keys become the store's sources.
    out
        ``*.zarr`` or ``*.h5`` to write (``mode="replay"``), or a Zarr store at an
        fsspec URL (``s3://bucket/dump.zarr``).
    batches, record, model
        The option groups, each a :class:`~gradforensics.replay.plan.BatchSpec`,
        :class:`~gradforensics.replay.plan.RecordSpec`,
        :class:`~gradforensics.replay.plan.ModelSpec` or a dict of its fields
        (default: the command's defaults - 64 batches of 8 sequences of 512 tokens, or of the model's
        own limit when lower,
        per source, every 2-D weight whole, heads split by the automatic rules).
    storage_options
        For *out* at a URL: options of its file system (``endpoint_url``, ...),
        given to the recorder; default: the environment.
    overwrite
        Replace an existing store at *out*.
    force
        Go on even if the size estimate exceeds the free disk.
    quiet
        No estimate line and no progress bar on stderr (default); ``False`` prints both.
    threads
        torch intra-op threads: ``"auto"`` (one for a model under 20M parameters
        unless ``OMP_NUM_THREADS`` is set) or a number.
    curvature
        ``True``, a :class:`~gradforensics.replay.probe.CurvatureSpec` or a dict of its
        fields: also the top Hessian eigenvalues (whole model and each block) and the
        checkpoint's optimizer state, in ``curvature/`` and ``optim/``
        (``docs/curvature.md``).  Default None: no.

    Returns
    -------
    Store
        The written store, opened for reading.

    Raises
    ------
    SpecError, DataError, NotACheckpointError, CheckpointError, OfflineError
        Bad input, named on one line, before any record is written.
    CaptureInterrupted
        Ctrl-C: the store holds the records written so far; the message says how many.
    """
    return capture_checkpoint(checkpoint, data, out, batches=batches, record=record, model=model,
                              storage_options=storage_options, overwrite=overwrite, force=force, quiet=quiet,
                              threads=threads, curvature=curvature).store


def capture_checkpoint(checkpoint: str | os.PathLike[str], data: Mapping[str, Any] | Sequence[str], out: Any, *,
                       batches: BatchSpec | Mapping[str, Any] | None = None,
                       record: RecordSpec | Mapping[str, Any] | None = None,
                       model: ModelSpec | Mapping[str, Any] | None = None,
                       storage_options: Mapping[str, Any] | None = None, overwrite: bool = False,
                       force: bool = False, quiet: bool = True, threads: int | str | None = "auto",
                       launch: Launch | None = None, check_ranks: bool = False, curvature: Any = None) -> Captured:
    """:func:`capture`, also under ``torchrun``; returns the store with the loss it replayed.

    *launch* is this process's rank (:func:`gradforensics.replay.distributed.from_env`,
    the process group joined by the caller); every rank calls this with the same
    arguments.  *check_ranks*: every rank replays the same batches with the whole
    model (the input of the ``rankconsistency`` analysis) instead of sharding it.
    """
    from gradforensics._extras import require_extra
    from gradforensics.replay.threads import parse_threads

    require_extra("torch", "gf.capture()")
    require_extra("transformers", "gf.capture()")
    b, r, m = as_spec(BatchSpec, batches), as_spec(RecordSpec, record), as_spec(ModelSpec, model)
    n_threads = parse_threads(threads)
    curv = curvature_spec(curvature, launch)
    sources = data_sources(data, b.text_field)
    where = store_location(out, overwrite, storage_options)
    if launch is not None:
        import torch.distributed as dist

        dist.barrier()        # every rank has checked out before rank 0 creates the store there
    try:
        return _run(checkpoint, sources, where, b, r, m, storage_options=storage_options, force=force, quiet=quiet,
                    threads=n_threads, launch=launch, check_ranks=check_ranks, curvature=curv)
    except KeyboardInterrupt as exc:     # Ctrl-C, or SIGTERM under torchrun (a rank died): the store is closed
        raise CaptureInterrupted(interrupted(where, isinstance(exc, Terminated),
                                             0 if launch is None else launch.rank)) from None


def _run(checkpoint: str | os.PathLike[str], sources: list[Source], where: Any, batches: BatchSpec,
         record: RecordSpec, model: ModelSpec, *, storage_options: Mapping[str, Any] | None, force: bool,
         quiet: bool, threads: int | None, launch: Launch | None, check_ranks: bool,
         curvature: CurvatureSpec | None = None) -> Captured:
    from gradforensics.replay import data, distributed
    from gradforensics.replay.run import replay
    from gradforensics.replay.threads import for_model
    from gradforensics.store.remote import is_url

    ckpt = load_model(checkpoint, model, batches)
    seq_len, note = seq_len_for(batches, ckpt)
    batches = dataclasses.replace(batches, seq_len=seq_len)
    if note and not quiet and (launch is None or not launch.rank):
        print(note, file=sys.stderr, flush=True)
    if record.attention is not None:
        use_eager_attention(ckpt.model)      # SDPA/flash give no attention weights
    per_record = plan_record(ckpt.model, record, len(sources))
    world = 1 if launch is None else launch.world
    sharded = world > 1 and not check_ranks      # FSDP: a record is the reduced gradient of R micro-batches
    n = batches.batches_per_source * len(sources) * (world if check_ranks else 1)
    check_disk(per_record, n, where, force=force, say=None if quiet else sys.stderr)   # before any batch exists
    packed = data.load_batches(sources, ckpt.tokenizer, seq_len=seq_len, batch_size=batches.batch_size,
                               n_batches=batches.batches_per_source * (world if sharded else 1), seed=batches.seed,
                               text_field=batches.text_field)
    extra: dict[str, Any] = {}
    if sharded:
        assert launch is not None
        packed = distributed.rank_batches(packed, launch.rank, world)
        distributed.shard(ckpt.model, world, model.device)
    elif world > 1:
        extra["extra"] = {"replicated": True}          # every rank replays the same batches
    if storage_options and is_url(str(where)):
        extra["storage_options"] = storage_options
    device = model.device
    if curvature is not None:
        from gradforensics.replay.probe import CheckpointProbe

        extra["probe"] = CheckpointProbe.from_checkpoint(checkpoint, ckpt.model, curvature)

    def loss_fn(net: nn.Module, batch: dict[str, Any]) -> Any:
        return ckpt.loss_fn(net, {k: v.to(device) for k, v in batch.items()})

    with for_model(ckpt.model, threads):
        store = replay(ckpt.model, packed, loss_fn, where, n_per_source=batches.batches_per_source,
                       step=ckpt.step if model.step is None else model.step, progress=not quiet,
                       check_space=not force and not is_url(str(where)), overwrite=True,
                       announce=False,                 # check_disk printed the estimate before any batch
                       **record.recorder_options(), **extra)
    return Captured(store, where, ckpt.loss_name, tuple(s.name for s in sources))


def curvature_spec(value: Any, launch: Launch | None = None) -> CurvatureSpec | None:
    """``curvature=`` as a :class:`~gradforensics.replay.probe.CurvatureSpec` (None: off); refused under torchrun."""
    from gradforensics.replay.probe import CurvatureSpec

    if value is None or value is False:
        return None
    if launch is not None:
        raise SpecError("--curvature runs in one process: Hessian-vector products of a sharded model are not "
                        "supported; capture without torchrun (or without --curvature).")
    if value is True:
        return CurvatureSpec()
    if isinstance(value, CurvatureSpec):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"curvature=: expected True, a CurvatureSpec or a dict of its fields; got "
                        f"{type(value).__name__}.")
    names = [f.name for f in dataclasses.fields(CurvatureSpec)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise SpecError(f"curvature=: unknown option {unknown[0]!r}; the options are {', '.join(names)}.")
    return CurvatureSpec(**value)


def interrupted(where: Any, terminated: bool = False, rank: int = 0) -> str:
    """``interrupted; <out> holds the N records written before it.`` (or that none was written).

    *terminated*: SIGTERM rather than Ctrl-C.  A rank other than 0 does not
    commit (rank 0 does, from every rank's marker), so it says only that.
    """
    from gradforensics.store.reader import open_store

    what = "terminated (SIGTERM)" if terminated else "interrupted"
    if rank:
        return f"rank {rank}: {what}; rank 0 commits the records every rank wrote to {where}."
    try:
        n = open_store(where).n_records if store_exists(where) else 0
    except GradforensicsError:
        n = 0
    held = f"{where} holds the {n} records written before it" if n else "no record was written"
    return f"{what}; {held}."
