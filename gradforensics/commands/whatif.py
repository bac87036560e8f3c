"""``gradforensics whatif CHECKPOINT --data NAME=FILE ... --arm NAME=OPT[:k=v,...] ... --steps K --out DIR``.

Replays the problem checkpoint K steps once per arm on identical batches,
records every step of every arm into ``DIR/<arm>.zarr`` (``mode="training"``),
analyses them and writes one report across the arms
(:func:`gradforensics.runs.whatif.whatif`; ``docs/whatif.md``).  Loading, the
offline rules, the data options and the size estimate are ``capture``'s;
``Ctrl-C`` stops it, leaves valid stores of the steps done, says what they hold
and exits 130.
"""

from __future__ import annotations

import argparse
import sys

from gradforensics.commands.capture import add_model_options, flags_of
from gradforensics.replay.plan import DEFAULT_SKETCH, DTYPE_NAMES, BatchSpec, ModelSpec, RecordSpec
from gradforensics.runs.arms import OPTIMIZERS

__all__ = ["add_arguments", "run"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a Hugging Face model directory, or a state-dict file with --model-factory")
    p.add_argument("--data", action="append", required=True, metavar="NAME=FILE",
                   help="a data source: .txt (one document a line) or .jsonl; repeat for each source")
    p.add_argument("--arm", action="append", required=True, metavar="NAME=OPT[:k=v,...]",
                   help=f"an arm: optimizer ({', '.join(OPTIMIZERS)}) and options, e.g. lo=adamw:lr=3e-4,"
                        "beta2=0.95,weight_decay=0.1,warmup=10,clip=1.0; repeat for each arm")
    p.add_argument("--mixture", action="append", default=[], metavar="ARM=SRC:W,...",
                   help="source weights of an arm, e.g. nozh=en:1,code:1 (default: every source, round-robin)")
    p.add_argument("--steps", type=int, required=True, metavar="K", help="optimizer steps per arm")
    from gradforensics.commands import output, workers

    output.add_out(p, "directory: <arm>.zarr per arm and the report")
    p.add_argument("--baseline", metavar="ARM", help="the arm the others are compared with (default: the first)")
    p.add_argument("--only", metavar="A,B", help="run only these analyses on each arm (comma-separated)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip compare/<arm>/ (the gradforensics compare report of each arm against the baseline)")
    p.add_argument("--optimizer-state", metavar="FILE",
                   help="optimizer state to continue from (default: optimizer.pt next to the weights; 'none': fresh)")
    g = p.add_argument_group("batches")
    g.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences per batch")
    g.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="tokens per sequence (packed; default 512, or the model's own limit when lower)")
    g.add_argument("--text-field", default="text", help="the document field of .jsonl lines (default text)")
    g.add_argument("--seed", type=int, default=0, help="seed of the batch draw, dropout and masked-LM masking")
    r = p.add_argument_group("what to record")
    r.add_argument("--tensors", nargs="+", metavar="GLOB", help="parameter globs (default: every 2-D weight)")
    r.add_argument("--heads", nargs="+", default=["auto"], metavar="SPEC",
                   help="auto (default), none, FILE.json, or GLOB=H[:axis=A,fused=F,role=R] / GLOB=none entries "
                        "(add auto to keep the rules for the rest)")
    r.add_argument("--activations", nargs="+", metavar="GLOB", help="module globs: per-unit activation statistics")
    r.add_argument("--sketch", type=int, default=DEFAULT_SKETCH, metavar="K",
                   help=f"K-dim sketch per tensor (per head); default {DEFAULT_SKETCH}; 0: whole tensors only")
    r.add_argument("--full", nargs="+", metavar="GLOB", help="tensors whose whole gradient is stored too")
    r.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="on-disk gradient format (default: as computed)")
    add_model_options(p)
    p.add_argument("--force", action="store_true", help="go on even if the estimate exceeds the free disk")
    output.add_overwrite(p, "the <arm>.zarr stores")
    workers.add_arguments(p)
    output.add_quiet(p)


def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "gradforensics whatif")
    require_extra("transformers", "gradforensics whatif")
    from gradforensics.errors import HeadSplitError, SpecError, WhatIfInterrupted
    from gradforensics.reporting.bands import SEVERITY_NAMES
    from gradforensics.reporting.severity import reaching
    from gradforensics.reporting.summary import group
    from gradforensics.runs.whatif import whatif

    if args.sketch < 0:
        raise SpecError(f"--sketch must be >= 0; got {args.sketch}.")
    from gradforensics.analysis.engine.options import select_analyses
    from gradforensics.commands import output, workers

    select_analyses(args.only, flag="--only")           # before any arm trains
    from pathlib import Path

    from gradforensics.runs.whatif import cleaned_on_failure

    try:    # an error leaves --out as it found it (the directory's mark included); Ctrl-C keeps the stores
        with cleaned_on_failure(Path(args.out)), output.out_dir(args.out, "whatif"), \
                workers.client(args) as client:
            res = whatif(args.checkpoint, args.data, args.arm, args.steps, args.out, mixtures=args.mixture,
                         baseline=args.baseline, batches=flags_of(args, BatchSpec),
                         record={**flags_of(args, RecordSpec), "sketch": args.sketch or None},
                         model=flags_of(args, ModelSpec), optimizer_state=args.optimizer_state,
                         overwrite=args.overwrite, force=args.force, compare_reports=not args.no_compare,
                         only=args.only, client=client, progress=not args.quiet, threads=args.threads)
    except WhatIfInterrupted as exc:
        print(f"gradforensics whatif: {exc}", file=sys.stderr)
        return 130
    except HeadSplitError as exc:         # the fix in the command's words (--heads), not Python's
        raise SpecError(exc.cli) from None
    for r in res.runs:
        hits = reaching(res.findings[r.arm.name].flags, SEVERITY_NAMES["medium"])
        n, g = len(hits), len(group(hits))
        unjudged = sorted({x.kind for x in res.findings[r.arm.name].not_judged})
        told = f" (not judged: {', '.join(unjudged)}; see the report)" if unjudged else ""
        print(f"{r.arm.name}: {r.steps_done} steps, loss {r.losses[0]:.4g} -> {r.losses[-1]:.4g}, "
              f"{g} finding{'s' if g != 1 else ''} at or above 0.5 ({n} flag{'s' if n != 1 else ''}){told}; "
              f"{r.state_note}; store {r.store}")
    print(f"open {res.paths['html']} in a browser.")
    return 0
