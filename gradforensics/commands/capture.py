"""``gradforensics capture CHECKPOINT --data NAME=FILE ... --out STORE``: dump a problem checkpoint.

Loads the checkpoint offline (:mod:`gradforensics.replay.checkpoint`), packs
each source's text into seeded batches (:mod:`gradforensics.replay.data`),
prints a size estimate and refuses when the disk cannot hold it (unless
``--force``), then replays the batches through the model
(:func:`gradforensics.replay.replay`, ``mode="replay"``) with a
progress bar.  ``Ctrl-C`` stops it and leaves a valid store with the records
written so far (exit 130).  See ``docs/capture-your-checkpoint.md``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.store.heads import HeadSpec

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16",
               "float16": "float16", "fp32": "float32", "f32": "float32", "float32": "float32"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: batches/step, loss, n_samples, rank, lr, time: 8 + 4 + 4 + 4 + 4 + 8 bytes; plus 4 per source (mixture).
META_BYTES = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a Hugging Face model directory, or a state-dict file with --model-factory")
    p.add_argument("--data", action="append", required=True, metavar="NAME=FILE",
                   help="a data source: .txt (one document a line) or .jsonl; repeat for each source")
    p.add_argument("--out", required=True, help="the store to write: *.zarr or *.h5, or a Zarr store at an fsspec "
                                                "URL (s3://bucket/dump.zarr)")
    from gradforensics.commands import storage as storage_flags

    storage_flags.add_argument(p)
    g = p.add_argument_group("batches")
    g.add_argument("--batches-per-source", type=int, default=64, metavar="N")
    g.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences per batch")
    g.add_argument("--seq-len", type=int, default=512, metavar="T", help="tokens per sequence (packed)")
    g.add_argument("--text-field", default="text", help="the document field of .jsonl lines (default text)")
    g.add_argument("--seed", type=int, default=0, help="seed of the batch draw and of masked-LM masking")
    r = p.add_argument_group("what to record")
    r.add_argument("--tensors", nargs="+", metavar="GLOB", help="parameter globs (default: every 2-D weight)")
    r.add_argument("--heads", nargs="+", default=["auto"], metavar="SPEC",
                   help="auto (default), none, or GLOB=H entries (with auto among them to keep the rules)")
    r.add_argument("--activations", nargs="+", metavar="GLOB", help="module globs: per-unit activation statistics")
    r.add_argument("--sketch", type=int, metavar="K", help="store a K-dim sketch per tensor (per head)")
    r.add_argument("--full", nargs="+", metavar="GLOB",
                   help="with --sketch: tensors whose whole gradient is stored too (default none)")
    r.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="on-disk gradient format (default: as computed)")
    add_model_options(p)
    p.add_argument("--check-ranks", action="store_true",
                   help="under torchrun: replay the same batches on every rank (whole model each) to find a rank "
                        "that computes a different gradient (the rankconsistency analysis)")
    p.add_argument("--force", action="store_true", help="go on even if the estimate exceeds the free disk")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    p.add_argument("--quiet", action="store_true", help="no estimate line, no progress bar")


# ------------------------------------------------------------------ parsing
def parse_heads(specs: Sequence[str]) -> str | dict[str, Any] | None:
    """``["auto"]`` -> ``"auto"``; ``["none"]`` -> ``None``; ``["*.q.weight=8", "auto"]`` -> a dict."""
    if list(specs) == ["auto"]:
        return "auto"
    if list(specs) == ["none"]:
        return None
    out: dict[str, Any] = {}
    for spec in specs:
        if spec == "auto":
            out["auto"] = True
            continue
        glob, eq, h = spec.rpartition("=")
        if not eq or not glob or not h.isdigit() or int(h) < 1:
            raise SpecError(f"--heads {spec!r}: expected auto, none, or GLOB=H with H a positive integer.")
        out[glob] = int(h)
    return out


def parse_out(out: str, overwrite: bool) -> Path:
    """The store path of ``--out`` (a Zarr store at an fsspec URL stays a URL string)."""
    from gradforensics.store import remote

    path = Path(out)
    if path.suffix.lower() not in (".zarr", ".h5", ".hdf5"):
        raise SpecError(f"--out {out}: expected a *.zarr directory or a *.h5 / *.hdf5 file.")
    if remote.is_url(out):
        from gradforensics.store.backends import backend_kind

        backend_kind(out)                      # HDF5 at a URL: refused in one line
        if _url_exists(out) and not overwrite:
            raise SpecError(f"--out {out} already exists; pass --overwrite to replace it, or choose another URL.")
        return out  # type: ignore[return-value]  # a URL is not a local Path; every use below takes both
    if path.exists() and not overwrite:
        raise SpecError(f"--out {out} already exists; pass --overwrite to replace it, or choose another path.")
    return path


def _url_exists(url: str) -> bool:
    from gradforensics.store import remote

    fs, root = remote.filesystem(url)
    return bool(remote.translated(url, lambda: fs.exists(f"{root}/zarr.json")))


def check_seq_len(seq_len: int, max_pos: int | None, where: str) -> None:
    if seq_len < 2:
        raise SpecError(f"--seq-len must be >= 2; got {seq_len}.")
    if max_pos is not None and seq_len > max_pos:
        raise SpecError(f"--seq-len {seq_len} is beyond the model's {max_pos} positions ({where}); "
                        f"use --seq-len {max_pos} or less.")


# ------------------------------------------------------------------ size estimate
def _units(module: nn.Module, model: nn.Module, name: str) -> int:
    """Output units of a hooked module (for the estimate): Linear's out_features, else a config width."""
    units = getattr(module, "out_features", None)
    if isinstance(units, int):
        return units
    cfg = getattr(model, "config", None)
    key = "intermediate_size" if "mlp" in name or "act" in name else "hidden_size"
    return int(getattr(cfg, key, 0) or 0)


def record_bytes(shapes: Mapping[str, tuple[tuple[int, ...], int]], specs: Mapping[str, HeadSpec], *,
                 sketch: int | None, full: Sequence[str] | None, n_sources: int,
                 act_units: Sequence[int] = ()) -> dict[str, int]:
    """Bytes one record adds to the store (before compression), by part.

    *shapes* maps each recorded tensor to ``(shape, bytes per element)``.  A
    whole tensor costs ``numel x itemsize``; a sketch ``k x 4 x heads`` (one
    ``k`` float32 vector per head, or one for an unsplit tensor); an activated
    module ``B x 8 + 4 x units x 4`` (int64 histogram of ``B`` bins and four per-unit
    statistics); the batch metadata ``32 + 4 x sources``.
    """
    from gradforensics.capture.actstats import N_BINS

    globs = tuple(full) if full is not None else (() if sketch else ("*",))
    grads = sketches = 0
    for name, (shape, itemsize) in shapes.items():
        numel = 1
        for s in shape:
            numel *= int(s)
        if any(fnmatch.fnmatchcase(name, g) for g in globs):
            grads += numel * itemsize
        if sketch:
            spec = specs.get(name)
            sketches += sketch * 4 * (spec.total if spec is not None else 1)
    acts = sum(N_BINS * 8 + 4 * u * 4 for u in act_units)
    meta = META_BYTES + 4 * n_sources
    return {"grads": grads, "sketch": sketches, "acts": acts, "meta": meta,
            "total": grads + sketches + acts + meta}


def _plan(args: argparse.Namespace, model: nn.Module, heads: Any, dtype: str | None) -> dict[str, int]:
    """Check the globs against the model (one-line errors) and estimate a record's bytes."""
    from gradforensics.capture.autoheads import resolve_heads
    from gradforensics.capture.torch import select_modules, select_parameters

    params = select_parameters(model, args.tensors)
    if not params:
        raise SpecError(f"tensors: {type(model).__name__} has no trainable 2-D weight to record; pass --tensors.")
    specs = resolve_heads(model, {n: tuple(p.shape) for n, p in params.items()}, heads)
    for glob in args.full or ():
        if not any(fnmatch.fnmatchcase(n, glob) for n in params):
            raise SpecError(f"--full: glob {glob!r} matches none of the recorded tensors "
                            f"(e.g. {', '.join(list(params)[:3])}).")
    modules = select_modules(model, args.activations)
    shapes = {n: (tuple(p.shape), ITEMSIZE[dtype] if dtype else p.element_size()) for n, p in params.items()}
    units = [_units(m, model, n) for n, m in modules.items()]
    return record_bytes(shapes, specs, sketch=args.sketch, full=args.full, n_sources=len(args.data),
                        act_units=units)


def _refuse_or_announce(per_record: dict[str, int], n_records: int, out: Path, force: bool, quiet: bool) -> None:
    from gradforensics._format import fmt_bytes
    from gradforensics.replay.run import size_estimate
    from gradforensics.store.remote import is_url

    est = size_estimate(per_record["total"], n_records, out)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per_record.items() if k != "total" and v)
    line = (f"estimate: {n_records} records x {fmt_bytes(est['bytes_per_record'])} ({parts}) = "
            f"{fmt_bytes(est['total_bytes'])}; {fmt_bytes(est['free_bytes'])} free on the disk of {out}.")
    if is_url(out):                   # object storage: no free-space figure to check against
        line = line.rsplit(";", 1)[0] + f" to {out}."
    if not quiet:
        print(line, file=sys.stderr, flush=True)
    if est["total_bytes"] > est["free_bytes"] and not force and not is_url(out):
        raise SpecError(f"{out} needs ~{fmt_bytes(est['total_bytes'])} but only {fmt_bytes(est['free_bytes'])} "
                        "is free; record fewer --tensors, use --sketch K or --dtype bf16, lower "
                        "--batches-per-source, or pass --force.")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The "model" options ``capture`` and ``whatif`` share: loss, raw-checkpoint factory, tokenizer, device."""
    m = p.add_argument_group("model")
    m.add_argument("--loss", default="auto",
                   help="auto (from the config), causal-lm, masked-lm, or module:function taking (model, batch)")
    m.add_argument("--model-factory", metavar="MODULE:FUNCTION",
                   help="builds the nn.Module of a raw PyTorch checkpoint (loaded with weights_only=True)")
    m.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the checkpoint directory)")
    m.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    m.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    m.add_argument("--step", type=int, help="optimizer step of the checkpoint (default: trainer_state.json, else 0)")
    from gradforensics.commands import threads

    threads.add_argument(m)


#: The public name ``gradforensics whatif`` checks its options and estimates a record with.
plan_record_bytes = _plan


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "gradforensics capture")
    require_extra("transformers", "gradforensics capture")
    from gradforensics.replay import data

    sources = data.parse_sources(args.data)
    for src in sources:
        data.precheck(src, args.text_field)
    if args.batches_per_source < 1 or args.batch_size < 1:
        raise SpecError(f"--batches-per-source and --batch-size must be >= 1; got {args.batches_per_source} "
                        f"and {args.batch_size}.")
    if args.sketch is not None and args.sketch < 1:
        raise SpecError(f"--sketch must be >= 1; got {args.sketch}.")
    if args.full and args.sketch is None:
        raise SpecError("--full selects whole tensors to keep next to --sketch; without --sketch every "
                        "recorded tensor is whole already.")
    heads = parse_heads(args.heads)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else None
    launch = _launch(args)
    from gradforensics.commands import storage as storage_flags

    storage_flags.register(args, args.out)
    out = parse_out(args.out, args.overwrite)
    if launch is not None:
        _barrier()        # every rank has checked --out before rank 0 creates the store there
    try:
        return _capture(args, sources, heads, dtype, out, launch)
    except KeyboardInterrupt:
        _interrupted(out)
        return 130
    finally:
        if launch is not None:
            from gradforensics.replay import distributed

            distributed.finish()


def _launch(args: argparse.Namespace) -> Any:
    """Under torchrun: join the process group; ``None`` in a single process."""
    from gradforensics.replay import distributed

    launch = distributed.from_env(args.device)
    if launch is None:
        if args.check_ranks:
            raise SpecError("--check-ranks compares ranks: start the command with torchrun --nproc-per-node R.")
        return None
    distributed.init(launch)
    args.device = launch.device
    if launch.rank:
        args.quiet = True             # one estimate line, one progress bar: rank 0's
    return launch


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _capture(args: argparse.Namespace, sources: list[Any], heads: Any, dtype: str | None, out: Path,
             launch: Any = None) -> int:
    from gradforensics._threads import for_model
    from gradforensics.replay import data, distributed, replay
    from gradforensics.replay.checkpoint import load_checkpoint, max_positions, offline

    with offline():     # HF_HUB_OFFLINE=1 before transformers is first imported
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()     # ours is the one progress bar
        ckpt = load_checkpoint(args.checkpoint, loss=args.loss, model_factory=args.model_factory,
                               tokenizer=args.tokenizer, device=args.device, model_dtype=args.model_dtype,
                               seed=args.seed)
    check_seq_len(args.seq_len, ckpt.max_positions, max_positions(ckpt.model)[1])
    per_record = _plan(args, ckpt.model, heads, dtype)
    world = 1 if launch is None else launch.world
    sharded = world > 1 and not args.check_ranks     # FSDP: a record is the reduced gradient of R micro-batches
    n = args.batches_per_source * len(sources) * (world if args.check_ranks else 1)
    _refuse_or_announce(per_record, n, out, args.force, args.quiet)     # before any batch is allocated
    batches = data.load_batches(sources, ckpt.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                                n_batches=args.batches_per_source * (world if sharded else 1), seed=args.seed,
                                text_field=args.text_field)
    extra: dict[str, Any] = {}
    if sharded:
        batches = distributed.rank_batches(batches, launch.rank, world)
        distributed.shard(ckpt.model, world, args.device)
    elif world > 1:
        extra["extra"] = {"replicated": True}          # every rank replays the same batches
    device = args.device

    def loss_fn(model: nn.Module, batch: dict[str, Any]) -> Any:
        return ckpt.loss_fn(model, {k: v.to(device) for k, v in batch.items()})

    with for_model(ckpt.model, args.threads):
        store = replay(ckpt.model, batches, loss_fn, out, n_per_source=args.batches_per_source,
                       step=ckpt.step if args.step is None else args.step, progress=not args.quiet,
                       check_space=not args.force and "://" not in str(out), tensors=args.tensors, heads=heads,
                       activations=args.activations, sketch=args.sketch, full=args.full, dtype=dtype,
                       overwrite=True, **extra)
    if launch is not None and launch.rank:
        return 0
    print(f"{out}: {store.n_records} records of {len(sources)} sources ({', '.join(s.name for s in sources)}), "
          f"loss {ckpt.loss_name}; next: gradforensics analyze {out} --out REPORT_DIR", file=sys.stderr)
    return 0


def _interrupted(out: Path) -> None:
    from gradforensics.errors import GradforensicsError
    from gradforensics.store.reader import open_store

    try:
        n = open_store(out).n_records if (_url_exists(str(out)) if "://" in str(out) else out.exists()) else 0
    except GradforensicsError:
        n = 0
    where = f"{out} holds the {n} records written before it" if n else "no record was written"
    print(f"gradforensics capture: interrupted; {where}.", file=sys.stderr)
