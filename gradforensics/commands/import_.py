"""``gradforensics import SOURCE --format checkpoints|megatron|olmo-core --out STORE``: a run's history as a store.

A thin wrapper of :func:`gradforensics.importing.import_run` (``gf.import_run``): a
series of checkpoints becomes weight snapshots and one record per interval (the
update between consecutive checkpoints); Megatron-LM dumps one record per saved
iteration, shards joined.  Prints the size estimate and a progress bar; every file is
read with ``weights_only=True``.  See ``docs/import.md``.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "parse_tp_splits", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags
    from gradforensics.importing import FORMATS

    p.add_argument("source", help="a directory of checkpoints (checkpoint-N/, <name><step>.pt, .safetensors), or a "
                                  "Megatron-LM --save directory holding wgrads/, dgrads/ or params/, or an OLMo-core save "
                                  "folder (step<N>/ checkpoints, or gradients/step<N>/ dumps)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="what SOURCE holds (default auto: megatron for a --save directory with wgrads/, dgrads/ or "
                        "params/, olmo-core for an OLMo-core save folder with gradients/step<N>/ dumps, else "
                        "checkpoints)")
    output.add_out(p, "the store to write: *.zarr or *.h5, or a Zarr store at an fsspec URL (s3://bucket/dump.zarr)",
                   kind="store")
    storage_flags.add_argument(p)
    r = p.add_argument_group("what to import")
    r.add_argument("--tensors", nargs="+", metavar="GLOB", help="tensor globs (default: every 2-D floating tensor)")
    r.add_argument("--logs", metavar="DIR",
                   help="the run's own logs: a TensorBoard directory or event file, or a trainer_state.json; joins "
                        "the logged loss, lr, grad norm and loss scale, unscales fp16 gradients, marks skipped "
                        "iterations (batches/skipped) and checks the dump's gradient norm against the logged one")
    r.add_argument("--heads", nargs="+", default=["auto"], metavar="SPEC",
                   help="auto (default), none, FILE.json, or GLOB=H[:axis=A,fused=F,role=R] / GLOB=none entries "
                        "(add auto to keep the rules for the rest)")
    m = p.add_argument_group("megatron")
    m.add_argument("--kind", choices=("wgrads", "dgrads", "params", "activations"), default="wgrads",
                   help="which dump to import (default wgrads: the reduced main_grad; activations: statistics of "
                        "the forward activations, acts/<module>/)")
    m.add_argument("--num-heads", type=int, metavar="H", help="attention heads: splits linear_qkv into heads")
    m.add_argument("--num-query-groups", type=int, metavar="G", help="query groups (grouped-query attention; "
                                                                     "default = --num-heads)")
    m.add_argument("--tp-split", nargs="+", metavar="GLOB=AXIS", default=[],
                   help="tensor-parallel layout of tensors the name rules do not know: GLOB=AXIS (split along AXIS) "
                        "or GLOB=none (replicated); every join is checked against the ranks' values")
    m.add_argument("--layout", metavar="tp=,pp=,ep=,etp=,vp=,sp=",
                   help="the run's parallel sizes (etp defaults to tp, the rest to 1; sp=1: sequence parallel); the "
                        "files present are checked against it; needed for experts when no checkpoint with the "
                        "run's saved arguments is found")
    m.add_argument("--args-from", metavar="PATH",
                   help="a checkpoint holding the run's saved arguments (--save dir, iter_* dir, common.pt or "
                        "model_optim_rng.pt; default: a checkpoint beside the dumps; none: do not look): layout, heads, "
                        "vocabulary")
    m.add_argument("--vocab-size", type=int, metavar="V",
                   help="the true vocabulary size: the padded rows of word_embeddings / output_layer are dropped")
    m.add_argument("--gated-mlp", action="store_true", help="linear_fc1 is a gated pair (SwiGLU): each rank holds "
                                                            "its part of both halves")
    m.add_argument("--moe-topk", type=int, metavar="K",
                   help="the run's --moe-router-topk: reads tokens_per_expert/ (--save-tokens-per-expert-interval) "
                        "into router/<router>/load (default: moe_router_topk in the run's saved arguments)")
    p.add_argument("--force", action="store_true", help="go on even if the estimate exceeds the free disk")
    output.add_overwrite(p, "the store")
    output.add_quiet(p)


def parse_tp_splits(entries: list[str]) -> dict[str, int | None]:
    """``--tp-split GLOB=AXIS|none`` entries as ``{glob: axis or None}`` (one-line SpecError when malformed)."""
    from gradforensics.errors import SpecError

    out: dict[str, int | None] = {}
    for e in entries:
        glob, sep, axis = e.rpartition("=")
        if not sep or not glob:
            raise SpecError(f"--tp-split {e!r}: expected GLOB=AXIS or GLOB=none.")
        if axis.lower() == "none":
            out[glob] = None
        elif axis.lstrip("-").isdigit():
            out[glob] = int(axis)
        else:
            raise SpecError(f"--tp-split {e!r}: the axis must be an integer or none.")
    return out


def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "gradforensics import")
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags
    from gradforensics.errors import HeadSplitError, SpecError
    from gradforensics.importing import import_run
    from gradforensics.replay.plan import parse_heads
    from gradforensics.store.remote import is_url

    output.check_store(args.out, args.overwrite)
    options = storage_flags.location(args, args.out).storage_options if is_url(args.out) else None
    try:
        store = import_run(args.source, args.out, format=args.format, tensors=args.tensors,
                           heads=parse_heads(args.heads), kind=args.kind, num_heads=args.num_heads,
                           num_query_groups=args.num_query_groups, gated_mlp=args.gated_mlp,
                           overwrite=args.overwrite, storage_options=options, quiet=args.quiet, force=args.force,
                           logs=args.logs, tp_splits=parse_tp_splits(args.tp_split),
                           layout=args.layout, args_from=args.args_from, vocab_size=args.vocab_size,
                           moe_topk=args.moe_topk)
    except HeadSplitError as exc:         # the fix in the command's words (--heads), not Python's
        raise SpecError(exc.cli) from None
    print(f"{args.out}: {store.n_records} records, {len(store.grads)} tensors, {store.meta.n_weights} weight "
          f"snapshots; next: gradforensics analyze {args.out} --out REPORT_DIR", file=sys.stderr)
    return 0
